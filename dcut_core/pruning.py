"""Pruning policies: which draft tokens, across the whole batch, are sent to verification.

Vocabulary (DESIGN.md): a request drafts `drafted_i` tokens; a policy keeps the first `k_i` of
them (kept) and drops the rest (pruned). `survival[i, j]` is the estimated probability that the
first j + 1 drafts of request i are all accepted; it never grows along a request.

A plan `k` is worth, in expected committed tokens per second,

    (R + Σ_i Σ_{j<k_i} s[i, j]) / (C_fixed + C_verify(R + Σ_i k_i))

(R requests each commit one bonus or recovered token). For a fixed total budget m = Σ k_i the
numerator is largest when the kept set is the global top-m survivals; because survivals never
grow along a request that set is prefix-closed, i.e. a valid plan. So the exact optimum is a scan
over m = 0..M of one sorted array (docs/algorithm.md has the argument).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from dcut_core import ragged

# Total verify tokens [M] -> step seconds [M]; must accept an int64 array.
CostCurve = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class DraftBatch:
    """Survivals of one step's drafts, ragged: flat [N] + offsets [R + 1]."""

    survival: np.ndarray  # [N] float64, non-increasing inside each request
    cu_drafted: np.ndarray  # [R + 1] int64
    accepted_len: np.ndarray | None = None  # [R] true accepted drafts; the oracle's only input

    @classmethod
    def from_rows(
        cls, rows: Sequence[Sequence[float] | np.ndarray], accepted_len: Sequence[int] | None = None
    ) -> DraftBatch:
        flat, cu = ragged.flatten(rows)
        acc = None if accepted_len is None else np.asarray(accepted_len, dtype=np.int64)
        return cls(flat, cu, acc)

    @property
    def num_requests(self) -> int:
        return len(self.cu_drafted) - 1

    @property
    def drafted(self) -> np.ndarray:
        return ragged.lengths(self.cu_drafted)

    def validate(self) -> None:
        """Raise ValueError on malformed survivals (shape, range, growth along a request)."""
        s, cu = self.survival, self.cu_drafted
        ragged.check_offsets(cu, len(s))
        # Two reductions, no temporaries: a NaN fails `lo >= 0`, ±inf the bounds.
        if len(s) and not (float(s.min()) >= 0 and float(s.max()) <= 1 + 1e-9):
            raise ValueError("survival values must be finite and in [0, 1]")
        steps = s[1:] - s[:-1]  # [N - 1]; entry t is flat t + 1 less flat t (`np.diff`, at less cost)
        starts = cu[1:-1][(cu[1:-1] > 0) & (cu[1:-1] < len(s))]
        steps[starts - 1] = 0.0  # a step across a request boundary may rise
        if len(steps) and float(steps.max()) > 1e-12:
            raise ValueError("survival must be non-increasing along each request")
        if self.accepted_len is not None and (
            len(self.accepted_len) != self.num_requests
            or (self.accepted_len < 0).any()
            or (self.accepted_len > self.drafted).any()
        ):
            raise ValueError("accepted_len must hold 0 <= a_i <= drafted_i for every request")


