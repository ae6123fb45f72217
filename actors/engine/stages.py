"""Plain data and pure helpers of the coordinator's stages (drafts in, tokens out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from actors.drafter.base import DraftOutput, merge_outputs
from actors.engine.lookahead import Lookahead
from actors.engine.sequence import Census, Sequence
from actors.target.group import TargetOutput
from dcut_core import ragged, rules
from dcut_core.gate import Plan
from dcut_core.pruning import StepCost

# Up to this many decoding requests a step's drafts are accepted on lists (`rules.greedy_in_turn`):
# numpy's per-call cost had been the accept stage's whole cost at one request.
IN_TURN_REQUESTS = 16


@dataclass(frozen=True)
class Drafts:
    """The propose stage's output: this step's drafts for the whole batch, in batch order
    (ragged), and the kind that drafted each request."""

    tokens: np.ndarray  # [N]
    cu: np.ndarray  # [R + 1]
    confidence: np.ndarray  # [N]
    margin: np.ndarray  # [N]
    kinds: np.ndarray  # [R] the drafter kind (index) of each request's drafts (the one asked, if none)
    seconds: float = 0.0  # wall time of the drafting stage
    compute_seconds: float = 0.0  # the slowest replica's own drafting time inside it

    @cached_property
    def counts(self) -> np.ndarray:
        """[R] drafts made for each request."""
        return ragged.lengths(self.cu)


@dataclass(frozen=True)
class Pruned:
    """The prune stage's output: the drafts kept per request, and what the decision saw."""

    kept: np.ndarray  # [R]
    estimate: np.ndarray | None = None  # [N] calibrated conditional acceptance of each draft
    survival: np.ndarray | None = None  # [N] the policy's survival of each draft
    seconds: float = 0.0  # wall time of the decision
    probe_seconds: float = 0.0  # the oracle's extra verification pass (not part of a real step)


@dataclass(frozen=True)
class Accepted:
    """The accept stage's output: drafts accepted per request, and the tokens each gains."""

    counts: list[int]
    emitted: list[list[int]]


@dataclass
class Step:
    """The record of one decode step: each stage's output, filled in order; `Engine.commit` is
    its one consumer (the estimators learn from it, the step log writes it)."""

    batch: list[Sequence]  # decoding requests
    feeding: list[Feed]  # this step's prefill chunks
    started: float  # perf_counter at plan
    census: Census  # the running set's counts (`Scheduler.census`): what its stages need not look for
    context: int = 0  # tokens in the decoding requests' KV caches when the step began
    verify_cost: StepCost | None = None  # the target's verify time by token count for this batch and context
    caps: np.ndarray | None = None  # [R] the most drafts each request may verify (None: the step drafts nothing)
    lookahead: Lookahead | None = None
    plan: Plan | None = None
    drafts: Drafts | None = None
    pruned: Pruned | None = None
    out: TargetOutput | None = None
    accepted: Accepted | None = None
    cached: list[int] = field(default_factory=list)  # each decoding request's KV length when the step began
    remaining: np.ndarray | None = None  # [R] tokens each may still make (computed where the step may draft)
    arm: int | None = None  # the payoff check's measured arm (an index of its `arms`); None: not measured
    only: int | None = None  # the one kind the gate may choose this step (the check's kind arm); None: any

    @cached_property
    def rids(self) -> np.ndarray:
        """[R] the decoding requests' ids, in batch order: read by several stages, made once."""
        return np.fromiter([s.rid for s in self.batch], dtype=np.int64, count=len(self.batch))

    @property
    def verify_tokens(self) -> int:
        return int(len(self.batch) + self.pruned.kept.sum())

    @property
    def prefill_tokens(self) -> int:
        return sum(len(f.tokens) for f in self.feeding)


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
    step_s: float = 0.0  # wall time of the step, plan to commit (its prefill chunks included)
    target_compute_s: float = 0.0  # the slowest rank's own forward time
    draft_compute_s: float = 0.0  # the slowest replica's own drafting time
    prefill_tokens: int = 0  # prompt tokens fed in the same forward (chunked prefill)
    rank_compute_s: tuple[float, ...] = ()  # each rank's own forward time, in rank order
    graph_captures: int = 0  # CUDA graphs the ranks captured in this step (actors/target/graphs.py)

    @property
    def overhead_s(self) -> float:
        """Everything outside the drafter's and the target's forward passes: Ray calls, pruning,
        bookkeeping (the probe pass of the oracle excluded)."""
        return max(0.0, self.step_s - self.probe_s - self.target_compute_s - self.draft_compute_s)


