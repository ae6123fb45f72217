"""Plain data and pure helpers of the coordinator's stages (drafts in, tokens out)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.drafter.base import DraftOutput
from actors.engine.sequence import Sequence
from dcut_core import rules


@dataclass
class Drafts:
    """This step's drafts for the whole batch, in batch order (ragged)."""

    tokens: np.ndarray  # [N]
    cu: np.ndarray  # [R + 1]
    confidence: np.ndarray  # [N]
    margin: np.ndarray  # [N]
    seconds: float = 0.0  # wall time of the drafting stage
    compute_seconds: float = 0.0  # the slowest replica's own drafting time inside it
    decision_seconds: float = 0.0  # wall time of the pruning decision
    survival: np.ndarray | None = None
    decision: object = None
    probe_seconds: float = 0.0  # the oracle's extra verification pass (not part of a real step)


@dataclass
class StepRecord:
    """What one step did and how long it took (seconds)."""

    requests: int
    drafted: int
    kept: int
    accepted: int
    verify_tokens: int
    predicted_verify_s: float
    measured_verify_s: float
    draft_s: float
    decision_s: float
    probe_s: float = 0.0
    step_s: float = 0.0  # wall time of the decode step, plan to postprocess (prefill excluded)
    target_compute_s: float = 0.0  # the slowest rank's own forward time
    draft_compute_s: float = 0.0  # the slowest replica's own drafting time

    @property
    def overhead_s(self) -> float:
        """Everything outside the drafter's and the target's forward passes: Ray calls, pruning,
        bookkeeping (the probe pass of the oracle excluded)."""
        return max(0.0, self.step_s - self.probe_s - self.target_compute_s - self.draft_compute_s)


def empty_drafts(r: int) -> Drafts:
    z = np.zeros(0)
    return Drafts(np.zeros(0, dtype=np.int64), np.zeros(r + 1, dtype=np.int64), z, z)


def merge_drafts(r: int, outs: dict[int, tuple[list[int], DraftOutput]]) -> Drafts:
    """Scatter each replica's ragged output back into batch order."""
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [(np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0))
                                                             for _ in range(r)]
    for idx, d in outs.values():
        for j, i in enumerate(idx):
            sl = slice(d.cu[j], d.cu[j + 1])
            rows[i] = (d.tokens[sl], d.confidence[sl], d.margin[sl])
    cu = np.zeros(r + 1, dtype=np.int64)
    np.cumsum([len(t) for t, _, _ in rows], out=cu[1:])
    return Drafts(np.concatenate([t for t, _, _ in rows]).astype(np.int64), cu,
                  np.concatenate([c for _, c, _ in rows]), np.concatenate([m for _, _, m in rows]))


def first_tokens(seqs: list[Sequence], last_out: dict) -> list[int]:
    """The token after each prompt: the target's argmax, or a draw from its distribution."""
    out = []
    for s in seqs:
        argmax, probs = last_out[s.rid]
        if s.greedy:
            out.append(int(argmax[-1]))
        else:
            out.append(int(rules.inverse_cdf(np.asarray(probs[-1:], dtype=np.float64), s.uniforms(0, 1))[0]))
    return out


def accept_tokens(batch: list[Sequence], drafts: Drafts, kept: np.ndarray,
                  out) -> tuple[list[int], list[list[int]]]:
    """Lossless acceptance per request: greedy match at temperature 0; otherwise coupled sampling
    (`rules.coupled_sampling`) with the request's per-position uniforms, so a seed fixes the
    output whatever the policy, the batch or the drafter did. The oracle's
    look-ahead may call it too: uniforms are per position, so it draws nothing extra."""
    accepted, emitted = [], []
    for i, s in enumerate(batch):
        k = int(kept[i])
        d = drafts.tokens[drafts.cu[i]:drafts.cu[i] + k]
        cu = np.array([0, k])
        if s.greedy:
            res = rules.greedy(d, cu, np.asarray(out.argmax[i]))
        else:
            u = s.uniforms(len(s.output), k + 1)  # output positions this step can fill
            res = rules.coupled_sampling(d, cu, np.asarray(out.probs[i], dtype=np.float64), u)
        accepted.append(int(res.accepted[0]))
        emitted.append(res.tokens.tolist())
    return accepted, emitted
