"""Acceptance traces for the simulator: what each request's drafts would do if verified.

One draw is one request's block at one step: the drafter's raw confidence per draft position and
the true accepted length `a` (drafts 0..a−1 would pass, draft a would fail). Whatever a policy
keeps, k kept drafts then yield min(a, k) accepted — verification is the same event seen
through a narrower window, so every policy in a simulated run faces the same drafts.

Two sources behind one interface:

* `SyntheticTrace` — each request has a quality q ~ Beta (the spread between requests that D-Cut
  feeds on); each draft's true acceptance probability scatters around q on the logit scale; the
  drafter reports that probability with noise and an optional bias (a miscalibrated drafter).
  `published.fit_trace` sets its parameters from a published experiment.
* `RecordedTrace` — rows recorded by the engine under the `full` policy (every draft verified,
  so `a` is observed uncensored): per-draft conditional estimates and accepted lengths.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    return np.log(p) - np.log1p(-p)


@dataclass(frozen=True)
class Draw:
    """Drafts of a batch of requests at one step, all of full length d = block − 1."""

    confidence: np.ndarray  # [R, d] the drafter's raw confidence per draft
    accepted: np.ndarray  # [R] int64 true accepted length, 0..d


@dataclass(frozen=True)
class SyntheticTrace:
    """Per-request quality ~ Beta(mean · κ, (1 − mean) · κ); per-draft logit noise around it."""

    mean: float = 0.75  # mean conditional acceptance of a draft
    concentration: float = 6.0  # κ: smaller means requests differ more
    token_noise: float = 1.0  # sd of a draft's true acceptance logit around its request's
    conf_noise: float = 0.5  # sd of the drafter's confidence logit around the truth
    conf_bias: float = 0.0  # logit shift of the confidence (> 0: over-confident)

    def new_requests(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Qualities [n] of fresh requests."""
        k = self.concentration
        return rng.beta(self.mean * k, (1.0 - self.mean) * k, size=n)

    def draw(self, rng: np.random.Generator, quality: np.ndarray, drafts: int) -> Draw:
        r = len(quality)
        z = _logit(quality)[:, None] + self.token_noise * rng.standard_normal((r, drafts))  # [R, d]
        p = _sigmoid(z)
        passed = rng.random((r, drafts)) < p
        accepted = np.where(passed.all(1), drafts, np.argmin(passed, axis=1)).astype(np.int64)
        conf = _sigmoid(z + self.conf_bias + self.conf_noise * rng.standard_normal((r, drafts)))
        return Draw(conf, accepted)


@dataclass(frozen=True)
class RecordedTrace:
    """Rows (conditional estimates [d], accepted length) recorded under the `full` policy.

    Rows are resampled independently per request and step: the recording has no request
    identity across steps, so a request's persistence (what the drafting gate learns) is lost.
    """

    conditional: np.ndarray  # [N, d] per-draft P(accept | earlier accepted), rows padded with 0
    lengths: np.ndarray  # [N] drafts in the row
    accepted: np.ndarray  # [N]

    @classmethod
    def from_steps(cls, records: Iterable[dict]) -> RecordedTrace:
        """Rows from engine step-log records (`actors.engine.steplog`) where nothing was pruned."""
        rows, lens, acc = [], [], []
        for rec in records:
            drafted, kept = np.asarray(rec["drafted"]), np.asarray(rec["kept"])
            surv = np.asarray(rec["survival"], dtype=np.float64)
            if not len(surv) or (kept != drafted).any():
                continue  # pruned steps are censored: a == kept says only a >= kept
            cu = np.concatenate([[0], np.cumsum(drafted)])
            for i, d in enumerate(drafted):
                if d == 0:
                    continue
                s = surv[cu[i]:cu[i + 1]]
                prev = np.concatenate([[1.0], s[:-1]])
                rows.append(np.where(prev > 0, s / np.maximum(prev, 1e-12), 0.0))
                lens.append(int(d))
                acc.append(int(rec["accepted"][i]))
        if not rows:
            raise ValueError("no unpruned steps with survivals in the step log (record with --policies full)")
        width = max(lens)
        cond = np.zeros((len(rows), width))
        for j, row in enumerate(rows):
            cond[j, :len(row)] = row
        return cls(cond, np.asarray(lens, dtype=np.int64), np.asarray(acc, dtype=np.int64))

    @property
    def block(self) -> int:
        return int(self.lengths.max()) + 1

    def new_requests(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)  # no per-request state survives resampling

    def draw(self, rng: np.random.Generator, quality: np.ndarray, drafts: int) -> Draw:
        full = np.nonzero(self.lengths >= drafts)[0]
        if not len(full):
            raise ValueError(f"the recording has no rows with {drafts} drafts (its block is {self.block})")
        pick = rng.choice(full, size=len(quality))
        return Draw(self.conditional[pick, :drafts], np.minimum(self.accepted[pick], drafts))