@dataclass(frozen=True)
class StepCost:
    """Predicted verification step time as a function of total verify tokens."""

    verify_seconds: CostCurve
    fixed_seconds: float = 0.0
    # A lower bound on C(n + 1) − C(n) over all n (0 when unknown, e.g. padded step costs).
    # With it, drafts too unlikely to ever be kept are dropped before the sort (see `Dcut`).
    min_marginal: float = 0.0
    # The curve's values are known finite and positive (a table checked when it was sampled):
    # `seconds` skips its check, which costs more than the lookup on the gate's small calls.
    checked: bool = False
    # `tabulated`'s values at lo .. hi tokens, read-only, and lo: a caller that wants the curve at
    # those counts (`GateInput.capture`) takes them as they are.
    table: np.ndarray | None = field(default=None, compare=False)
    table_lo: int = field(default=0, compare=False)

    def seconds(self, tokens: np.ndarray) -> np.ndarray:
        out = np.asarray(self.verify_seconds(tokens), dtype=np.float64)
        if self.fixed_seconds:  # else the curve's own answer (no caller writes to it)
            out = self.fixed_seconds + out
        if self.checked:
            return out
        if out.shape != tokens.shape:
            raise ValueError(f"cost curve returned shape {out.shape} for {tokens.shape} inputs")
        # Two reductions, no temporaries: a NaN fails `> 0`, ±inf one of the bounds.
        if out.size and not (float(out.min()) > 0 and np.isfinite(float(out.max()))):
            raise ValueError("step cost must be finite and positive for every budget")
        return out

    def beside(self, fed: int) -> StepCost:
        """The curve of a forward that also carries `fed` tokens the counts leave out (a step's
        prefill chunks): its time at n counted tokens is this curve's at n + fed."""
        if not fed:
            return self
        return StepCost(lambda tokens: self.verify_seconds(np.asarray(tokens, dtype=np.int64) + fed),
                        self.fixed_seconds, self.min_marginal)

    def tabulated(self, lo: int, hi: int) -> StepCost:
        """The same curve with its values at lo..hi tokens computed (and checked) once: a step's
        gate and pruning ask it at every budget they scan, a lookup each; a count outside the
        table asks this curve."""
        table = np.array(self.seconds(np.arange(lo, hi + 1, dtype=np.int64)))  # its own: read-only below
        table.flags.writeable = False

        def curve(tokens: np.ndarray) -> np.ndarray:
            i = np.asarray(tokens, dtype=np.int64) - lo
            if i.size and (i.min() < 0 or i.max() > hi - lo):
                return self.seconds(i + lo)
            return table[i]

        return StepCost(curve, 0.0, self.min_marginal, checked=True, table=table, table_lo=lo)


@dataclass(frozen=True)
class PruneDecision:
    """A policy's plan for one step and what it expects of it."""

    kept: np.ndarray  # [R] int64, 0 <= kept_i <= drafted_i
    expected_tokens: float  # R + Σ survivals of kept drafts
    predicted_seconds: float  # C_fixed + C_verify(R + Σ kept)
    guard: bool = False  # the low-load guard overrode pruning and kept everything

    @property
    def expected_rate(self) -> float:
        return self.expected_tokens / self.predicted_seconds


class Policy(Protocol):
    """Every pruning policy: same drafts in, a kept count per request out. What a policy needs of
    the engine it says itself (the engine never compares policy names):

    drafts: the drafters run at all (`ar`: no drafts, no drafter state);
    needs_cost_model: it reads the step's cost curve (the engine profiles one at start-up);
    gated: the engine's drafting gate decides, before drafting, whether and how far to draft;
    needs_truth: it must know the true acceptance lengths (`oracle`; benchmarks only).
    """

    name: str
    drafts: ClassVar[bool]
    needs_cost_model: ClassVar[bool]
    gated: ClassVar[bool]
    needs_truth: ClassVar[bool]

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision: ...


# ---------------------------------------------------------------------------------------------
# The global-sort machinery shared by the budgeted policies.

# Up to this many drafts in a step D-Cut decides in plain Python (`Dcut._choose_in_turn`: the
# same decision). numpy's calls cost more than the loops there: 1 × 7 drafts 55 → 23 µs, 8 × 7
# 44 → 34, level near 6 × 15, the arrays ahead from 16 × 7 (session 49).
IN_TURN_DRAFTS = 64


@dataclass(frozen=True)
class _Scan:
    """Objective of every budget m = 0..M over one batch."""

    order_desc: np.ndarray  # [N] survivals sorted high to low
    tokens: np.ndarray  # [M + 1] expected committed tokens with budget m
    seconds: np.ndarray  # [M + 1] predicted step time with budget m
    within: np.ndarray | None = None  # flat indices (ascending) of the drafts scanned; None: all

    @property
    def rate(self) -> np.ndarray:
        return self.tokens / self.seconds


def _scan(batch: DraftBatch, cost: StepCost, max_budget: int | None = None,
          floor: float | None = None) -> _Scan:
    """Objective at every budget; with `floor`, only over the drafts with survival >= floor (a
    prefix of the sorted order — the caller guarantees the optimum lies inside it)."""
    r = batch.num_requests
    within = None if floor is None else (batch.survival >= floor).nonzero()[0]
    s = batch.survival if within is None else batch.survival[within]
    order_desc = np.sort(s)[::-1]
    m_max = len(order_desc) if max_budget is None else min(len(order_desc), max(0, max_budget))
    tokens = np.empty(m_max + 1, dtype=np.float64)
    tokens[0] = r
    order_desc[:m_max].cumsum(out=tokens[1:])
    tokens[1:] += r
    seconds = cost.seconds(r + np.arange(m_max + 1, dtype=np.int64))
    return _Scan(order_desc, tokens, seconds, within)