@dataclass(frozen=True)
class Feed:
    """One prefill chunk of a step: `tokens` = seq.feed[start:start + len(tokens)]."""

    seq: Sequence
    start: int
    tokens: list[int]

    @property
    def logit_rows(self) -> list[int]:
        """The target's row is needed only where a fresh prompt ends (its first token), and at
        every position when the prompt's log-probabilities are asked for."""
        if self.seq.params.prompt_logprobs is not None:
            return list(range(len(self.tokens)))
        ends = self.start + len(self.tokens) == self.seq.feed_len
        return [len(self.tokens) - 1] if ends and not self.seq.output else []

    @property
    def wants_logprobs(self) -> bool:
        """Its rows come back as log-probabilities: for the prompt's, or the first token's."""
        p = self.seq.params
        return p.prompt_logprobs is not None or (p.logprobs is not None and bool(self.logit_rows))


def feed_chunks(seqs: list[Sequence], chunk: int, budget: int) -> list[Feed]:
    """This step's prefill: first come first served, at most `chunk` tokens per request and
    `budget` in all (the first request always gets some, so prefill always moves)."""
    out = []
    for s in seqs:
        n = min(chunk, s.feed_len - s.fed, budget)
        if n <= 0:
            break
        out.append(Feed(s, s.fed, s.feed[s.fed:s.fed + n]))
        budget -= n
    return out


def empty_drafts(r: int, kinds: np.ndarray) -> Drafts:
    z = np.zeros(0)
    return Drafts(np.zeros(0, dtype=np.int64), np.zeros(r + 1, dtype=np.int64), z, z, kinds)


def merge_drafts(r: int, parts: list[tuple[list[int], DraftOutput]], kinds: np.ndarray, seconds: float) -> Drafts:
    """Scatter each part's ragged output (batch indices, drafts: a replica's, the look-ahead's)
    back into batch order; `kinds` the kinds asked, replaced by the one that really drafted (a
    fallback may have). One part for the whole batch (the n-gram kind alone drafting for every
    request) is the batch's drafts as they are."""
    if len(parts) == 1 and len(parts[0][0]) == r:  # batch indices are ascending: 0 .. r − 1
        d = parts[0][1]
        return Drafts(np.asarray(d.tokens, dtype=np.int64), np.asarray(d.cu, dtype=np.int64),
                      np.asarray(d.confidence, dtype=np.float64), np.asarray(d.margin, dtype=np.float64),
                      np.asarray(d.kinds, dtype=np.int64), seconds, d.compute_s)
    d = merge_outputs(r, parts)
    kinds = np.asarray(kinds, dtype=np.int64).copy()
    for idx, out in parts:
        kinds[idx] = out.kinds
    return Drafts(d.tokens, d.cu, d.confidence, d.margin, kinds, seconds, max(out.compute_s for _, out in parts))


def accept_tokens(batch: list[Sequence], drafts: Drafts, kept: np.ndarray, out: TargetOutput) -> Accepted:
    """Lossless acceptance, one vectorized call for the whole batch: each request's kept drafts
    pass while they equal the target's own token at their row — its argmax at temperature 0,
    else its draw (`rules.coupled_sampling`: the row's uniform from the request's seeded stream
    through the target's sampling distribution, made on the rank), so a seed fixes the output
    whatever the policy, the batch or the drafter did. The oracle's look-ahead may call it too:
    uniforms are per position, so it draws nothing extra."""
    if not batch:
        return Accepted([], [])
    k = np.asarray(kept, dtype=np.int64)
    r = len(batch)
    target = out.emitted[:int(out.rows_cu[r])]  # the decoding requests' rows come first, 1 + k[i] each
    if not k.any():  # no draft kept (a plain step): each request emits its one row, the same as below
        return Accepted([0] * r, [[t] for t in target.tolist()])
    if r <= IN_TURN_REQUESTS:  # a few requests: the rule on lists (the same outcome, `rules.greedy_in_turn`)
        counts, emitted = rules.greedy_in_turn(drafts.tokens.tolist(), drafts.cu[:-1].tolist(), k.tolist(),
                                               np.asarray(target, dtype=np.int64).tolist())
        return Accepted(counts, emitted)
    cu = np.zeros(r + 1, dtype=np.int64)
    k.cumsum(out=cu[1:])
    d = drafts.tokens[np.repeat(np.asarray(drafts.cu[:-1], dtype=np.int64) - cu[:-1], k) + np.arange(cu[-1])]
    res = rules.greedy(d.astype(np.int64), cu, target.astype(np.int64))
    toks, ends = res.tokens.tolist(), res.cu_tokens.tolist()
    return Accepted(res.accepted.tolist(), [toks[ends[i]:ends[i + 1]] for i in range(len(batch))])
