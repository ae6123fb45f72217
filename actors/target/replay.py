"""A target that answers from known greedy outputs instead of running a model (`ReplayRank`), for
measuring the coordinator's own time at any batch size on this machine (issue #26).

Greedy decoding is lossless, so a request's output is known in advance (a counterfactual trace
holds it, or any earlier greedy run). `ReplayRank` is a `TargetRank` whose forward looks each
logit row up in that output instead of computing it: the row at position p of a request whose
context so far equals its prompt + output[:p − prompt + 1] is the next output token. Everything
above the rank — `InProcessGroup`, the engine's stages, the drafters it hosts (the real n-gram
drafter) — runs unchanged. A forward takes `forward_s(shape)` seconds (a sleep: a synthetic
forward whose time the caller chooses; none by default), so the engine's cost model and gate see
the step times they would on a real unit.

A start-up profile of the target (request ids from `profile.FIRST_RID`, random tokens) gets
EOS rows: it times the forward, whose answers nobody reads. Greedy only, and no drafter
features: a kind that reads the target's hidden states (block, MTP, EAGLE-3) has none to read
here; the n-gram drafter needs none.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from actors.ray_env import whereabouts
from actors.target.group import EPConfig, InProcessGroup
from actors.target.moe import StepStats
from actors.target.profile import FIRST_RID
from actors.target.worker import RankBatch, RankResult, TargetRank, WorkerSpec
from dcut_core.cost_model import StepShape


class ReplayRank(TargetRank):
    """One rank (EP 1) answering from `continuations`: prompt tokens -> its greedy output."""

    def __init__(self, spec: WorkerSpec, guests: tuple, continuations: dict[tuple[int, ...], list[int]],
                 eos: int | None, forward_s: Callable[[StepShape], float] | None = None) -> None:
        super().__init__(spec, guests)
        self.table = {tuple(p): np.asarray([*p, *o], dtype=np.int64) for p, o in continuations.items()}
        self.prompt_lengths = sorted({len(p) for p in self.table}, reverse=True)
        self.eos = -1 if eos is None else eos
        self.forward_s = forward_s
        self.context: dict[int, list[int]] = {}  # request -> tokens fed (its KV cache)
        self.sequence: dict[int, np.ndarray] = {}  # request -> prompt + greedy output, once known

    def setup(self, master) -> dict:
        return {"rank": 0, "experts": (0, 0)} | whereabouts()

    def forward(self, rb: RankBatch) -> RankResult:
        t0 = time.perf_counter()
        if rb.truncate:
            self.truncate(rb.truncate)
        if rb.temperature is not None and len(rb.temperature) and float(rb.temperature.max()) > 0:
            raise ValueError("the replay target decodes greedily only")
        if rb.with_logits or (rb.logprob_rows is not None and rb.logprob_rows.any()):
            raise ValueError("the replay target has no logits")
        starts = np.empty(len(rb.request_ids), dtype=np.int64)
        for j, rid in enumerate(rb.request_ids):
            ctx = self.context.setdefault(rid, [])
            starts[j] = len(ctx)
            ctx.extend(rb.tokens[rb.cu[j]:rb.cu[j + 1]].tolist())
        owner = np.searchsorted(rb.cu, rb.logit_index, side="right") - 1
        position = starts[owner] + rb.logit_index - rb.cu[owner]  # each row's position in its request
        argmax = np.full(len(owner), self.eos, dtype=np.int64)
        bounds = np.searchsorted(owner, np.arange(len(rb.request_ids) + 1))  # rows come request by request
        for j, rid in enumerate(rb.request_ids):
            a, b = int(bounds[j]), int(bounds[j + 1])
            if a == b or rid >= FIRST_RID:  # no rows, or a start-up profile's random tokens: EOS will do
                continue
            seq = self._sequence(rid)
            p = position[a:b] + 1
            argmax[a:b] = np.where(p < len(seq), seq[np.minimum(p, len(seq) - 1)], self.eos)
        context = int(starts.sum())
        stats = StepStats(tokens=len(rb.tokens), requests=len(rb.request_ids), context=context)
        if self.forward_s is not None:
            time.sleep(max(0.0, self.forward_s(StepShape(len(rb.request_ids), len(rb.tokens), context))))
        stats.total_s = time.perf_counter() - t0
        return RankResult(argmax, None, {}, stats)

    def _sequence(self, rid: int) -> np.ndarray:
        """The request's prompt + output: the recorded prompt its context starts with."""
        if rid not in self.sequence:
            ctx = self.context[rid]
            for n in self.prompt_lengths:
                seq = self.table.get(tuple(ctx[:n]))
                if seq is not None and len(ctx) >= n:
                    self.sequence[rid] = seq
                    break
            else:
                raise ValueError(f"request {rid}: no recorded greedy output for its prompt")
        return self.sequence[rid]

    def truncate(self, lengths: dict[int, int]) -> None:
        for rid, n in lengths.items():
            del self.context[rid][n:]

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.context.pop(rid, None)
            self.sequence.pop(rid, None)

    def cache_info(self) -> dict:
        return {"free_tokens": 0, "requests": len(self.context),
                "lengths": {rid: len(c) for rid, c in self.context.items()}, "feature_rows": 0}


class ReplayGroup(InProcessGroup):
    """`InProcessGroup` over a `ReplayRank`."""

    def __init__(self, cfg: EPConfig, continuations: dict, eos: int | None,
                 forward_s: Callable[[StepShape], float] | None = None) -> None:
        self._replay = (continuations, eos, forward_s)
        super().__init__(cfg)

    def _new_rank(self, spec: WorkerSpec, guests: tuple) -> ReplayRank:
        return ReplayRank(spec, guests, *self._replay)
