"""The n-gram kind, drafted in the coordinator before the gate decides (`NgramLookahead`).

Prompt lookup needs nothing but a request's token ids, which the coordinator holds, and costs
microseconds: so instead of a drafter replica drafting it on request, the coordinator looks it
up for every request of the step, up to its cap, before planning. What follows:
- the gate knows what the n-gram kind can draft for each request now (`GateInput.available`):
  where the context does not repeat it has nothing to offer, and no other kind is displaced
  to find that out (it used to be asked, draft nothing, and fall back);
- the kind learns from every step, not only those it drafts: its look-ahead is judged against
  the tokens the step emitted (`dcut_core.acceptance.hindsight_outcomes`), for free;
- the look-ahead is the drafts alone (a dict access or two a request); their confidences, which
  cost tens of µs for an n-gram repeated many times, are computed only for the requests the
  plan gives the kind;
- an engine drafting only n-gram (the serving default) has no drafter replica at all: no
  drafting call, no context sent anywhere.

Above `LOOKAHEAD_REQUESTS` decoding requests there is no look-ahead (its Python would cost a
GPU step's share): the kind drafts on demand for the requests the plan gives it, its histories
brought up to date then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from actors.drafter.base import DraftOutput
from actors.drafter.ngram import NgramDrafter
from actors.engine.sequence import Sequence
from dcut_core import ragged
from dcut_core.acceptance import IN_TURN_REQUESTS, hindsight_outcomes
from dcut_core.gate import LOOKAHEAD_REQUESTS, Plan

if TYPE_CHECKING:
    from actors.engine.stages import Feed

LOCAL_KIND = "ngram"  # the drafter kind the coordinator drafts itself


@dataclass(frozen=True)
class Lookahead:
    """The look stage's output: the drafts the n-gram kind would make for every request of the
    step (ragged, batch order, up to each request's cap), without their confidences — those are
    computed only for the requests the plan gives it (`NgramLookahead.draft`)."""

    kind: int  # the n-gram kind's index among the engine's kinds
    tokens: np.ndarray  # [N]
    cu: np.ndarray  # [R + 1]
    seconds: float = 0.0

    @cached_property
    def counts(self) -> np.ndarray:
        """[R] drafts it can make for each request now."""
        return ragged.lengths(self.cu)

    def available(self, kinds: int) -> np.ndarray:
        """[R, kinds] for the gate: its counts in its own column, -1 (not known) in the others."""
        out = np.full((len(self.counts), kinds), -1, dtype=np.int64)
        out[:, self.kind] = self.counts
        return out

    def hindsight(self, counts: np.ndarray, kinds: np.ndarray,
                  emitted: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch indices, judged, accepted): what the look-ahead of the requests this kind did not
        draft for (counts [R] drafted, kinds [R] the kind that drafted) would have had accepted,
        judged against the tokens each emitted; only requests with something judged."""
        if len(counts) <= IN_TURN_REQUESTS:
            return self._hindsight_in_turn(counts.tolist(), kinds.tolist(), emitted)
        idx = ((self.counts > 0) & ~((counts > 0) & (kinds == self.kind))).nonzero()[0]
        if not len(idx):
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        flat, cu = ragged.gather(self.cu, idx)
        em, cu_e = ragged.flatten([emitted[i] for i in idx.tolist()], dtype=np.int64)
        judged, accepted = hindsight_outcomes(self.tokens[flat], cu, em, cu_e)
        keep = judged > 0
        return idx[keep], judged[keep], accepted[keep]

    def _hindsight_in_turn(self, counts: list[int], kinds: list[int],
                           emitted: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`hindsight` walking a few requests in plain Python (integers: the same answer)."""
        tokens, cu = self.tokens.tolist(), self.cu.tolist()
        idx, judged, accepted = [], [], []
        for i, (n, k, out) in enumerate(zip(counts, kinds, emitted, strict=True)):
            if cu[i + 1] == cu[i] or (n > 0 and k == self.kind):  # nothing looked up, or it drafted
                continue
            mine = tokens[cu[i]:cu[i + 1]]
            m = min(len(mine), len(out))
            if not m:
                continue
            a = 0
            while a < m and mine[a] == out[a]:
                a += 1
            idx.append(i)
            judged.append(m)
            accepted.append(a)
        return (np.array(idx, dtype=np.int64), np.array(judged, dtype=np.int64),
                np.array(accepted, dtype=np.int64))


class NgramLookahead:
    """Owns the n-gram histories of the running requests (an `NgramDrafter` that follows the
    sequences), makes each step's `Lookahead`, and drafts for the requests the plan gives it."""

    def __init__(self, kind: int, block: int, corpus_tokens: int = 0) -> None:
        self.kind = kind
        self.drafter = NgramDrafter(block_size=block, corpus_tokens=corpus_tokens)

    def look(self, batch: list[Sequence], caps: np.ndarray) -> Lookahead:
        """What it would draft for each request, up to caps[i], its history brought up to date
        first."""
        t0 = time.perf_counter()
        rids = [s.rid for s in batch]
        self.drafter.follow(rids, [s.prompt for s in batch], [s.output for s in batch])
        tokens, cu = self.drafter.peek(rids, np.asarray(caps, dtype=np.int64).tolist())
        return Lookahead(self.kind, tokens, cu, time.perf_counter() - t0)

    def draft(self, batch: list[Sequence], plan: Plan) -> tuple[list[int], DraftOutput] | None:
        """(batch indices, drafts with their confidences) of the requests the plan gives this
        kind — the first plan.lengths[i] of each one's look-ahead; None if it gives it none."""
        idx = ((plan.kinds == self.kind) & (plan.lengths > 0)).nonzero()[0].tolist()
        if not idx:
            return None
        t0 = time.perf_counter()
        mine = [batch[i] for i in idx]
        rids = [s.rid for s in mine]
        self.drafter.follow(rids, [s.prompt for s in mine], [s.output for s in mine])  # no look this step
        out = self.drafter.draft(rids, [s.last for s in mine], plan.lengths[idx].tolist())
        spent = time.perf_counter() - t0
        return idx, DraftOutput(out.tokens, out.cu, out.confidence, out.margin, compute_s=spent,
                                kinds=np.full(len(idx), self.kind), kind_s={self.kind: spent}, kind_context={})

    def ingest(self, feeding: list[Feed]) -> None:
        """The prompt chunks a step feeds, into their requests' histories: with a learner thread
        (`Engine.verify`) a long prompt is indexed chunk by chunk during the forwards that feed
        it, not whole at its first decode step, where a 32k-token prompt's index (~35 ms here)
        had held up the step of every running request."""
        for f in feeding:
            if f.seq.finish_reason is not None:  # finished as its prompt ended (released already)
                continue
            prompt = f.seq.prompt
            tokens = f.tokens[:max(0, len(prompt) - f.start)]  # a resumed request's feed runs on into its output
            if tokens:
                self.drafter.ingest(f.seq.rid, f.start, tokens, len(prompt))

    def release(self, rids: list[int]) -> None:
        """Forget the requests; what they output joins the corpus at the next `absorb`."""
        self.drafter.release(rids)

    def absorb(self, requests: int) -> None:
        """Released requests' outputs into the corpus (`actors/drafter/ngram.py`) after a step
        of `requests` decoding requests — dropped above `LOOKAHEAD_REQUESTS`, where the kind
        seldom drafts and taking in ~1,000 tokens a step would cost a GPU step's share."""
        self.drafter.absorb(keep=requests <= LOOKAHEAD_REQUESTS)

    def forget_outputs(self) -> None:
        """Empty the corpus of earlier requests' outputs (a benchmark's second run of the same
        prompts measures what the estimators learnt, not drafts from the first run's outputs)."""
        self.drafter.forget_outputs()

    def held(self) -> int:
        return len(self.drafter.held_requests())