def kept_top_m(batch: DraftBatch, order_desc: np.ndarray, m: int, within: np.ndarray | None = None) -> np.ndarray:
    """Kept counts [R] of the global top-m survivals; ties broken by (request, position).

    Entries above the m-th value are all kept; of those equal to it, the first ones in flat
    (request-major) order fill the rest. Equal values inside a request are contiguous, so the
    result stays prefix-closed. Two passes over the N drafts when no tie straddles the m-th
    value (the common case), three when one does; the rest is over the m kept. `within`: the
    flat indices (ascending) that hold every draft of the top m, when the caller knows them
    (`_scan` with a floor): then no pass over all N.
    """
    s, cu = batch.survival, batch.cu_drafted
    if m <= 0:
        return np.zeros(batch.num_requests, dtype=np.int64)
    v = order_desc[m - 1]
    take = (s >= v).nonzero()[0] if within is None else within[s[within] >= v]  # ascending flat order
    if len(take) > m:  # a tie at the m-th value: keep the first of the equal ones in flat order
        equal = s[take] == v
        extra = np.flatnonzero(equal)[m - int((~equal).sum()):]
        take = np.delete(take, extra)
    return ragged.prefix_counts(take, cu)  # kept drafts inside each request's range


def _decision(batch: DraftBatch, cost: StepCost, kept: np.ndarray, guard: bool = False,
              seconds: float | None = None, tokens: float | None = None) -> PruneDecision:
    """The decision for `kept` [R]: its expected tokens (R + the kept drafts' survivals; each
    request's kept drafts are its first ones) and predicted time. `seconds`, `tokens`: what the
    caller's scan already knows of this plan (R + Σ kept priced with `cost`; R + the sum of the
    same survivals, summed in its order)."""
    kept = np.asarray(kept, dtype=np.int64)
    if tokens is None or seconds is None:
        cu_kept = np.zeros(len(kept) + 1, dtype=np.int64)
        kept.cumsum(out=cu_kept[1:])
        if tokens is None:  # the kept drafts' flat indices, gathered in one go (O(kept), not O(drafted))
            idx = np.repeat(batch.cu_drafted[:-1] - cu_kept[:-1], kept) + np.arange(cu_kept[-1])
            tokens = batch.num_requests + float(batch.survival[idx].sum())
        if seconds is None:
            seconds = float(cost.seconds(np.array([batch.num_requests + int(cu_kept[-1])], dtype=np.int64))[0])
    return PruneDecision(kept, tokens, seconds, guard)


def best_budget(rate: np.ndarray, candidates: np.ndarray | None = None) -> int:
    """Index of the highest rate; the first (smallest budget) on ties."""
    if candidates is None:
        return int(np.argmax(rate))
    return int(candidates[int(np.argmax(rate[candidates]))])


# ---------------------------------------------------------------------------------------------
# Policies


class Capabilities:
    """What a policy needs of the engine (see `Policy`); most verify drafts and need nothing else."""

    drafts: ClassVar[bool] = True
    needs_cost_model: ClassVar[bool] = False
    gated: ClassVar[bool] = False
    needs_truth: ClassVar[bool] = False


@dataclass(frozen=True)
class Ar(Capabilities):
    """Plain autoregressive decoding: no draft is ever kept."""

    drafts: ClassVar[bool] = False

    name: str = "ar"

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        return _decision(batch, cost, np.zeros(batch.num_requests, dtype=np.int64))


@dataclass(frozen=True)
class Full(Capabilities):
    """Verify every draft."""


    name: str = "full"

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        return _decision(batch, cost, batch.drafted.astype(np.int64))


@dataclass(frozen=True)
class FixedK(Capabilities):
    """Truncate every request to its first k drafts."""


    k: int
    name: str = "fixed-K"

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError("fixed-K needs k >= 0")
        object.__setattr__(self, "name", f"fixed-{self.k}")

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        return _decision(batch, cost, np.minimum(batch.drafted, self.k).astype(np.int64))


