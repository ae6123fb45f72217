"""Acceptance estimates: from a drafter's confidences to calibrated survivals.

A drafter reports, per draft token, its confidence (softmax probability of the drafted token)
and the top-2 margin. `Calibrator` maps those, plus the draft's position in the block, to
p = P(draft accepted | every earlier draft of the request accepted), learned online from
verification outcomes. Survival is the running product of p along a request.

Censoring: a pruned draft was never verified, and a draft after the first rejection was never
judged on its own; both say nothing about p and are left out of the fit (not counted as
rejections, which would bias p low for exactly the drafts D-Cut prunes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core import ragged

_EPS = 1e-6


def survival(p: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """Survivals [N] from per-draft acceptance estimates [N] (ragged by cu)."""
    return ragged.segment_cumprod(np.minimum(np.maximum(p, 0.0), 1.0), cu)  # np.clip's, at a quarter of its cost


def verify_outcomes(cu_drafted: np.ndarray, kept: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which drafts were judged and how: (flat indices [M], accepted? [M]).

    Request i kept k_i drafts and had a_i of them accepted (a_i <= k_i): drafts 0..a_i-1 were
    accepted, draft a_i was rejected if a_i < k_i, everything later is censored.
    """
    idx, ok, _ = judged_drafts(cu_drafted, kept, accepted)
    return idx, ok


# Up to this many requests a step's judged drafts (`judged_drafts`), its verifications and its
# look-ahead's hindsight (actors/engine/learning.py, lookahead.py) are walked in plain Python:
# integers and copies, the same answers; numpy's calls had cost more than the loops (the three
# 45 → 28 µs a step at one request, 58 → 43 at eight, level at sixteen; session 46).
IN_TURN_REQUESTS = 8


def judged_drafts(cu_drafted: np.ndarray, kept: np.ndarray,
                  accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`verify_outcomes` with each judged draft's position in its request: (flat indices [M],
    accepted? [M], positions [M])."""
    if len(kept) <= IN_TURN_REQUESTS:
        kept = np.asarray(kept, dtype=np.int64).tolist()
        accepted = np.asarray(accepted, dtype=np.int64).tolist()
        if any(a > k or a < 0 for a, k in zip(accepted, kept, strict=True)):
            raise ValueError("accepted counts must satisfy 0 <= accepted <= kept")
        idx, ok, pos = [], [], []
        for start, end, k, a in zip(cu_drafted[:-1].tolist(), cu_drafted[1:].tolist(), kept, accepted, strict=True):
            for j in range(min(k, a + 1, end - start)):
                idx.append(start + j)
                ok.append(j < a)
                pos.append(j)
        return np.array(idx, dtype=np.int64), np.array(ok, dtype=bool), np.array(pos, dtype=np.int64)
    kept = np.asarray(kept, dtype=np.int64)
    accepted = np.asarray(accepted, dtype=np.int64)
    if (accepted > kept).any() or (accepted < 0).any():
        raise ValueError("accepted counts must satisfy 0 <= accepted <= kept")
    lengths = ragged.lengths(cu_drafted)
    pos = ragged.positions(cu_drafted)
    k = np.repeat(kept, lengths)
    a = np.repeat(accepted, lengths)
    judged = (pos < k) & (pos <= a)
    idx = np.nonzero(judged)[0]
    return idx, pos[idx] < a[idx], pos[idx]


def hindsight_outcomes(tokens: np.ndarray, cu: np.ndarray, emitted: np.ndarray,
                       cu_emitted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drafts nobody verified, judged after the step against the tokens it emitted: per request
    (judged [R], accepted [R]). The first min(drafts, emitted) drafts of request i are compared
    with its emitted tokens (draft j guessed the token the step emitted j-th), and `accepted` of
    them match in a row. What lies past the emitted tokens is unknown: accepted = judged says
    nothing of later drafts (censored, as `verify_outcomes` treats kept drafts). The n-gram
    look-ahead is made for every request each step, so its kind learns this way from every step,
    not only from the steps it drafts for."""
    cu, cu_emitted = np.asarray(cu, dtype=np.int64), np.asarray(cu_emitted, dtype=np.int64)
    judged = np.minimum(ragged.lengths(cu), ragged.lengths(cu_emitted))
    cu_j = ragged.offsets_from_lengths(judged)
    pos, seg = ragged.positions(cu_j), ragged.segment_ids(cu_j)
    match = np.asarray(tokens)[cu[:-1][seg] + pos] == np.asarray(emitted)[cu_emitted[:-1][seg] + pos]
    return judged, ragged.leading_true(match, cu_j)


