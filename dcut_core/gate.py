"""The drafting gate as one object (`DraftingGate`): each step, before the drafters run, which
drafter kind drafts for each request and how far — from the acceptance trackers, the costs and
`plan_drafts` (dcut_core/drafting.py) and, with several kinds, the kind chooser
(dcut_core/choosing.py). Everything one decision saw is kept as plain numbers (`GateInput`), so a
step log replays the gate exactly (`replay`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core.choosing import KindChooser
from dcut_core.drafting import AcceptanceTracker, DraftCost, Exploration, plan_drafts, survival_matrix
from dcut_core.pruning import StepCost


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
        idle = lengths == 0
        for k, tracker in enumerate(self.trackers):
            tracker.skipped([rid for rid, i in zip(rids, idle & (kinds == k), strict=True) if i])
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
        expected = 1.0 + survival_matrix(predicted)[0].sum(axis=1)
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
