"""The drafting gate: before the drafters run, how many drafts each request should get.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core import ragged
from dcut_core.choosing import KindChooser
from dcut_core.pruning import DraftBatch, StepCost


@dataclass(frozen=True)
class DraftCost:
    """Seconds one drafting pass costs: a call, each drafting request, each drafted position, each
    context token caught up on, and each step of its chain — a chained drafter (MTP) runs one
    pass per draft position, so its time grows with the longest request's drafts (`passes`),
    whatever the others ask for."""

    fixed: float = 0.0
    per_request: float = 0.0
    per_position: float = 0.0
    per_context: float = 0.0  # each context token a drafter catches up on before drafting
    per_pass: float = 0.0  # each draft position of the longest request (a chain's sequential passes)

    def seconds(self, requests: np.ndarray | int, positions: np.ndarray | int,
                context: np.ndarray | int = 0, passes: np.ndarray | int = 0) -> np.ndarray:
        r, p = np.asarray(requests, dtype=np.float64), np.asarray(positions, dtype=np.float64)
        c, n = np.asarray(context, dtype=np.float64), np.asarray(passes, dtype=np.float64)
        return np.where(p > 0, self.fixed + self.per_request * r + self.per_position * p + self.per_context * c
                        + self.per_pass * n, 0.0)


@dataclass(frozen=True)
class DraftPlan:
    lengths: np.ndarray  # [R] drafts to ask of each request's drafter (0: none)
    expected_tokens: float
    predicted_seconds: float
    ar_seconds: float  # predicted time of a plain decoding step instead

    @property
    def drafting(self) -> bool:
        return bool(self.lengths.sum())


def plan_drafts(predicted: list[np.ndarray], verify: StepCost, draft: DraftCost | list[DraftCost],
                max_budget: int | None = None, slack: int = 0, catchup: np.ndarray | None = None,
                extend: bool = False, kinds: np.ndarray | None = None, shared_fixed: float = 0.0) -> DraftPlan:
    """predicted[i]: conditional acceptance of request i's draft positions 0 .. n_i − 1.

    Several drafter kinds (`kinds[i]`: the kind drafting request i; `draft[k]`: kind k's cost):
    each kind's pass is charged once if any request drafts with it (its `fixed`), each request
    and position at its own kind's rates, and `shared_fixed` once for any drafting at all (the
    call that carries every kind's work). One DraftCost and no kinds is the one-kind case.

    catchup[i]: context tokens request i's drafter must catch up on if it drafts this step.
    A request whose whole expected gain cannot pay for its own catch-up and drafting at the
    plain-decoding rate is left out before the scan (the scan orders by survival alone).

    slack: extra positions drafted past the plan for each request that drafts at all (at most
    n_i). The plan is made from predictions; pruning decides again from the drafts' own
    confidences, and can only keep what was drafted — without slack the two cuts compound.
    extend: also draft, for each request that drafts at all, every further position whose
    predicted survival pays for drafting it alone (survival ≥ plan rate × per-position cost).
    The plan's verify budget is a guess from predictions; what is verified is pruning's call,
    and drafting a position costs far less than verifying it (one more row of the same pass).
    """
    flat, cu = ragged.flatten(predicted)
    batch = DraftBatch(ragged.segment_cumprod(np.clip(flat, 0.0, 1.0), cu), cu)
    r = batch.num_requests
    costs = [draft] if isinstance(draft, DraftCost) else list(draft)
    kind = np.zeros(r, dtype=np.int64) if kinds is None else np.asarray(kinds, dtype=np.int64)
    def column(name: str) -> np.ndarray:
        return np.array([getattr(c, name) for c in costs], dtype=np.float64)

    fixed, per_pass = column("fixed"), column("per_pass")  # [kinds]
    per_request, per_position, per_context = (column(n)[kind] for n in ("per_request", "per_position", "per_context"))
    backlog = np.zeros(r) if catchup is None else np.asarray(catchup, dtype=np.float64)
    if catchup is not None and r:
        ar_rate = r / float(verify.seconds(np.array([r]))[0])
        gain = ragged.segment_sums(batch.survival, cu)
        cost = per_request + per_context * backlog + per_position * batch.drafted
        cost = cost + (verify.seconds(np.array([r + int(batch.drafted.sum())]))[0]
                       - verify.seconds(np.array([r]))[0]) * batch.drafted / max(1, int(batch.drafted.sum()))
        hopeless = gain < ar_rate * cost
        if hopeless.any():
            keep = np.repeat(~hopeless, batch.drafted)
            batch = DraftBatch(np.where(keep, batch.survival, 0.0), cu)
    # Positions by survival per second of their own cost, high to low (by survival where every
    # kind's position costs the same), position order on ties: prefix-closed within a request.
    tau = float(np.diff(verify.seconds(np.array([r, r + 1])))[0]) if len(flat) else 0.0
    density = batch.survival / np.maximum(tau + np.repeat(per_position, batch.drafted), 1e-12)
    order = np.argsort(-density, kind="stable")  # [N]
    m_max = len(order) if max_budget is None else min(len(order), max_budget)
    tokens = np.concatenate([[float(r)], r + np.cumsum(batch.survival[order[:m_max]])])
    owner = np.repeat(np.arange(r), batch.drafted)  # the request of each flat position
    row = owner[order[:m_max]]  # the request of each position in order
    first = ragged.positions(cu)[order[:m_max]] == 0  # a request's first position: it starts drafting
    kind_first = np.zeros(m_max)  # a kind's first position in the order: its pass runs
    longer = np.zeros(m_max)  # a position deeper than any of its kind's so far: one more chained pass
    depth = ragged.positions(cu)[order[:m_max]] + 1
    for k in np.unique(kind[row]):
        mine = np.flatnonzero(kind[row] == k)
        kind_first[mine[0]] = fixed[k]
        longer[mine] = per_pass[k] * np.diff(np.maximum.accumulate(depth[mine]), prepend=0)
    added = first * (per_request[row] + per_context[row] * backlog[row]) + per_position[row] + kind_first + longer
    m = np.arange(m_max + 1)
    seconds = verify.seconds(r + m) + np.concatenate([[0.0], shared_fixed + np.cumsum(added)])
    best = int(np.argmax(tokens / seconds))
    lengths = np.bincount(owner[order[:best]], minlength=r).astype(np.int64)
    if slack:
        lengths = np.where(lengths > 0, np.minimum(lengths + slack, batch.drafted), 0)
    if extend and best > 0:
        worth = batch.survival >= tokens[best] / seconds[best] * np.repeat(per_position, batch.drafted)
        pays = ragged.segment_sums(ragged.segment_cumprod(worth.astype(np.float64), cu), cu).astype(np.int64)
        lengths = np.where(lengths > 0, np.maximum(lengths, pays), 0)
    return DraftPlan(lengths, float(tokens[best]), float(seconds[best]), float(seconds[0]))


@dataclass
class AcceptanceTracker:
    """Predicts a request's conditional acceptance by draft position from past verifications.

    Global part: exponentially weighted accepted / judged counts per position. Request part: a
    multiplier, the request's own recent accepted drafts over what the global rates predicted
    (requests differ: repetitive code accepts far more than prose).
    """

    block: int
    halflife_steps: float = 20.0
    prior: float = 0.5
    accepted: np.ndarray = field(init=False)
    judged: np.ndarray = field(init=False)
    factor: dict[int, float] = field(default_factory=dict)
    observations: int = 0  # verifications seen (requests × steps with kept drafts)
    _sums: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)  # decayed accepted, expected

    def __post_init__(self) -> None:
        self.accepted = np.full(self.block, self.prior)  # one pseudo-observation at the prior
        self.judged = np.ones(self.block)

    @property
    def global_rate(self) -> np.ndarray:
        return self.accepted / self.judged

    def predict(self, rid: int, n: int) -> np.ndarray:
        """Conditional acceptance [n] of request rid's next n draft positions.

        The request's factor is its accepted drafts over what the global rates expected, so it
        scales the expected number accepted — the survivals — not every conditional rate (which
        compounds: a factor of 0.7 on each of 15 positions predicts a third as many, not 70 %).
        Scaling the survivals by f is scaling the first position's rate; where that would pass
        0.99 it stops there (an underestimate for the best requests, which draft anyway)."""
        rate = np.clip(self.global_rate[:n], 0.0, 0.99)
        if n:
            rate[0] = min(0.99, rate[0] * self.factor.get(rid, 1.0))
        return rate

    def predict_batch(self, rids: list[int], lengths: np.ndarray) -> list[np.ndarray]:
        """`predict` for many requests at once: [predict(rid, n) for rid, n in zip(rids, lengths)]."""
        n_max = int(max(lengths, default=0))
        rates = np.tile(np.clip(self.global_rate[:n_max], 0.0, 0.99), (len(rids), 1))
        if n_max:
            f = np.array([self.factor.get(rid, 1.0) for rid in rids])
            rates[:, 0] = np.minimum(0.99, rates[:, 0] * f)
        return [rates[i, :n] for i, n in enumerate(np.asarray(lengths, dtype=np.int64))]

    def observe(self, rid: int, kept: int, accepted: int, beyond: np.ndarray | None = None) -> None:
        """One verification of request rid: kept drafts, of which the first `accepted` passed.

        beyond: calibrated conditional acceptance of the positions drafted past the kept ones.
        Pruning keeps confident drafts, so outcomes alone overrate deep positions; when every
        kept draft passed, those positions were reached and count softly (reached with the
        product of the estimates before them, accepted with that times their own), so the
        rates describe all drafts. A step whose drafts were all pruned still teaches."""
        beyond = np.zeros(0) if beyond is None or accepted < kept else np.asarray(beyond, dtype=np.float64)
        beyond = beyond[: max(0, self.block - kept)]
        if kept <= 0 and not len(beyond):
            return
        self.observations += 1
        decay = 0.5 ** (1.0 / self.halflife_steps)
        if kept > 0:
            judged = np.arange(self.block) <= min(accepted, kept - 1)  # censoring as in acceptance.py
            judged &= np.arange(self.block) < kept
            hits = np.arange(self.block) < accepted
            self.accepted[judged] = decay * self.accepted[judged] + hits[judged]
            self.judged[judged] = decay * self.judged[judged] + 1.0
        if len(beyond):
            pos = np.arange(kept, kept + len(beyond))
            reach = np.concatenate([[1.0], np.cumprod(beyond)[:-1]])
            self.accepted[pos] = decay * self.accepted[pos] + reach * beyond
            self.judged[pos] = decay * self.judged[pos] + reach
        if kept <= 0:
            return
        expected = float(np.cumprod(self.global_rate[:kept]).sum())
        # Decayed sums, then their ratio: an average of per-step ratios would be pulled to 1
        # by the smoothing every single step needs.
        a, e = self._sums.get(rid, (0.0, 0.0))
        self._sums[rid] = (0.7 * a + accepted, 0.7 * e + expected)
        self._set_factor(rid)

    def skipped(self, rid: int, halflife_steps: float = 4.0) -> None:
        """Request rid drafted nothing this step: its factor drifts back toward 1 (the global
        rate). Without this a request whose factor fell after a few misses predicts too little
        to ever draft again, and so is never observed again — it stays in plain decoding."""
        if rid in self._sums:
            keep = 0.5 ** (1.0 / halflife_steps)
            a, e = self._sums[rid]
            self._sums[rid] = (e + (a - e) * keep, e)
            self._set_factor(rid)

    def _set_factor(self, rid: int) -> None:
        a, e = self._sums[rid]
        self.factor[rid] = float(np.clip((a + 0.5) / (e + 0.5), 0.05, 3.0))

    def forget(self, rid: int) -> None:
        self._sums.pop(rid, None)
        self.factor.pop(rid, None)


@dataclass
class Exploration:
    """When the gate rates drafting not worth it, still draft now and then so it keeps learning
    what drafting costs and yields: every `every`-th decision (and every one while `warming`),
    for `requests` requests of the batch, in turn. A whole batch of full drafts would cost
    several steps' worth. Counts its own decisions (`steps`): nothing else's counter drives it."""

    every: int = 50
    requests: int = 4
    warmup: int = 64  # observations the tracker needs before the schedule thins out
    steps: int = 0

    def probe(self, batch: int, warming: bool) -> np.ndarray | None:
        """A 0/1 mask [batch] of the requests to draft for this time, or None (not this time)."""
        step, self.steps = self.steps, self.steps + 1
        if batch == 0 or not (warming or step % self.every == 0):
            return None
        k = min(batch, self.requests)
        start = (step // self.every * k) % batch
        mask = np.zeros(batch, dtype=np.int64)
        mask[(start + np.arange(k)) % batch] = 1
        return mask


@dataclass(frozen=True)
class GateInput:
    """Everything one gate decision saw, in plain numbers: the step's requests, their caps,
    remaining output and backlog, the drafting cost (one DraftCost, or one per drafter kind with
    the kinds each request may use and the call's shared cost), and the verify cost sampled at
    every token count the decision can ask about (R .. R + Σ caps). A step log keeps it
    (`as_dict`), and `replay` feeds it back to a fresh gate."""

    rids: list[int]
    caps: np.ndarray
    remaining: np.ndarray
    backlog: np.ndarray
    verify_table: np.ndarray  # verify.seconds(R + n) for n = 0 .. Σ caps
    draft: DraftCost | list[DraftCost]
    allowed: np.ndarray | None = None  # [R, kinds] bool
    shared_fixed: float = 0.0

    @classmethod
    def capture(cls, rids: list[int], caps, remaining, backlog, verify: StepCost, draft, allowed=None,
                shared_fixed: float = 0.0) -> GateInput:
        caps = np.asarray(caps, dtype=np.int64)
        tokens = len(rids) + np.arange(int(caps.sum()) + 1)
        return cls(list(rids), caps, np.asarray(remaining, dtype=np.int64), np.asarray(backlog, dtype=np.float64),
                   verify.seconds(tokens), draft if isinstance(draft, DraftCost) else list(draft),
                   None if allowed is None else np.asarray(allowed, dtype=bool), float(shared_fixed))

    def verify(self) -> StepCost:
        """The captured verify cost as a curve (the same values at every count it holds)."""
        table, r = self.verify_table, len(self.rids)
        return StepCost(lambda n: table[np.asarray(n, dtype=np.int64) - r], 0.0)

    def as_dict(self) -> dict:
        def fields(d: DraftCost) -> list[float]:
            return [d.fixed, d.per_request, d.per_position, d.per_context, d.per_pass]

        return {"rids": self.rids, "caps": self.caps.tolist(), "remaining": self.remaining.tolist(),
                "backlog": self.backlog.tolist(), "verify_table": self.verify_table.tolist(),
                "draft": fields(self.draft) if isinstance(self.draft, DraftCost) else [fields(d) for d in self.draft],
                "allowed": None if self.allowed is None else self.allowed.tolist(), "shared_fixed": self.shared_fixed}

    @classmethod
    def from_dict(cls, d: dict) -> GateInput:
        draft = d["draft"]
        draft = [DraftCost(*x) for x in draft] if draft and isinstance(draft[0], list) else DraftCost(*draft)
        allowed = d.get("allowed")
        return cls(list(d["rids"]), np.asarray(d["caps"], dtype=np.int64), np.asarray(d["remaining"], dtype=np.int64),
                   np.asarray(d["backlog"], dtype=np.float64), np.asarray(d["verify_table"], dtype=np.float64),
                   draft, None if allowed is None else np.asarray(allowed, dtype=bool), d.get("shared_fixed", 0.0))


@dataclass
class DraftingGate:
    """The drafting gate as one object: before the drafters run, which drafter kind drafts for
    each request of the step (`KindChooser`, when the unit hosts several) and how many drafts it
    gets (0: none; all 0: a plain decoding step). It predicts acceptance (one tracker per kind),
    charges each request's catch-up, plans with `plan_drafts`, and, when drafting does not pay,
    still explores on its own schedule (`exploration`). Pure: the caller hands it the step's
    costs and the backlog sizes, so it is tested in microseconds and replayed from a step log."""

    tracker: AcceptanceTracker | list[AcceptanceTracker]  # one per drafter kind; `tracker` is the first
    exploration: Exploration
    max_budget: int | None = None
    slack: int = 2
    extend: bool = True
    record: bool = False  # keep each decision's input and output in `last` (a step log asks for it)
    last: tuple | None = None  # (GateInput, lengths, kinds)
    bonus: float = 1.0  # the kind chooser's optimism (tokens)
    teach_empty: bool = True  # `empty` teaches the trackers (several kinds)
    trackers: list[AcceptanceTracker] = field(init=False)
    chooser: KindChooser = field(init=False)
    fallback: np.ndarray | None = None  # the last decision's kind per request if its own drafts nothing (-1: none)

    def __post_init__(self) -> None:
        self.trackers = list(self.tracker) if isinstance(self.tracker, list | tuple) else [self.tracker]
        self.tracker = self.trackers[0]
        self.chooser = KindChooser(len(self.trackers), self.bonus)

    def decide(self, rids: list[int], caps: np.ndarray, remaining: np.ndarray, backlog: np.ndarray,
               verify: StepCost, draft: DraftCost | list[DraftCost], allowed: np.ndarray | None = None,
               shared_fixed: float = 0.0) -> np.ndarray:
        """Drafts [R] to ask for (`decide_kinds` without the kinds)."""
        return self.decide_kinds(rids, caps, remaining, backlog, verify, draft, allowed, shared_fixed)[1]

    def decide_kinds(self, rids: list[int], caps: np.ndarray, remaining: np.ndarray, backlog: np.ndarray,
                     verify: StepCost, draft: DraftCost | list[DraftCost], allowed: np.ndarray | None = None,
                     shared_fixed: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(kind [R], drafts [R]) to ask for. caps: the most each request may draft; remaining:
        tokens each may still emit; backlog: tokens each request's drafter has yet to catch up on
        ([R, kinds] with several kinds: what each kind has not seen, which a switch would cost);
        draft: the drafting cost, one per kind when several; allowed [R, kinds]: the kinds each
        request may use; shared_fixed: what any drafting step costs on top of the kinds' passes."""
        captured = GateInput.capture(rids, caps, remaining, backlog, verify, draft, allowed,
                                     shared_fixed) if self.record else None
        kinds, lengths = self._decide(rids, np.asarray(caps, dtype=np.int64), remaining, backlog, verify, draft,
                                      allowed, shared_fixed)
        if captured is not None:
            self.last = (captured, lengths, kinds)
        return kinds, lengths

    def _decide(self, rids, caps, remaining, backlog, verify: StepCost, draft, allowed, shared_fixed):
        exploring = None
        if len(self.trackers) == 1:
            kinds = np.zeros(len(rids), dtype=np.int64)
            predicted = self.tracker.predict_batch(rids, caps)
        else:
            costs = [draft] * len(self.trackers) if isinstance(draft, DraftCost) else draft
            per_kind = [t.predict_batch(rids, caps) for t in self.trackers]
            backlog = np.asarray(backlog, dtype=np.float64)
            held = backlog if backlog.ndim == 2 else None
            kinds, exploring, self.fallback = self.chooser.choose(rids, per_kind, verify, costs, allowed,
                                                                  held=held, remaining=remaining)
            predicted = [per_kind[k][i] for i, k in enumerate(kinds)]
            if held is not None:
                backlog = held[np.arange(len(rids)), kinds]
        charge = self.catch_up_charge(predicted, np.asarray(backlog, dtype=np.float64), remaining)
        plan = plan_drafts(predicted, verify, draft, self.max_budget, self.slack, charge, extend=self.extend,
                           kinds=kinds, shared_fixed=shared_fixed)
        if not plan.drafting and (exploring is None or not exploring.any()):
            warming = sum(t.observations for t in self.trackers) < self.exploration.warmup
            probe = self.exploration.probe(len(rids), warming)
            if probe is not None:
                return kinds, caps * probe
        lengths = plan.lengths if exploring is None else np.where(exploring, caps, plan.lengths)
        for rid, k, n in zip(rids, kinds, lengths, strict=True):
            if n == 0:
                self.trackers[k].skipped(rid)
        return kinds, lengths

    def choose_kinds(self, rids: list[int], caps: np.ndarray, verify: StepCost, costs: list[DraftCost],
                     allowed: np.ndarray | None = None) -> np.ndarray:
        """The kind [R] each request drafts with, chosen as `decide_kinds` would, for a policy that
        drafts every request to its cap without gating (its requests still teach the trackers)."""
        per_kind = [t.predict_batch(rids, np.asarray(caps, dtype=np.int64)) for t in self.trackers]
        kinds, _, self.fallback = self.chooser.choose(rids, per_kind, verify, costs, allowed)
        return kinds

    def observe(self, rid: int, kind: int, kept: int, accepted: int, beyond: np.ndarray | None = None) -> None:
        """One verification of request rid's drafts by drafter `kind` (`AcceptanceTracker.observe`)."""
        self.trackers[kind].observe(rid, kept, accepted, beyond)
        self.chooser.observe(rid, kind, kept)

    def empty(self, rid: int, kind: int) -> None:
        """Drafter `kind` was asked for drafts for request rid and made none (an n-gram drafter
        finds no match): a try that yielded nothing, taught as a first draft rejected. Otherwise
        nothing would be observed, and a kind whose estimates lead would be chosen for the request
        again and again, drafting nothing."""
        if self.teach_empty:
            self.observe(rid, kind, 1, 0)

    def forget(self, rid: int) -> None:
        for t in self.trackers:
            t.forget(rid)
        self.chooser.forget(rid)

    @staticmethod
    def catch_up_charge(predicted: list[np.ndarray], backlog: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        """Tokens of catch-up charged to this step: each request's backlog in proportion to the
        share of its remaining output the step may commit (1 + Σ predicted survival over
        `remaining`). Catching up is paid once and serves every later drafting step; charged in
        full, it would grow each step a request does not draft and keep it from ever drafting."""
        flat, cu = ragged.flatten(predicted)
        expected = 1.0 + ragged.segment_sums(ragged.segment_cumprod(flat, cu), cu)
        return backlog * np.minimum(1.0, expected / np.maximum(1.0, np.asarray(remaining, dtype=np.float64)))


def replay(gate: DraftingGate, steps) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run `gate` over a step log's records in order (dicts as `StepLog` writes them): each
    logged decision's input is decided again, and each step's verification outcomes are observed
    as the engine observed them. Returns (logged, replayed) plans — drafts [R], or [2, R] (kinds;
    drafts) when the log names kinds: a gate with the engine's settings reproduces every plan
    exactly; another setting shows what it would have asked for on the same history."""
    plans = []
    for rec in steps:
        if rec.get("gate"):
            g = GateInput.from_dict(rec["gate"]["input"])
            kinds, got = gate.decide_kinds(g.rids, g.caps, g.remaining, g.backlog, g.verify(), g.draft, g.allowed,
                                           g.shared_fixed)
            logged = np.asarray(rec["gate"]["lengths"], dtype=np.int64)
            if rec["gate"].get("kinds") is not None:
                logged, got = np.stack([rec["gate"]["kinds"], logged]), np.stack([kinds, got])
            plans.append((logged, got))
        obs = rec.get("observed")
        if obs:
            beyond, cu = obs["beyond"], obs["beyond_cu"]
            for i, rid in enumerate(obs["rids"]):
                b = None if cu is None else np.asarray(beyond[cu[i]:cu[i + 1]], dtype=np.float64)
                gate.observe(rid, obs["kinds"][i] if obs.get("kinds") else 0, obs["kept"][i], obs["accepted"][i], b)
            for rid, kind in obs.get("empty") or ():
                gate.empty(rid, kind)
    return plans
