"""Plain data and pure helpers of the coordinator's stages (drafts in, tokens out)."""

from __future__ import annotations

import copy
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


def _draw(p: np.ndarray | None, argmax: int, u: float) -> int:
    if p is None:
        return int(argmax)
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1))


def first_tokens(seqs: list[Sequence], last_out: dict) -> list[int]:
    """The token after each prompt: the target's argmax, or a draw from its distribution."""
    out = []
    for s in seqs:
        argmax, probs = last_out[s.rid]
        out.append(int(argmax[-1]) if s.greedy else _draw(probs[-1], argmax[-1], s.rng.random()))
    return out


def accept_tokens(batch: list[Sequence], drafts: Drafts, kept: np.ndarray, out,
                  probe: bool = False) -> tuple[list[int], list[list[int]]]:
    """Lossless acceptance per request: greedy match at temperature 0, speculative sampling with
    deterministic (one-hot) drafts otherwise. Each request draws its uniforms from its own
    generator — `probe` draws from a copy, leaving the request's stream untouched."""
    accepted, emitted = [], []
    for i, s in enumerate(batch):
        k = int(kept[i])
        d = drafts.tokens[drafts.cu[i]:drafts.cu[i] + k]
        cu = np.array([0, k])
        if s.greedy:
            res = rules.greedy(d, cu, np.asarray(out.argmax[i]))
        else:
            rng = copy.deepcopy(s.rng) if probe else s.rng
            u_accept, u_sample = rng.random(k), rng.random(1)
            res = rules.speculative(d, cu, None, np.asarray(out.probs[i], dtype=np.float64), u_accept, u_sample)
        accepted.append(int(res.accepted[0]))
        emitted.append(res.tokens.tolist())
    return accepted, emitted
