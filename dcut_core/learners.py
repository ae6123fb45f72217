"""What the engine learns online about costs, pure (numpy): each drafter kind's drafting cost
(`DraftCostLearner`) and what a step spends outside the passes (`StepOverhead`)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from dcut_core.drafting import DraftCost
from dcut_core.nnls import nnls

PRIOR_DRAFT_COST = DraftCost(1e-3, 2e-4, 5e-5, 1e-5)
FREE = DraftCost(0.0, 0.0, 0.0, 0.0)
PRIOR_WEIGHT = 1e-6  # a rate's pull toward its current value in a refit, in passes (`RateFit.refit`)


class RateFit:
    """One drafter kind's cost fitted to its measured drafting time: per call, per request, per
    position, per context token caught up, per chained pass — the rates refitted every
    `refit_every` passes (`observe` marks it due, `settle` makes it), and between refits a level
    correction (a running mean of log(measured / fitted) since the last one), as the target's
    verify cost has (`cost_model.OnlineCorrection`). A start-up profile taken on a quiet machine
    prices the passes of a busy one too low (0.6 × at 16 requests here, docs/benchmarks.md); with
    the verify cost corrected and the drafting cost not, the gate would draft too much."""

    def __init__(self, initial: DraftCost, refit_every: int = 16, keep: int = 512) -> None:
        self.fitted = initial
        self.refit_every, self.keep = refit_every, keep
        self.log_ratio = 0.0  # the level correction: cost = fitted × exp(log_ratio)
        self._since = 0  # passes observed since the last refit (the correction's running mean)
        self._passes = 0  # passes observed in all: a refit every `refit_every` of them
        # The last `keep` passes, a ring (row `_passes % keep` is the next written): a refit reads
        # them as they are, where lists of tuples cost it more than its solve
        self._x = np.empty((keep, 5))
        self._y = np.empty(keep)
        self._shapes: Counter[tuple[float, ...]] = Counter()  # the kept passes' distinct shapes
        self.due = False  # a refit `observe` found due, made by `settle`

    @property
    def cost(self) -> DraftCost:
        s = math.exp(self.log_ratio)
        f = self.fitted
        return DraftCost(f.fixed * s, f.per_request * s, f.per_position * s, f.per_context * s, f.per_pass * s)

    def restore(self, cost: DraftCost) -> None:
        """Start from a learnt cost (its level included)."""
        self.fitted, self.log_ratio, self._since = cost, 0.0, 0

    def observe(self, requests: int, positions: int, seconds: float, catchup: int = 0, passes: int = 0) -> None:
        """One pass: `requests` drafted `positions` in all, the longest `passes` drafts (a chained
        drafter's sequential passes), after catching up on `catchup` context tokens."""
        if positions <= 0:
            return
        x = (1.0, float(requests), float(positions), float(catchup), float(passes))
        fitted = float(self.fitted.seconds(requests, positions, catchup, passes))
        ratio = seconds / fitted if fitted > 0 else 0.0
        if 0 < ratio < math.inf:  # (a rate of 1e-320 s would make it infinite)
            self._since += 1
            self.log_ratio += (math.log(ratio) - self.log_ratio) / self._since
        row = self._passes % self.keep
        if self._passes >= self.keep:  # the oldest kept pass leaves
            old = tuple(self._x[row].tolist())
            self._shapes[old] -= 1
            if not self._shapes[old]:
                del self._shapes[old]
        self._x[row], self._y[row] = x, seconds
        self._shapes[x] += 1
        self._passes += 1
        if self._passes % self.refit_every == 0:  # not the kept count: once full it stays `keep`
            self.due = True

    def settle(self) -> None:
        """The refit `observe` found due, if one is: the engine makes it where it learns from a
        step (`Engine.settle`: behind the next forward on GPU ranks), not in the drafting stage
        that observed the pass (an NNLS solve, ~0.5 ms, once in 16 drafting steps at one request)."""
        if self.due:
            self.refit()

    def refit(self) -> None:
        """The rates refitted to the kept passes; the level correction starts again from them.

        Relative errors (rows scaled by 1 / measured): small calls count as much as large ones.
        What the passes cannot tell apart stays where the current cost put it: every rate is also
        held to its current value by a row of weight `PRIOR_WEIGHT` (in units of the relative time
        a typical pass spends on it). At one request every pass has requests = 1 and a chain's
        positions = passes, so the fit alone cannot split a call's time from a request's, nor a
        position's from a chained pass's; unpinned, NNLS put the split anywhere (MTP's call cost
        0 in one engine and 1.2 ms in another after like runs, session 23), and a rate no kept
        pass measured (no catch-up) fell to 0. The weight is far too small to bias a rate the
        passes do measure (tests/core/test_learners.py)."""
        self.due = False
        if len(self._shapes) < 4:  # too few distinct shapes to tell the rates apart
            return
        n = min(self._passes, self.keep)
        y = self._y[:n]
        a = self._x[:n] / y[:, None]
        now = np.array(dataclasses.astuple(self.cost))
        now = np.where(np.isfinite(now), now, 0.0)  # an overflowed level pulls nowhere
        scale = a.mean(axis=0)  # a rate's share of a pass's time, per second of it
        scale = np.where(scale > 0, scale, 1.0 / float(np.median(y)))  # a feature no pass had: a unit of it
        pin = math.sqrt(PRIOR_WEIGHT) * scale
        design = np.vstack([a, np.diag(pin)])
        unit = np.abs(design).max(axis=0)  # columns brought to one scale: a call's 1 / seconds beside 50
        # context tokens / seconds (columns ~100 × apart) left the active-set solver at zeros (test_learners.py)
        c = (nnls(design / unit, np.concatenate([np.ones(len(y)), pin * now])) / unit).astype(float)
        self.fitted, self.log_ratio, self._since = DraftCost(*c), 0.0, 0


class DraftCostLearner:
    """The drafting cost of the kinds a replica hosts (one kind is K = 1): each kind's rates
    fitted to its own time inside the replica (`DraftOutput.kind_s`: its catch-up on context and
    its pass), and what a call costs beyond them a `shared` running mean. One joint fit of every
    kind's rates to whole calls was tried first: online, calls mixing kinds left the split
    ambiguous, and the choices it drove got steadily worse (docs/benchmarks.md)."""

    def __init__(self, kinds: int, initial: DraftCost = PRIOR_DRAFT_COST, free: tuple[int, ...] = ()) -> None:
        # `free`: kinds that start from no cost instead of `initial` (the coordinator's n-gram
        # kind: no call, no model; its look-ahead is made for every request anyway)
        self.fits = [RateFit(FREE if k in free else initial) for k in range(kinds)]
        self.shared = 0.0
        self._calls = 0

    @property
    def costs(self) -> list[DraftCost]:
        return [fit.cost for fit in self.fits]

    def observe_kind(self, kind: int, requests: int, positions: int, seconds: float, context: int = 0,
                     passes: int = 0) -> None:
        self.fits[kind].observe(requests, positions, seconds, context, passes)

    def observe_call(self, seconds: float) -> None:
        """A call's time beyond its kinds' own (messages, catch-up bookkeeping)."""
        self._calls += 1
        self.shared += max(1.0 / self._calls, 0.02) * (max(0.0, seconds) - self.shared)

    def restore(self, costs: list[DraftCost | None], shared: float) -> None:
        """Start from learnt costs (a kind's None: keep its own); `shared` counts as a mean of
        many calls."""
        for fit, cost in zip(self.fits, costs, strict=True):
            if cost is not None:
                fit.restore(cost)
        self.shared, self._calls = shared, max(self._calls, 50)

    def refit(self) -> None:
        for fit in self.fits:
            fit.refit()

    def settle(self) -> None:
        """Each kind's refit its passes made due (`RateFit.settle`)."""
        for fit in self.fits:
            fit.settle()


class StepOverhead:
    """Time a step spends outside the target's forward and the drafting stage, for drafting steps
    and plain ones apart (running means, then a half-life). What drafting adds to it — pruning,
    calibration, the tracker, the drafters' context bookkeeping — is a cost of drafting as real as
    the drafter's pass, and the gate charges it (`extra`) per drafting step."""

    def __init__(self, halflife_steps: float = 50.0) -> None:
        self.decay = 0.5 ** (1.0 / halflife_steps)
        self.mean: dict[bool, float] = {}
        self.count: dict[bool, int] = {True: 0, False: 0}

    def observe(self, drafting: bool, seconds: float) -> None:
        self.count[drafting] += 1
        alpha = max(1.0 - self.decay, 1.0 / self.count[drafting])
        self.mean[drafting] = self.mean.get(drafting, seconds) + alpha * (seconds - self.mean.get(drafting, seconds))

    @property
    def extra(self) -> float:
        """Seconds a drafting step spends outside the passes beyond a plain one (0 until both seen)."""
        if True not in self.mean or False not in self.mean:
            return 0.0
        return max(0.0, self.mean[True] - self.mean[False])
