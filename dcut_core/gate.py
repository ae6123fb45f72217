"""The drafting gate as one object (`DraftingGate`): each step, before the drafters run, which
drafter kind drafts for each request and how far — from the acceptance trackers, the costs and
`DraftPlanner` (dcut_core/drafting.py) and the kind chooser (dcut_core/choosing.py), one path
for any number of kinds. Everything one decision saw is kept as plain numbers (`GateInput`), so a
step log replays the gate exactly (`replay`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core.choosing import KindChooser, KindQuestion, StickyChoice, Support
from dcut_core.drafting import (
    AcceptanceTracker,
    DraftCost,
    DraftingCosts,
    Exploration,
    Predicted,
    Survival,
    Verified,
)
from dcut_core.planning import IN_TURN_CELLS, SUMMED_IN_TURN, DraftPlanner, numpy_sum
from dcut_core.pruning import StepCost

# The engine looks the n-gram kind up ahead of the gate (actors/engine/lookahead.py) for batches
# of at most this many decoding requests. Its Python costs ~15 µs a request a step (following the
# sequences' n-gram indexes, then a lookup), 15 ms at 1,024 requests — a GPU step's share — while
# at that load the gate rarely drafts; above it the kind drafts on demand, as the other kinds do.
LOOKAHEAD_REQUESTS = 64
# Up to this many requests, a decision with nothing to choose (one kind hosted, or the step's one
# kind) is made in plain Python (`DraftingGate._decide_in_turn`): at one request numpy's cost per
# call had been most of the decision (docs/benchmarks.md, session 50).
IN_TURN_BATCH = 8


@dataclass(frozen=True)
class KindReach:
    """[R, kinds]: what each drafter kind can do for each request this step — the context it has
    not seen (`lag`: catching up on it comes before drafting), whether the request may use it
    (`allowed`; None: every kind), and the drafts it is known to be able to make now
    (`available`: the n-gram kind's look-ahead; -1: as many as asked; None: not known); and
    `only`, the one kind every request drafts with this step if any (the payoff check's arm of
    that kind: no choice to make)."""

    lag: np.ndarray
    allowed: np.ndarray | None = None
    available: np.ndarray | None = None
    only: int | None = None


@dataclass(frozen=True)
class GateInput:
    """Everything one gate decision sees, in plain numbers: the step's requests, their caps,
    remaining output and lag (per drafter kind, the context it has not seen: catching up on it
    comes before drafting), the drafting costs (each kind's pass, what any drafting step costs
    beyond the passes, the replicas' call and the kinds drafted there), the kinds each request
    may use, the drafts a kind is known to be able to make now (the n-gram kind's look-ahead),
    and the verify cost sampled at every token count the decision can ask about (R .. R + Σ
    caps). The engine builds it every step (`capture`); a step log keeps it (`as_dict`), and
    `replay` feeds it back to a fresh gate."""

    rids: list[int]
    caps: np.ndarray  # [R]
    remaining: np.ndarray  # [R] tokens each request may still emit
    lag: np.ndarray  # [R, kinds] context tokens each kind has not seen
    verify_table: np.ndarray  # verify.seconds(R + n) for n = 0 .. Σ caps
    costs: DraftingCosts
    allowed: np.ndarray | None = None  # [R, kinds] bool
    available: np.ndarray | None = None  # [R, kinds] drafts each kind can make now (-1: as many as asked)
    only: int | None = None  # the one kind every request drafts with (None: the chooser's)

    @classmethod
    def capture(cls, rids: list[int], caps, remaining, reach: KindReach, verify: StepCost,
                costs: DraftingCosts) -> GateInput:
        caps = np.asarray(caps, dtype=np.int64)
        shape = (len(rids), len(costs.draft))
        n = int(caps.sum()) + 1
        table = verify.table  # the step's tabulated curve (`StepCost.tabulated`) holds these counts as they are
        if table is not None and verify.table_lo == len(rids) and len(table) >= n:
            table = table[:n]
        else:
            table = verify.seconds(len(rids) + np.arange(n))
        lag = np.asarray(reach.lag, dtype=np.float64).reshape(shape)
        allowed, available = reach.allowed, reach.available
        if reach.only is not None:  # the other kinds are not the requests' to use this step
            one = np.arange(shape[1]) == reach.only
            allowed = np.broadcast_to(one, shape) if allowed is None else np.asarray(allowed, dtype=bool) & one
        costs = DraftingCosts(list(costs.draft), float(costs.shared_fixed), float(costs.call),
                              None if costs.remote is None else np.asarray(costs.remote, dtype=bool))
        return cls(list(rids), caps, np.asarray(remaining, dtype=np.int64), lag, table, costs,
                   None if allowed is None else np.asarray(allowed, dtype=bool),
                   None if available is None else np.asarray(available, dtype=np.int64).reshape(shape),
                   None if reach.only is None else int(reach.only))

    def room(self) -> np.ndarray:
        """[R, kinds]: the most drafts each kind may make for each request this step: the cap,
        within what the kind can make now (`available`) and only for the kinds it may use."""
        room = np.repeat(self.caps[:, None], len(self.costs.draft), axis=1)
        if self.available is not None:
            room = np.where(self.available >= 0, np.minimum(room, self.available), room)
        if self.allowed is not None:
            room = np.where(self.allowed, room, 0)
        return room

    def usable(self) -> np.ndarray | None:
        """[R, kinds] bool: the kinds each request may choose from — those it allows, less any
        known to have nothing to draft now (None: every kind)."""
        if self.allowed is None and self.available is None:
            return None
        usable = np.ones(self.lag.shape, dtype=bool) if self.allowed is None else self.allowed
        return usable if self.available is None else usable & (self.available != 0)

    def verify(self) -> StepCost:
        """The captured verify cost as a curve (the same values at every count it holds)."""
        table, r = self.verify_table, len(self.rids)
        return StepCost(lambda n: table[np.asarray(n, dtype=np.int64) - r], 0.0, checked=True)

    def as_dict(self) -> dict:
        c = self.costs
        return {"rids": self.rids, "caps": self.caps.tolist(), "remaining": self.remaining.tolist(),
                "lag": self.lag.tolist(), "verify_table": self.verify_table.tolist(),
                "draft": [[d.fixed, d.per_request, d.per_position, d.per_context, d.per_pass] for d in c.draft],
                "allowed": None if self.allowed is None else self.allowed.tolist(), "shared_fixed": c.shared_fixed,
                "available": None if self.available is None else self.available.tolist(), "call": c.call,
                "remote": None if c.remote is None else c.remote.tolist(), "only": self.only}

    @classmethod
    def from_dict(cls, d: dict) -> GateInput:
        """Also reads logs written before the kinds were one path (one kind: a flat cost, a
        per-request `backlog`) and before the replicas' call was priced apart (its cost then
        inside `shared_fixed`: `call` 0)."""
        draft = d["draft"]
        draft = [DraftCost(*x) for x in draft] if draft and isinstance(draft[0], list) else [DraftCost(*draft)]
        lag = np.asarray(d["lag"] if "lag" in d else d["backlog"], dtype=np.float64).reshape(len(d["rids"]), len(draft))
        allowed, available = d.get("allowed"), d.get("available")
        table = np.asarray(d["verify_table"], dtype=np.float64)
        if not np.isfinite(table).all() or (table <= 0).any():
            raise ValueError("a logged verify table must be finite and positive")
        costs = DraftingCosts(draft, d.get("shared_fixed", 0.0), float(d.get("call", 0.0)),
                              None if d.get("remote") is None else np.asarray(d["remote"], dtype=bool))
        return cls(list(d["rids"]), np.asarray(d["caps"], dtype=np.int64), np.asarray(d["remaining"], dtype=np.int64),
                   lag, table, costs,
                   None if allowed is None else np.asarray(allowed, dtype=bool),
                   None if available is None else np.asarray(available, dtype=np.int64).reshape(lag.shape),
                   None if d.get("only") is None else int(d["only"]))


@dataclass(frozen=True)
class Plan:
    """The gate's answer for one step: the drafter kind of each request, how many drafts it is
    asked for (0: none; all 0: a plain decoding step), the kind to draft with instead if its own
    makes none (-1: none), the input it was decided from, and whether the kind chooser ran."""

    kinds: np.ndarray  # [R]
    lengths: np.ndarray  # [R]
    fallback: np.ndarray  # [R]
    seen: GateInput | None = None
    chosen: bool = False  # the kind chooser ran for it (not one kind, nor kinds kept from before)

    @classmethod
    def plain(cls, r: int) -> Plan:
        """No drafting (the policy does not draft, or nothing to draft for)."""
        zeros = np.zeros(r, dtype=np.int64)
        return cls(zeros, zeros, np.full(r, -1, dtype=np.int64))

    @property
    def drafting(self) -> bool:
        return bool(self.lengths.any())


@dataclass
class DraftingGate:
    """The drafting gate as one object: before the drafters run, which drafter kind drafts for
    each request of the step (`KindChooser`) and how many drafts it gets. It predicts acceptance
    (one tracker per kind), charges each request's catch-up, plans with its `planner`, and, when
    drafting does not pay, still explores on its own schedule (`exploration`). One path for any
    number of kinds: one kind is K = 1. Pure: the caller hands it the step's `GateInput`, so it
    is tested in microseconds and replayed from a step log."""

    trackers: list[AcceptanceTracker]  # one per drafter kind
    exploration: Exploration
    planner: DraftPlanner = field(default_factory=lambda: DraftPlanner(slack=2, extend=True))
    bonus: float = 1.0  # the kind chooser's optimism for a kind the unit has seldom verified (tokens)
    teach_empty: bool = True  # `empty` teaches the trackers
    caution: float = 1.0  # the kind chooser's doubt of a kind a request has not verified (tokens)
    stick: int = 2  # decisions a request's kind is kept for before the chooser runs again (1: every step)
    chooser: KindChooser = field(init=False)
    sticky: StickyChoice = field(init=False)

    def __post_init__(self) -> None:
        self.trackers = list(self.trackers)
        self.chooser = KindChooser(len(self.trackers), self.bonus, caution=self.caution)
        self.sticky = StickyChoice(self.stick if len(self.trackers) > 1 else 1)

    def decide(self, g: GateInput) -> Plan:
        """Which kind drafts for each request and how far: the chooser picks the kinds (an
        exploring request drafts all its kind may), the planner the lengths from the chosen
        kinds' predictions and costs, the catch-up charged by each request's lag. A kind is
        predicted only as far as it may draft (`GateInput.room`): an n-gram kind whose look-ahead
        found nothing is worth nothing to that request this step."""
        if len(g.rids) <= IN_TURN_BATCH and (len(self.trackers) == 1 or (g.only is not None and g.allowed is not None)):
            return self._decide_in_turn(g)
        return self._decide_whole(g)

    def _decide_whole(self, g: GateInput) -> Plan:
        """`decide` as array code (any batch, any number of kinds)."""
        rids = g.rids
        predicted = self.predict(g)
        kinds, exploring, fallback, chosen = self.kinds(g, predicted)
        if not predicted.lengths.any():  # no kind may draft for any request: nothing to plan, no probe to spend
            self._idle(rids, kinds, np.ones(len(rids), dtype=bool))
            return Plan(kinds, np.zeros(len(rids), dtype=np.int64), fallback, g, chosen)
        verify, costs = g.verify(), g.costs
        survival = predicted.survival(kinds)
        mine = survival.lengths
        charge = self.catch_up_charge(survival, g.lag[np.arange(len(rids)), kinds], g.remaining)
        plan = self.planner.plan(survival, verify, costs, kinds, charge)
        lengths = np.where(exploring, mine, plan.lengths)
        if not plan.drafting and not exploring.any():
            warming = sum(t.observations for t in self.trackers) < self.exploration.warmup
            probe = self.exploration.probe(len(rids), warming)
            if probe is not None:
                return Plan(kinds, mine * probe, fallback, g, chosen)
        self._idle(rids, kinds, lengths == 0)
        return Plan(kinds, lengths, fallback, g, chosen)

    def _decide_in_turn(self, g: GateInput) -> Plan:
        """`decide` for a few requests and no kind to choose (one hosted, or the step's one kind,
        the others masked out of `allowed` as `GateInput.capture` masks them), on plain lists:
        the same room, predictions, survival (running products), catch-up charge and plan
        (`DraftPlanner.plan_rows`), every row summed as numpy sums it (`numpy_sum`, over the same
        padded width) — the array path's plan to the last bit (tests/core/test_drafting.py), the
        trackers and the exploration schedule moved the same way. Rows wider than `numpy_sum`
        mirrors go to the array path."""
        rids, r = g.rids, len(g.rids)
        k = g.only or 0
        tracker = self.trackers[k]
        kinds = np.full(r, k, dtype=np.int64)
        fallback = np.full(r, -1, dtype=np.int64)
        room = g.caps.tolist()  # `GateInput.room`, kind k's column
        if g.available is not None:
            room = [n if a < 0 else min(n, a) for n, a in zip(room, g.available[:, k].tolist(), strict=True)]
        if g.allowed is not None:
            room = [n if ok else 0 for n, ok in zip(room, g.allowed[:, k].tolist(), strict=True)]
        width = max(room, default=0)
        if width > SUMMED_IN_TURN:
            return self._decide_whole(g)
        if not width:  # no request may draft: nothing to plan, no probe to spend
            tracker.skipped(list(rids))
            return Plan(kinds, np.zeros(r, dtype=np.int64), fallback, g, False)
        base = tracker.rates(width).tolist()  # `predict`: the global rates, the first scaled by each request's factor
        factor = tracker.factor
        rows, expected = [], []
        for rid, n in zip(rids, room, strict=True):
            row = [0.0] * width
            if n:  # running products, as numpy's cumprod
                row[0] = run = min(0.99, base[0] * factor.get(rid, 1.0))
                for j in range(1, n):
                    run *= base[j]
                    row[j] = run
            rows.append(row)
            expected.append(numpy_sum(row))
        lag, remaining = g.lag[:, k].tolist(), g.remaining.tolist()
        charge = [b * min(1.0, (1.0 + e) / max(1.0, float(n)))  # `catch_up_charge`
                  for b, e, n in zip(lag, expected, remaining, strict=True)]
        n_flat = sum(room)
        if n_flat <= IN_TURN_CELLS:
            plan = self.planner.plan_rows(rows, room, g.verify_table[:n_flat + 1].tolist(), g.costs, [k] * r, charge,
                                          expected)
        else:
            survival = Survival(np.array(rows), np.array(room, dtype=np.int64))
            plan = self.planner.plan(survival, g.verify(), g.costs, kinds, np.array(charge))
        lengths = plan.lengths
        if not plan.drafting:
            warming = sum(t.observations for t in self.trackers) < self.exploration.warmup
            probe = self.exploration.probe(r, warming)
            if probe is not None:
                return Plan(kinds, np.array(room, dtype=np.int64) * probe, fallback, g, False)
        idle = [rid for rid, n in zip(rids, lengths.tolist(), strict=True) if n == 0]
        if idle:
            tracker.skipped(idle)
        return Plan(kinds, lengths, fallback, g, False)

    def _idle(self, rids: list[int], kinds: np.ndarray, idle: np.ndarray) -> None:
        """The requests drafting nothing this step (`idle` [R]) skipped by their kinds' trackers."""
        for k, tracker in enumerate(self.trackers):
            mine = idle & (kinds == k)
            if mine.any():
                tracker.skipped([rid for rid, i in zip(rids, mine, strict=True) if i])

    def kinds(self, g: GateInput, predicted: Predicted) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """(kind, exploring, fallback) [R] and whether the chooser ran: the one kind of the step if
        it has one (`only`, or the unit hosts one), the kinds kept from an earlier decision
        (`sticky`) if every request of the batch has one, else the chooser's for the whole batch."""
        r = len(g.rids)
        if g.only is not None or len(self.trackers) == 1:  # the step's one kind: nothing to choose or keep
            return (np.full(r, g.only or 0, dtype=np.int64), np.zeros(r, dtype=bool), np.full(r, -1, dtype=np.int64),
                    False)
        usable = g.usable()
        kept = self.sticky.recall(g.rids, usable)
        if kept is not None:
            return kept[0], np.zeros(len(g.rids), dtype=bool), kept[1], False
        kinds, exploring, fallback = self.chooser.choose(KindQuestion(
            predicted, g.verify(), g.costs, usable, g.lag, g.remaining, self.support(g.rids)))
        self.sticky.keep(g.rids, kinds, fallback)
        return kinds, exploring, fallback, True

    def choose(self, g: GateInput) -> Plan:
        """The kinds `decide` would choose, every request drafting to its cap: for a policy that
        drafts without gating (its requests still teach the trackers)."""
        predicted = self.predict(g)
        kinds, _, fallback = self.chooser.choose(KindQuestion(predicted, g.verify(), g.costs, g.usable(),
                                                              support=Support(self.observed())))
        return Plan(kinds, predicted.lengths[np.arange(len(g.rids)), kinds], fallback, g, len(self.trackers) > 1)

    def predict(self, g: GateInput) -> Predicted:
        """Each kind's predictions for each request, as far as the kind may draft for it
        (`GateInput.room`): an n-gram kind whose look-ahead found nothing is worth nothing to
        that request this step."""
        room = g.room()
        width = int(room.max(initial=0))
        rates = np.zeros((len(g.rids), len(self.trackers), width))
        if width:  # each row `AcceptanceTracker.predict`'s
            for k, t in enumerate(self.trackers):
                if not room[:, k].any():  # a kind no request may draft with this step (another's arm): zeros
                    continue
                rates[:, k] = t.rates(width)
                rates[:, k, 0] = np.minimum(0.99, rates[:, k, 0] * t.factors(g.rids))
            rates[np.arange(width) >= room[:, :, None]] = 0.0
        return Predicted(rates, room)

    def support(self, rids: list[int]) -> Support:
        """What the chooser's estimates rest on: the unit's verifications per kind, and each
        request's own per kind where the chooser reads them (several kinds, caution on)."""
        return Support(self.observed(), self.evidence(rids) if self.chooser.doubts else None)

    def evidence(self, rids: list[int]) -> np.ndarray:
        """[R, kinds] verifications each request's own factor under each kind rests on."""
        out = np.empty((len(rids), len(self.trackers)))
        for k, t in enumerate(self.trackers):
            out[:, k] = np.fromiter((t.verifications(rid) for rid in rids), dtype=np.float64, count=len(rids))
        return out

    def observed(self) -> np.ndarray:
        """[kinds] verifications each kind's tracker has learnt from (a warm start's included):
        the kind chooser's measure of how sure its estimates are."""
        return np.array([t.observations for t in self.trackers], dtype=np.float64)

    def learn(self, verified: Verified, empty: list[tuple[int, int]] = ()) -> None:
        """A step's verifications, each kind's tracker learning its entries as one batch
        (`AcceptanceTracker.learn`), then `empty`: (request, kind) pairs where the kind was asked
        for drafts and made none (an n-gram drafter finds no match) — with `teach_empty`, a try
        that yielded nothing, taught as a first draft rejected. Otherwise nothing would be
        observed, and a kind whose estimates lead would be chosen for the request again and
        again, drafting nothing."""
        if empty and self.teach_empty:
            rids, kinds = zip(*empty, strict=True)
            verified = verified.then(Verified.of(rids, kinds, np.ones(len(rids)), np.zeros(len(rids))))
        for k, tracker in enumerate(self.trackers):
            mine = verified.of_kind(k)
            if len(mine):
                tracker.learn(mine)
        self.sticky.doubt(verified.rids, verified.kinds, verified.accepted)

    def observe(self, rid: int, kind: int, kept: int, accepted: int, beyond: np.ndarray | None = None) -> None:
        """One verification of request rid's drafts by drafter `kind` (`learn` of one)."""
        self.learn(Verified.of([rid], [kind], [kept], [accepted], None if beyond is None else [beyond]))

    def forget(self, rid: int) -> None:
        for t in self.trackers:
            t.forget(rid)
        self.sticky.forget(rid)

    def held(self) -> dict[str, int]:
        """Request records it keeps, by owner (all 0 once every request is forgotten)."""
        return {"trackers": sum(t.held() for t in self.trackers), "sticky_choices": self.sticky.held()}

    @staticmethod
    def catch_up_charge(survival: Survival, backlog: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        """Tokens of catch-up charged to this step: each request's backlog in proportion to the
        share of its remaining output the step may commit (1 + Σ predicted survival over
        `remaining`). Catching up is paid once and serves
        every later drafting step; charged in full, it would grow each step a request does not
        draft and keep it from ever drafting."""
        expected = 1.0 + survival.expected()
        return backlog * np.minimum(1.0, expected / np.maximum(1.0, np.asarray(remaining, dtype=np.float64)))


def replay(gate: DraftingGate, steps) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run `gate` over a step log's records in order (dicts as `StepLog` writes them): each
    logged decision's input is decided again, and each step's verification outcomes are observed
    as the engine observed them (a step marked `late` after the next step's decision, as the
    engine learns a step while the next one's forward runs). Returns (logged, replayed) plans,
    each [2, R] (kinds; drafts): a gate with the engine's settings reproduces every plan exactly;
    another setting shows what it would have asked for on the same history."""
    plans, later = [], None  # later: a step's outcome the engine learnt after the next decision
    for rec in steps:
        if rec.get("gate"):
            plan = gate.decide(GateInput.from_dict(rec["gate"]["input"]))
            logged = np.asarray(rec["gate"]["lengths"], dtype=np.int64)
            kinds = rec["gate"].get("kinds")
            logged_kinds = np.zeros_like(logged) if kinds is None else np.asarray(kinds, dtype=np.int64)
            plans.append((np.stack([logged_kinds, logged]), np.stack([plan.kinds, plan.lengths])))
        if later is not None:
            _learn_logged(gate, later)
            later = None
        obs = rec.get("observed")
        if rec.get("late"):
            later = obs
        elif obs:
            _learn_logged(gate, obs)
    return plans


def _learn_logged(gate: DraftingGate, obs: dict) -> None:
    """What the trackers learnt from one logged step (`Verified.as_dict`, its `empty` tries)."""
    if not obs:
        return
    verified = Verified.from_dict(obs)
    shadow = obs.get("shadow")  # logs before one step was learnt as one batch
    if shadow:
        verified = verified.then(Verified.of(*zip(*shadow, strict=True)))
    gate.learn(verified, [tuple(e) for e in obs.get("empty") or ()])