@dataclass(frozen=True)
class Tetris(Capabilities):
    """Global top-C survivals with a fixed C = per_request · R (no cost model)."""


    per_request: int
    name: str = "tetris"

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        order_desc = np.sort(batch.survival)[::-1]
        m = min(len(order_desc), self.per_request * batch.num_requests)
        return _decision(batch, cost, kept_top_m(batch, order_desc, m))


@dataclass(frozen=True)
class DcutBuckets(Capabilities):
    """The paper's coarse D-Cut: global top-m with m restricted to a few keep ratios."""

    needs_cost_model: ClassVar[bool] = True


    ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    name: str = "dcut-buckets"

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        scan = _scan(batch, cost)
        total = len(scan.order_desc)
        candidates = np.array(sorted({round(r * total) for r in self.ratios}), dtype=np.int64)
        m = best_budget(scan.rate, candidates)
        return _decision(batch, cost, kept_top_m(batch, scan.order_desc, m))


@dataclass(frozen=True)
class Dcut(Capabilities):
    """Exact budget scan (the default policy).

    max_budget: never keep more than this many drafts in one step (memory / latency cap).
    fill_step: when the cost is a step function (padded shapes), keep the next-best drafts that
        fit in the step already paid for.
    guard_threshold: low-load guard; if the best plan's predicted rate beats keeping everything
        (up to max_budget) by less than this fraction, keep everything. Estimates are noisy, and
        when verification is nearly free a wrongly pruned draft costs more than it saves.
    """

    needs_cost_model: ClassVar[bool] = True
    gated: ClassVar[bool] = True


    max_budget: int | None = None
    fill_step: bool = True
    guard_threshold: float = 0.02
    name: str = "dcut"

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        if len(batch.survival) <= IN_TURN_DRAFTS:
            return self._choose_in_turn(batch, cost)
        return self._choose_whole(batch, cost)

    def _choose_whole(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        """`choose` as array code."""
        floor, rate_all = self._floor(batch, cost)
        scan = _scan(batch, cost, self.max_budget, floor)
        rate = scan.rate
        m = best_budget(rate)
        if floor is None:
            rate_all = rate[-1]
        if rate[m] < rate_all * (1.0 + self.guard_threshold):
            if floor is not None:  # no max budget on this path: keep everything
                return _decision(batch, cost, batch.drafted.astype(np.int64), guard=m != len(batch.survival))
            m_all = len(scan.tokens) - 1
            return _decision(batch, cost, kept_top_m(batch, scan.order_desc, m_all, scan.within), guard=m != m_all)
        if self.fill_step and floor is None:  # a floor needs a strictly rising cost: nothing to fill
            paid = scan.seconds[m] * (1.0 + 1e-12)
            over = np.nonzero(scan.seconds[m:] > paid)[0]
            m = len(scan.tokens) - 1 if len(over) == 0 else m + int(over[0]) - 1
        return _decision(batch, cost, kept_top_m(batch, scan.order_desc, m, scan.within),
                         seconds=float(scan.seconds[m]), tokens=float(scan.tokens[m]))

    def _choose_in_turn(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        """`_choose_whole` in plain Python, for a few drafts: the same floor, the same sorted
        survivals summed in the same order (a running sum, as numpy's cumsum), the cost at the
        same counts (asked once, at every count the floor and the scan read), the first best
        budget, the same ties — the same decision to the last bit."""
        s, r, n = batch.survival, batch.num_requests, len(batch.survival)
        at = cost.seconds(r + np.arange(n + 1, dtype=np.int64)).tolist()  # R + 0 .. R + N verified tokens
        floor, rate_all, total = None, 0.0, 0.0
        if cost.min_marginal > 0 and self.max_budget is None:  # `_floor`
            total = float(s.sum())
            rate_all = (r + total) / at[n]
            floor = max(r / at[0], rate_all) * cost.min_marginal
        values = s.tolist()
        within = range(n) if floor is None else [i for i, v in enumerate(values) if v >= floor]
        order = sorted((values[i] for i in within), reverse=True)
        m_max = len(order) if self.max_budget is None else min(len(order), max(0, self.max_budget))
        tokens, got = [float(r)], 0.0
        for v in order[:m_max]:
            got += v
            tokens.append(got + r)
        rate = [t / sec for t, sec in zip(tokens, at, strict=False)]
        m = max(range(len(rate)), key=rate.__getitem__)  # the first of the best
        if floor is None:
            rate_all = rate[-1]
        if rate[m] < rate_all * (1.0 + self.guard_threshold):
            if floor is not None:  # every draft kept: R + Σ survival, as `_decision` sums them
                return PruneDecision(batch.drafted.astype(np.int64), r + total, at[n], m != n)
            return _decision(batch, cost, kept_top_m(batch, np.array(order), m_max), guard=m != m_max)
        if self.fill_step and floor is None:
            paid = at[m] * (1.0 + 1e-12)
            m = next((j - 1 for j in range(m, m_max + 1) if at[j] > paid), m_max)
        kept = [0] * r
        if m > 0:  # the top m in flat order, ties at the m-th value to the first of them
            v, cu = order[m - 1], batch.cu_drafted.tolist()
            equal = m - sum(1 for i in within if values[i] > v)
            req = 0
            for i in within:
                x = values[i]
                if x > v or (x == v and equal > 0):
                    equal -= x == v
                    while i >= cu[req + 1]:
                        req += 1
                    kept[req] += 1
        return PruneDecision(np.array(kept, dtype=np.int64), tokens[m], at[m])

    def _floor(self, batch: DraftBatch, cost: StepCost) -> tuple[float | None, float]:
        """(survival floor, rate of keeping everything), or (None, nan) when no floor applies.

        The best budget m* is the smallest argmax, so rate(m*) > rate(m* − 1), which rearranges
        to s_(m*) > rate(m*) · (C(m*) − C(m* − 1)) ≥ rate_lb · min_marginal, where rate_lb is the
        rate of any plan (none kept, all kept). Every kept draft has survival ≥ s_(m*): drafts
        below the floor are never kept, and the scan can skip them (4096 × 16 drafts: the sort
        shrinks to the few that matter).
        """
        if cost.min_marginal <= 0 or self.max_budget is not None:
            return None, float("nan")
        r, n = batch.num_requests, len(batch.survival)
        secs = cost.seconds(np.array([r, r + n], dtype=np.int64))
        rate_none, rate_all = r / secs[0], (r + float(batch.survival.sum())) / secs[1]
        return max(rate_none, rate_all) * cost.min_marginal, rate_all


@dataclass(frozen=True)
class Oracle(Capabilities):
    """Knows each request's true accepted length; an upper bound for benchmarks only."""

    needs_cost_model: ClassVar[bool] = True
    needs_truth: ClassVar[bool] = True


    name: str = "oracle"

    def choose(self, batch: DraftBatch, cost: StepCost) -> PruneDecision:
        if batch.accepted_len is None:
            raise ValueError("the oracle policy needs the true accepted lengths")
        truth = (ragged.positions(batch.cu_drafted) < np.repeat(batch.accepted_len, batch.drafted))
        known = DraftBatch(truth.astype(np.float64), batch.cu_drafted)
        scan = _scan(known, cost)
        kept = kept_top_m(known, scan.order_desc, best_budget(scan.rate))
        return _decision(known, cost, kept)


POLICY_NAMES = ("ar", "full", "fixed-K", "tetris", "dcut-buckets", "dcut", "oracle")


def policy_from_name(name: str, block: int, **dcut_options) -> Policy:
    """Parse a command-line policy name ("fixed-4" for fixed-K) into a policy object.

    `block` is the drafter's block size, which sets tetris's per-request budget (half a block,
    the setting TETRIS is usually compared at) and bounds fixed-K.
    """
    if name.startswith("fixed-"):
        k = int(name.removeprefix("fixed-"))
        if not 0 <= k <= block:
            raise ValueError(f"fixed-K needs 0 <= K <= block ({block}), got {k}")
        return FixedK(k)
    simple: dict[str, Callable[[], Policy]] = {
        "ar": Ar,
        "full": Full,
        "tetris": lambda: Tetris(max(1, block // 2)),
        "dcut-buckets": DcutBuckets,
        "dcut": lambda: Dcut(**dcut_options),
        "oracle": Oracle,
    }
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return simple[name]()