def _logit(x: np.ndarray) -> np.ndarray:
    x = np.minimum(np.maximum(x, _EPS), 1.0 - _EPS)
    return np.log(x) - np.log1p(-x)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


@dataclass
class Calibrator:
    """Online logistic calibration of draft confidences (Platt scaling with extra features).

    Features: [1, logit(confidence), margin, position / block]. The weights start at the
    identity map (p = confidence) and the ridge penalty pulls toward it, so with little data
    the estimate is the raw confidence and it moves only as evidence accumulates.
    """

    block: int = 16
    ridge: float = 1.0
    refit_every: int = 256
    keep: int = 16384
    weights: np.ndarray = field(default_factory=lambda: np.array([0.0, 1.0, 0.0, 0.0]))
    observed: int = 0
    # Judged drafts since the last fit, raw: (confidence, margin, position, accepted) arrays; the
    # design matrix is built at a fit (`features` at every step was a third of what it cost)
    _seen: list[tuple[np.ndarray, ...]] = field(default_factory=list, repr=False)
    _pending: int = 0

    PRIOR = np.array([0.0, 1.0, 0.0, 0.0])

    def features(self, confidence: np.ndarray, margin: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Design matrix [N, 4]."""
        conf = np.asarray(confidence, dtype=np.float64)
        return np.stack(
            [np.ones_like(conf), _logit(conf), np.asarray(margin, dtype=np.float64),
             np.asarray(position, dtype=np.float64) / self.block],
            axis=-1,
        )

    def estimate(self, confidence: np.ndarray, margin: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Calibrated P(accept | prefix accepted) [N]: `features` @ weights, the terms summed
        directly (no [N, 4] matrix: a step asks for a few drafts, and the matrix was most of it)."""
        w0, w1, w2, w3 = self.weights.tolist()
        z = w1 * _logit(np.asarray(confidence, dtype=np.float64)) + w0
        if w2:
            z += w2 * np.asarray(margin, dtype=np.float64)
        if w3:
            z += (w3 / self.block) * np.asarray(position, dtype=np.float64)
        return _sigmoid(z)

    def observe(self, confidence: np.ndarray, margin: np.ndarray, position: np.ndarray,
                accepted: np.ndarray) -> None:
        """Add judged (uncensored) drafts; refits once `refit_every` of them, or a quarter of
        the kept ones, are new (whichever is more). A fit's cost grows with the kept window (0.8
        ms at 16,384 kept here), so its cost per observation stays the same: with a fixed 256,
        a step of 256 requests drafting 15 each refitted almost every step."""
        y = np.asarray(accepted, dtype=np.float64)
        if len(y) == 0:
            return
        self._seen.append((*(np.asarray(a, dtype=np.float64) for a in (confidence, margin, position)), y))
        self.observed += len(y)
        self._pending += len(y)
        if self._pending >= max(self.refit_every, min(self.observed, self.keep) // 4):
            self.fit()

    def fit(self, newton_steps: int = 20) -> None:
        """Penalised maximum likelihood over the kept observations (Newton's method)."""
        conf, margin, pos, y = (np.concatenate(col)[-self.keep:] for col in zip(*self._seen, strict=True)) \
            if self._seen else (np.zeros(0),) * 4
        self._seen, self._pending = [(conf, margin, pos, y)], 0
        x = self.features(conf, margin, pos)
        w = self.weights.copy()
        lam = self.ridge * np.eye(len(w))
        for _ in range(newton_steps):
            p = _sigmoid(x @ w)
            grad = x.T @ (p - y) + lam @ (w - self.PRIOR)
            hess = (x * (p * (1.0 - p))[:, None]).T @ x + lam
            step = np.linalg.solve(hess, grad)
            w -= step
            if np.abs(step).max() < 1e-8:
                break
        self.weights = w


def expected_calibration_error(pred: np.ndarray, outcome: np.ndarray, bins: int = 15) -> float:
    """Σ_b (n_b / n) · |mean pred_b − mean outcome_b| over equal-width probability bins."""
    pred = np.asarray(pred, dtype=np.float64)
    outcome = np.asarray(outcome, dtype=np.float64)
    if len(pred) == 0:
        return 0.0
    b = np.minimum((pred * bins).astype(np.int64), bins - 1)
    n = np.bincount(b, minlength=bins)
    gap = np.abs(np.bincount(b, pred, bins) - np.bincount(b, outcome, bins))
    return float(gap.sum() / n.sum())


def brier_score(pred: np.ndarray, outcome: np.ndarray) -> float:
    """Mean squared error of probabilistic predictions."""
    pred = np.asarray(pred, dtype=np.float64)
    return float(np.mean((pred - np.asarray(outcome, dtype=np.float64)) ** 2)) if len(pred) else 0.0
