"""The drafting gate's plan: before the drafters run, how many drafts each request gets (`DraftPlanner`).

Drafting costs time too; on CPU with a small target a drafter pass can cost as much as the
target's step. So the plan is made before drafting, from what the previous steps taught:
`AcceptanceTracker` predicts each request's conditional acceptance by draft position, their
running products are predicted survivals, and the same global-sort scan as pruning picks a
budget m — now with the drafting cost in the denominator:

    (R + S_m) / (C_verify(R + m) + [m > 0] · (d_fixed + Σ_{i drafts} (d_request + d_context · b_i) + d_position · m))

where the sum runs over the requests that get at least one draft, and b_i is request i's
context its drafter has not seen yet (the engine sends it lazily, with the first draft call
that needs it; catching up costs d_context per token). m = 0 means no drafter call at all:
a plain decoding step. Unlike the pruning scan this is a heuristic (the per-request term makes
the best plan of budget m not always the global top-m), which is fine: its inputs are
predictions, and pruning makes the exact decision once real confidences exist.

The plan runs every step, before drafting. For a batch it is array code on the [R, w] survival
matrix; for a few requests' positions (`IN_TURN_CELLS`) it is the same scan in plain Python
(`DraftPlanner._plan_in_turn`), where numpy's cost per call had been the plan's whole cost: 70–120
µs for one request's seven positions, of a 5–6 ms step (docs/benchmarks.md, session 45). The two
make the same plan to the last bit (tests/core/test_planning.py): the same additions in the same
order, the same stable order of positions, the first best budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcut_core.drafting import DraftingCosts, Survival
from dcut_core.pruning import StepCost

# At most this many positions in all (Σ lengths) are planned in plain Python (`DraftPlanner._plan_in_turn`).
IN_TURN_CELLS = 48


# numpy adds a row of up to this many float64 values in one block (`numpy_sum`); a longer one it
# splits in halves first.
SUMMED_IN_TURN = 128


def numpy_sum(values: list[float]) -> float:
    """Σ values as numpy sums a float64 row of up to `SUMMED_IN_TURN` (`np.sum`, or one row of
    `sum(axis=1)`): one at a time below eight; from eight, eight running sums added pairwise, then
    the rest one at a time. Plain Python that decides as the array code does needs its sums to the
    last bit."""
    n = len(values)
    if n > SUMMED_IN_TURN:
        raise ValueError(f"numpy splits a row past {SUMMED_IN_TURN} values in halves: sum it with numpy")
    if n < 8:
        total = 0.0
        for v in values:
            total += v
        return total
    r = values[:8]
    i, whole = 8, n - n % 8
    while i < whole:
        for j in range(8):
            r[j] += values[i + j]
        i += 8
    total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for v in values[whole:]:
        total += v
    return total


@dataclass(frozen=True)
class DraftPlan:
    lengths: np.ndarray  # [R] drafts to ask of each request's drafter (0: none)
    expected_tokens: float
    predicted_seconds: float
    ar_seconds: float  # predicted time of a plain decoding step instead

    @property
    def drafting(self) -> bool:
        return bool(self.lengths.sum())


@dataclass(frozen=True)
class DraftPlanner:
    """How far each request drafts this step (`plan`), and how the plan is widened past what
    the predictions alone pay for.

    slack: extra positions drafted past the plan for each request that drafts at all (at most
    its row). The plan is made from predictions; pruning decides again from the drafts' own
    confidences, and can only keep what was drafted — without slack the two cuts compound.
    extend: also draft, for each request that drafts at all, every further position whose
    predicted survival pays for drafting it alone (survival ≥ plan rate × per-position cost).
    The plan's verify budget is a guess from predictions; what is verified is pruning's call,
    and drafting a position costs far less than verifying it (one more row of the same pass).
    Neither widens a chained kind (`per_pass` > 0: MTP, one sequential pass per position) past
    the deepest position the plan drafts with it: there a position deeper than the chain is one
    more pass for every request on it, which the plan did not price. Before this cap, MTP steps
    at 16 requests on a training trace were planned at 59 ms and paid 86 (docs/benchmarks.md,
    session 19).
    max_budget: the most drafts the scan considers in all (None: every row in full)."""

    max_budget: int | None = None
    slack: int = 0
    extend: bool = False

    def plan(self, survival: Survival, verify: StepCost, costs: DraftingCosts, kinds: np.ndarray | None = None,
             catchup: np.ndarray | None = None) -> DraftPlan:
        """Drafts per request from its predicted `survival`, kinds[i] the kind drafting request i
        (None: every request kind 0): each kind's pass is charged once if any request drafts with
        it (its `fixed`, and `per_pass` for each position of its chain's longest request), each
        request and position at its own kind's rates, `shared_fixed` once for any drafting at
        all, and the replicas' `call` once if any kind that drafts there drafts.

        catchup[i]: context tokens request i's drafter must catch up on if it drafts this step.
        A request whose whole expected gain cannot pay for its own catch-up and drafting at the
        plain-decoding rate is left out before the scan (the scan orders by survival alone).

        Runs every step before drafting: array code on the [R, w] survival matrix with one call
        of the verify curve, or for a few positions in all the same scan in plain Python
        (`_plan_in_turn`: the same plan to the last bit)."""
        lens = survival.lengths
        n_flat = int(lens.sum())
        r = len(lens)
        seconds_at = verify.seconds(r + np.arange(n_flat + 1))  # the verify curve at every budget the scan can reach
        if n_flat <= IN_TURN_CELLS:
            return self._plan_in_turn(survival, seconds_at, costs, kinds, catchup)
        return self._plan_whole(survival, seconds_at, costs, kinds, catchup)

    def _plan_whole(self, survival: Survival, seconds_at: np.ndarray, costs: DraftingCosts,
                    kinds: np.ndarray | None, catchup: np.ndarray | None) -> DraftPlan:
        """`plan` as array code (seconds_at: the verify curve at R + 0 .. R + Σ lengths tokens)."""
        surv, lens = survival.matrix.copy(), survival.lengths
        r, width = surv.shape
        valid = np.arange(width) < lens[:, None]
        n_flat = len(seconds_at) - 1
        rates = _RequestRates.of(costs, r, kinds, catchup)
        if catchup is not None and r:
            _leave_out_hopeless(surv, lens, rates, seconds_at)
        flat = surv[valid]  # [N] request by request, position order within each
        row_of, pos_of = np.nonzero(valid)
        # Positions by survival per second of their own cost, high to low (by survival where every
        # kind's position costs the same), position order on ties: prefix-closed within a request.
        tau = float(seconds_at[1] - seconds_at[0]) if n_flat else 0.0
        pp = rates.per_position[row_of]
        density = flat / np.maximum(tau + pp, 1e-12)
        m_max = n_flat if self.max_budget is None else min(n_flat, self.max_budget)
        order = np.argsort(-density, kind="stable")[:m_max]  # [m_max]
        tokens = np.empty(m_max + 1)
        tokens[0] = r
        flat[order].cumsum(out=tokens[1:])
        tokens[1:] += r
        row = row_of[order]  # the request of each position in order
        seconds = seconds_at[:m_max + 1].copy()
        seconds[1:] += costs.shared_fixed + _added_seconds(row, pos_of[order], rates, costs).cumsum()
        best = int(np.argmax(tokens / seconds))
        planned = np.bincount(row[:best], minlength=r).astype(np.int64)
        lengths = planned
        if self.slack:
            lengths = np.where(lengths > 0, np.minimum(lengths + self.slack, lens), 0)
        if self.extend and best > 0:
            worth = np.zeros_like(valid)
            worth[valid] = flat >= tokens[best] / seconds[best] * pp
            pays = np.cumprod(worth, axis=1).sum(axis=1)
            lengths = np.where(lengths > 0, np.maximum(lengths, pays), 0)
        if best > 0:
            lengths = _chains_capped(lengths, planned, rates.kind, costs.table[:, 4])
        return DraftPlan(lengths, float(tokens[best]), float(seconds[best]), float(seconds[0]))

    def _plan_in_turn(self, survival: Survival, seconds_at: np.ndarray, costs: DraftingCosts,
                      kinds: np.ndarray | None, catchup: np.ndarray | None) -> DraftPlan:
        """`_plan_whole` in plain Python, for a few positions (`plan_rows` on the arrays as lists;
        each request's row sum, pairwise in numpy, taken from numpy)."""
        r = len(survival.lengths)
        kind = [0] * r if kinds is None else np.asarray(kinds, dtype=np.int64).tolist()
        backlog = None if catchup is None else np.asarray(catchup, dtype=np.float64).tolist()
        whole = survival.matrix.sum(axis=1).tolist() if catchup is not None and r else None
        return self.plan_rows(survival.matrix.tolist(), survival.lengths.tolist(), seconds_at.tolist(), costs, kind,
                              backlog, whole)

    def plan_rows(self, rows: list[list[float]], lens: list[int], at: list[float], costs: DraftingCosts,
                  kind: list[int], backlog: list[float] | None = None, whole: list[float] | None = None) -> DraftPlan:
        """The plan on plain lists (`_plan_whole`'s to the last bit): each request's survival row
        (`rows`, zeros past `lens`), the verify curve at R + 0 .. R + Σ lens tokens (`at`), each
        request's kind, and with a catch-up (`backlog`) each row's sum as numpy sums it
        (`whole`). Every sum made in the order the array code makes it, the positions in the same
        stable order, the first best budget. The gate calls it for a few requests of one kind
        (`DraftingGate._decide_in_turn`), with no array built."""
        r, n_flat = len(lens), len(at) - 1
        table = costs.table.tolist()
        pr, pp, pc = ([table[k][c] for k in kind] for c in (1, 2, 3))
        catchup = backlog is not None
        backlog = [0.0] * r if backlog is None else backlog
        rows = list(rows)  # a hopeless request's row is replaced, not changed in place
        if catchup and r:  # `_leave_out_hopeless`
            ar_rate = r / at[0]
            spread = at[n_flat] - at[0]
            for i in range(r):
                cost = pr[i] + pc[i] * backlog[i] + pp[i] * lens[i] + spread * lens[i] / max(1, n_flat)
                if whole[i] < ar_rate * cost:
                    rows[i] = [0.0] * len(rows[i])
        # [N] (request, position, survival), request by request, in position order within each
        cells = [(i, j, rows[i][j]) for i in range(r) for j in range(lens[i])]
        tau = at[1] - at[0] if n_flat else 0.0
        density = [s / max(tau + pp[i], 1e-12) for i, _, s in cells]
        order = sorted(range(n_flat), key=lambda q: -density[q])
        if self.max_budget is not None:
            order = order[:self.max_budget]
        fixed, per_pass = [row[0] for row in table], [row[4] for row in table]
        calling = costs.calling.tolist() if costs.call else None
        started, deepest, called = set(), [0] * len(table), calling is None
        tokens, seconds, got, spent = [float(r)], [at[0]], 0.0, 0.0
        for m, q in enumerate(order, 1):  # `_added_seconds`, position by position
            i, j, s = cells[q]
            k = kind[i]
            added = pp[i]
            if j == 0:
                added += pr[i] + pc[i] * backlog[i]
            if fixed[k] and k not in started:
                added += fixed[k]
            started.add(k)
            if per_pass[k] and j + 1 > deepest[k]:  # deeper than its chain so far: one more pass a position
                added += per_pass[k] * (j + 1 - deepest[k])
                deepest[k] = j + 1
            if not called and calling[k]:
                added += costs.call
                called = True
            got += s
            spent += added
            tokens.append(got + r)
            seconds.append(at[m] + (costs.shared_fixed + spent))
        ratio = [t / sec for t, sec in zip(tokens, seconds, strict=True)]
        best = max(range(len(ratio)), key=ratio.__getitem__)
        planned = [0] * r
        for q in order[:best]:
            planned[cells[q][0]] += 1
        lengths = planned
        if self.slack:
            lengths = [min(n + self.slack, cap) if n > 0 else 0 for n, cap in zip(lengths, lens, strict=True)]
        if self.extend and best > 0:
            bar = tokens[best] / seconds[best]
            pays = [0] * r
            for i in range(r):
                while pays[i] < lens[i] and rows[i][pays[i]] >= bar * pp[i]:
                    pays[i] += 1
            lengths = [max(n, p) if n > 0 else 0 for n, p in zip(lengths, pays, strict=True)]
        if best > 0 and any(per_pass):  # `_chains_capped`
            depth = [0] * len(table)
            for k, n in zip(kind, planned, strict=True):
                depth[k] = max(depth[k], n)
            lengths = [min(n, depth[k]) if per_pass[k] > 0 else n for n, k in zip(lengths, kind, strict=True)]
        return DraftPlan(np.array(lengths, dtype=np.int64), float(tokens[best]), float(seconds[best]), float(at[0]))


@dataclass(frozen=True)
class _RequestRates:
    """Each request's drafting rates, at the costs of the kind drafting it ([R] each), and the
    context it would catch up on."""

    kind: np.ndarray
    per_request: np.ndarray
    per_position: np.ndarray
    per_context: np.ndarray
    backlog: np.ndarray

    @classmethod
    def of(cls, costs: DraftingCosts, r: int, kinds: np.ndarray | None, catchup: np.ndarray | None) -> _RequestRates:
        kind = np.zeros(r, dtype=np.int64) if kinds is None else np.asarray(kinds, dtype=np.int64)
        table = costs.table
        backlog = np.zeros(r) if catchup is None else np.asarray(catchup, dtype=np.float64)
        return cls(kind, table[kind, 1], table[kind, 2], table[kind, 3], backlog)

    def start(self, rows: np.ndarray) -> np.ndarray:
        """Seconds for these requests to start drafting: the request, and its catch-up."""
        return self.per_request[rows] + self.per_context[rows] * self.backlog[rows]


def _leave_out_hopeless(surv: np.ndarray, lens: np.ndarray, rates: _RequestRates, seconds_at: np.ndarray) -> None:
    """Zero the survival of each request whose whole expected gain cannot pay, at the plain-
    decoding rate, for its own catch-up and drafting (the scan orders by survival alone)."""
    r, n_flat = len(lens), len(seconds_at) - 1
    ar_rate = r / float(seconds_at[0])
    cost = rates.per_request + rates.per_context * rates.backlog + rates.per_position * lens
    cost = cost + (seconds_at[n_flat] - seconds_at[0]) * lens / max(1, n_flat)
    hopeless = surv.sum(axis=1) < ar_rate * cost
    if hopeless.any():
        surv[hopeless] = 0.0


def _added_seconds(row: np.ndarray, pos: np.ndarray, rates: _RequestRates, costs: DraftingCosts) -> np.ndarray:
    """Drafting seconds each position of the scan's order adds (request row[j], position pos[j]):
    its own; a request's first starts it; a kind's first runs its pass; a position deeper than
    any of its chained kind's so far, one more pass; the first on the replicas, their call."""
    added = rates.per_position[row]
    first = pos == 0  # a request's first position: it starts drafting
    added[first] += rates.start(row[first])
    fixed, per_pass = costs.table[:, 0], costs.table[:, 4]  # [kinds]
    if len(row) and (fixed.any() or per_pass.any()):
        kind_at = rates.kind[row]
        if fixed.any():  # a kind's first position in the order: its pass runs
            present = np.flatnonzero(np.bincount(kind_at, minlength=len(fixed)))
            added[np.argmax(kind_at[None, :] == present[:, None], axis=1)] += fixed[present]
        depth = pos + 1
        for k in per_pass.nonzero()[0]:  # a position deeper than any of its kind's so far: one more pass
            deeper = np.maximum.accumulate(np.where(kind_at == k, depth, 0))
            deeper[1:] -= deeper[:-1].copy()  # how much deeper than its kind's deepest so far
            added += per_pass[k] * deeper
    if len(row) and costs.call:
        calling = costs.calling[rates.kind[row]].nonzero()[0]
        if len(calling):
            added[calling[0]] += costs.call  # the first position drafted on the replicas: the call
    return added


def _chains_capped(lengths: np.ndarray, planned: np.ndarray, kind: np.ndarray, per_pass: np.ndarray) -> np.ndarray:
    """Slack and extension never add a pass to a chained kind's chain: no request of a chained
    kind drafts deeper than the plan's deepest with that kind."""
    if not per_pass.any():
        return lengths
    depth = np.zeros(len(per_pass), dtype=np.int64)
    np.maximum.at(depth, kind, planned)
    return np.where(per_pass[kind] > 0, np.minimum(lengths, depth[kind]), lengths)

