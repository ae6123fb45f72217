"""The engine's decisions replayed over a counterfactual trace (`dcut_core.counterfactual`).

A closed loop at concurrency C over the trace's requests (a finished request is replaced by the
next one, as `dcut bench` drives the engine): every step schedules (prefill in chunks riding in
the step's forward), plans with the real `DraftingGate` (and its kind chooser), takes each
request's drafts at its position from the trace, prunes with the real policy on calibrated
survivals, accepts min(kept, accepted) + the bonus token, and teaches the calibrators and the
gate exactly as `actors/engine/learning.py` does. Time advances by the trace's measured costs:
the forward of the step's shape, each kind's drafting pass and catch-up, the step's own time.

What the engine learns about costs online is given here as the measured costs (the gate sees the
truth); everything it learns about acceptance is learnt here as there. `oracle_run` is the
hindsight bound: each request-step drafts with the kind that would have had the most accepted,
exactly that many drafts, where that pays (`oracle_step`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import combinations

import numpy as np

from dcut_core import ragged
from dcut_core.acceptance import Calibrator, survival, verify_outcomes
from dcut_core.chains import ChainStop, cut_lengths
from dcut_core.cost_model import StepShape
from dcut_core.counterfactual import Trace
from dcut_core.drafting import AcceptanceTracker, DraftCost, Exploration, Predicted, Verified
from dcut_core.gate import LOOKAHEAD_REQUESTS, DraftingCosts, DraftingGate, GateInput, KindReach, Plan
from dcut_core.learned import KindState, LearnedState
from dcut_core.payoff import PLAIN, PayoffCheck, arms_of, kind_of
from dcut_core.planning import DraftPlanner
from dcut_core.pruning import DraftBatch, policy_from_name


@dataclass(frozen=True)
class SimSettings:
    """What an engine is configured with (the `EngineConfig` fields the decisions read)."""

    policy: str = "dcut"
    kinds: tuple[str, ...] = ("block",)  # the drafter kinds hosted (one: a single kind; several: chosen per request)
    block: int | None = None  # default: the trace's
    load_block: tuple[int, int] | None = None  # (requests, block): a shorter block above that load (`EngineConfig`)
    drafting_gate: bool = True
    explore_every: int = 50
    explore_requests: int = 4
    explore_warmup: int = 64
    draft_slack: int = 2
    draft_extend: bool = True
    guard_threshold: float = 0.02
    max_budget: int | None = None
    prefill_chunk: int = 512
    prefill_budget: int = 2048
    backlog_tokens: int = 512  # one kind: context held back per request before it is sent anyway
    bonus: float = 1.0  # the kind chooser's optimism (UCB bonus, tokens; `DraftingGate.bonus`)
    lookahead: bool = True  # the n-gram kind looked up for every request before the gate, and taught by it
    # The gate told each kind's accepted length at every request's position in place of the
    # trackers' predictions (`HindsightGate`); all else as the engine: the bound on what better
    # prediction could buy, apart from the chooser's and planner's own accounting.
    hindsight: bool = False
    caution: float = 1.0  # the kind chooser's doubt of a kind a request has not verified (`DraftingGate.caution`)
    shrink: float = 4.0  # the trackers' pull of a request's factor toward 1 (`AcceptanceTracker.shrink`)
    stick: int = 2  # decisions a request's kind is kept for (`DraftingGate.stick`)
    overlap: bool = False  # a step is learnt after the next step's plan (`EngineConfig.overlap`: GPU ranks)
    chain_stop: bool = False  # chained kinds cut pass by pass (`EngineConfig.chain_stop`, dcut_core/chains.py)
    chained: tuple[str, ...] = ("mtp",)  # the kinds that draft a pass per position (`DrafterKind.chained`)
    payoff_check: bool = True  # plain decoding measured beside the gate's steps (`EngineConfig.payoff_check`)
    payoff_kind_arms: bool = True  # ... and each kind alone (`EngineConfig.payoff_kind_arms`)


@dataclass
class SimResult:
    """One simulated run: tokens, seconds and where the time went."""

    policy: str
    kinds: tuple[str, ...]
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    decode_steps: int = 0  # request-steps that decoded (MAT's denominator)
    accepted: int = 0
    drafted: int = 0
    kept: int = 0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    chosen: dict[str, int] = field(default_factory=dict)  # request-steps drafted by each kind
    choices: int = 0  # steps where the kind chooser ran

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mat(self) -> float:
        return (self.accepted + self.decode_steps) / self.decode_steps if self.decode_steps else 0.0

    @property
    def drafting_share(self) -> float:
        return self.draft_seconds / self.seconds if self.seconds else 0.0

    @property
    def rest_seconds(self) -> float:
        """The time outside the forwards and the drafters' passes: the engine's own, the chooser's."""
        return self.seconds - self.forward_seconds - self.draft_seconds

    def record(self) -> dict:
        return {"policy": self.policy, "kinds": list(self.kinds), "concurrency": self.concurrency,
                "tok_s": self.tok_s, "mat": self.mat, "drafting_share": self.drafting_share, "steps": self.steps,
                "keep_ratio": self.kept / self.drafted if self.drafted else 0.0, "chosen": self.chosen,
                "choices": self.choices}


@dataclass
class _Live:
    """One running request of the simulated loop."""

    rid: int
    q: int  # index into trace.requests
    fed: int = 0  # prompt tokens in the KV cache
    t: int = 0  # output tokens committed
    seen: np.ndarray | None = None  # per hosted kind: context length its drafter has seen

    def cached(self, prompt_len: int) -> int:
        return prompt_len + self.t - 1


@dataclass(frozen=True)
class _Outcome:
    """What one simulated step leaves for the estimators to learn: its requests and their output
    positions then (`at`), the look-ahead, the drafts and the kind that made each request's, the
    drafts asked, kept and accepted, and the calibrated estimates."""

    batch: list
    at: list[int]
    available: np.ndarray | None
    drafts: dict
    used: np.ndarray
    lengths: np.ndarray
    kept: np.ndarray
    accepted: np.ndarray
    estimate: np.ndarray | None


class _Run:
    """The state of one simulated engine (the parts `Engine` owns that decide)."""

    def __init__(self, trace: Trace, s: SimSettings, concurrency: int) -> None:
        trace = trace.at_concurrency(concurrency)  # the n-gram kind's corpus as a loop at this concurrency holds it
        self.trace, self.s, self.c = trace, s, concurrency
        self.block = s.block or trace.block
        if self.block > trace.block:
            raise ValueError(f"block {self.block} is above the trace's {trace.block}")
        self.policy = policy_from_name(s.policy, self.block, **({"guard_threshold": s.guard_threshold,
                                                                  "max_budget": s.max_budget}
                                                                 if s.policy == "dcut" else {}))
        self.kidx = trace.kind_index(s.kinds)  # hosted kind j is trace kind kidx[j]
        k = len(s.kinds)
        # A replica of one kind hands context straight to its drafter (the engine's backlog limit
        # sends it at commit time); a replica of several holds it until the kind drafts.
        self.direct = k == 1
        self.calibrators = [Calibrator(block=self.block) for _ in range(k)]
        self.gate = (HindsightGate if s.hindsight else DraftingGate)(
            [AcceptanceTracker(block=self.block, shrink=s.shrink) for _ in range(k)],
            Exploration(s.explore_every, s.explore_requests, s.explore_warmup),
            DraftPlanner(s.max_budget, s.draft_slack, s.draft_extend), bonus=s.bonus, teach_empty=k > 1,
            caution=s.caution, stick=s.stick)
        self.costs = costs = trace.costs.for_kinds(k)  # the own time of an engine hosting k kinds
        # A step of the payoff check's arm of one kind chooses none: its own time is a one-kind
        # engine's (hosting the others costs ~0.2 ms a step more at 16 requests on the real
        # target, not separated in the trace: docs/benchmarks.md, session 39).
        self.one_kind = trace.costs.for_kinds(1)
        self.draft = [costs.draft[i] for i in self.kidx]
        # The engine looks the n-gram kind up for every request before its gate decides (it knows
        # what that kind can draft, and learns what it would have had accepted every step).
        self.ngram = s.kinds.index("ngram") if s.lookahead and "ngram" in s.kinds else None
        self.remote = np.array([k != "ngram" for k in s.kinds])  # the kinds drafted on the replicas
        self._available: np.ndarray | None = None
        self._feeding: list[tuple[_Live, int, int]] = []  # this step's prefill chunks (request, start, tokens)
        self._passes: dict[int, int] = {}  # the last step's passes of each cut chain (`_cut_chains`)
        gated = self.policy.gated and s.drafting_gate
        self.payoff = PayoffCheck(arms_of(s.kinds, s.payoff_kind_arms)) if gated and s.payoff_check else None
        self._arm: int | None = None  # this step's measured arm of the payoff check (None: not measured)
        self._checked_plain = False  # the check made this step plain (measured or not)
        self._chose = False  # the kind chooser ran for this step's plan
        self._only: int | None = None  # the check made this step draft with one kind (its arm)
        self._unlearnt: tuple | None = None  # the last step's learning, and the requests that finished in it
        self.queue: deque[int] = deque(range(len(trace.requests)))
        self.running: list[_Live] = []
        self.next_rid = 0
        self.out = SimResult(s.policy, s.kinds, concurrency)

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> SimResult:
        while self.queue or self.running:
            self.step()
        return self.out

    def step(self) -> None:
        while self.queue and len(self.running) < self.c:
            q = self.queue.popleft()
            self.running.append(_Live(self.next_rid, q, seen=np.zeros(len(self.kidx), dtype=np.int64)))
            self.next_rid += 1
        batch = [r for r in self.running if r.t > 0]
        feeding = self._feed([r for r in self.running if r.t == 0])
        self._feeding = feeding  # the step's price of a draft is its share of the whole forward (`_curve`)
        lengths, kinds, fallback = self._plan(batch)
        self._settle()  # the step before, learnt while this step's forward runs (the engine's overlap)
        drafts, used = self._propose(batch, lengths, kinds, fallback)
        kept, estimate = self._prune(batch, drafts, used)
        accepted = np.minimum(drafts["accepted"], kept)
        learn = _Outcome(batch, [x.t for x in batch], self._available, drafts, used, lengths, kept, accepted,
                         estimate)
        seconds = self.out.seconds
        self._advance_time(batch, feeding, kept, drafts, used)
        decoded = sum(min(int(a) + 1, self.trace.requests[x.q].length - x.t)
                      for x, a in zip(batch, accepted, strict=True))
        self._unlearnt = (learn, self._commit(batch, feeding, accepted))
        if self._arm is not None:
            self.payoff.observe(len(batch), self._arm, decoded, self.out.seconds - seconds, self._plain_seconds(batch))
        if not self.s.overlap or not (self.queue or self.running):
            self._settle()

    def _settle(self) -> None:
        """The last step's learning, then the gate forgets the requests that finished in it."""
        if self._unlearnt is None:
            return
        learn, done = self._unlearnt
        self._unlearnt = None
        self._learn(learn)
        for rid in done:
            self.gate.forget(rid)

    def _feed(self, fresh: list[_Live]) -> list[tuple[_Live, int, int]]:
        """(request, start, tokens) prefill chunks of this step (`feed_chunks`)."""
        budget, out = self.s.prefill_budget, []
        for r in fresh:
            n = min(self.s.prefill_chunk, self.trace.requests[r.q].prompt_len - r.fed, budget)
            if n <= 0:
                break
            out.append((r, r.fed, n))
            budget -= n
        return out

    def _remaining(self, r: _Live) -> int:
        return self.trace.max_tokens - r.t

    def _curve(self, batch: list[_Live]):
        """The step's forward time by its decoding requests' verify tokens, its prefill chunks
        included (as `Engine._verify_curve`)."""
        context = sum(r.cached(self.trace.requests[r.q].prompt_len) for r in batch)
        feeding = self._feeding
        if not feeding:
            return self.costs.verify_curve(len(batch), context)
        whole = self.costs.verify_curve(len(batch) + len(feeding), context + sum(start for _, start, _ in feeding))
        return whole.beside(sum(n for _, _, n in feeding))

    def _plain_seconds(self, batch: list[_Live]) -> float:
        """What a plain step of this step's decoding requests costs by the trace's forward: the
        payoff check's scale (the engine's is its start-up profile)."""
        context = sum(r.cached(self.trace.requests[r.q].prompt_len) for r in batch)
        return self.costs.forward_seconds(StepShape(len(batch), len(batch), context))

    def _plan(self, batch: list[_Live]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(drafts [R], hosted kind [R], fallback [R]), as `Engine.plan`."""
        r = len(batch)
        self._arm, self._checked_plain, self._only, self._chose = None, False, None, False
        if not r or not self.policy.drafts:
            plain = Plan.plain(r)
            return plain.lengths, plain.kinds, plain.fallback
        only = None  # the one kind the gate may choose (the check's kind arm)
        if self.payoff is not None:  # as `Engine.step`: a step feeding prompts plays the leader, unmeasured
            played = self.payoff.arm(r, measured=not self._feeding)
            self._arm = None if self._feeding else played
            only = self._only = kind_of(played)
            if played == PLAIN:  # the payoff check's plain arm: no look-ahead, no gate
                self._checked_plain = True
                self._available = None
                plain = Plan.plain(r)
                return plain.lengths, plain.kinds, plain.fallback
        block = self.block if self.s.load_block is None or r <= self.s.load_block[0] \
            else min(self.block, self.s.load_block[1])
        cap = np.array([max(0, min(block - 1, self._remaining(x) - 1)) for x in batch], dtype=np.int64)
        held = np.array([[x.cached(self.trace.requests[x.q].prompt_len) - x.seen[j] for j in range(len(self.kidx))]
                         for x in batch], dtype=np.int64)
        remaining = np.array([self._remaining(x) for x in batch])
        costs = self.costs
        a, b = (costs if only is None else self.one_kind).own_drafting
        extra = max(0.0, a + b * r)  # what a drafting step costs outside the passes (the engine's `extra`)
        available = None
        if self.ngram is not None and r <= LOOKAHEAD_REQUESTS and only in (None, self.ngram):  # the look-ahead
            available = np.full((r, len(self.kidx)), -1, dtype=np.int64)
            available[:, self.ngram] = np.minimum(cap, [self.trace.requests[x.q].count[self.kidx[self.ngram], x.t]
                                                        for x in batch])
        self._available = available
        if self.s.hindsight:  # the gate is a HindsightGate: tell it this step's outcomes
            self.gate.accepted = np.array([[self.trace.requests[x.q].accepted[k, x.t] for k in self.kidx]
                                           for x in batch], dtype=np.int64).reshape(r, len(self.kidx))
        g = GateInput.capture([x.rid for x in batch], cap, remaining, KindReach(held, None, available, only),
                              self._curve(batch), DraftingCosts(self.draft, extra, costs.shared, self.remote))
        gated = self.policy.gated and self.s.drafting_gate
        plan = self.gate.decide(g) if gated else self.gate.choose(g)
        self._chose = plan.chosen
        return plan.lengths, plan.kinds, plan.fallback

    def _propose(self, batch, lengths, kinds, fallback) -> tuple[dict, np.ndarray]:
        """Each request's drafts at its position (its kind's, or the fallback's if that made
        none), as ragged arrays; and the hosted kind that drafted each request."""
        used = np.asarray(kinds, dtype=np.int64).copy()
        rows = []
        for i, x in enumerate(batch):
            n = int(lengths[i])
            rt = self.trace.requests[x.q]
            k = int(used[i])
            got = min(n, int(rt.count[self.kidx[k], x.t]))
            if n and not got and fallback is not None and 0 <= fallback[i] != k:
                k = int(fallback[i])
                got = min(n, int(rt.count[self.kidx[k], x.t]))
                used[i] = k
            rows.append((rt, self.kidx[k], x.t, got))
        rows = self._cut_chains(batch, rows, used)
        counts = np.array([g for *_, g in rows], dtype=np.int64)
        cu = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        conf = np.concatenate([rt.confidence[k, t, :g] for rt, k, t, g in rows] or [np.zeros(0)]).astype(np.float64)
        margin = np.concatenate([rt.margin[k, t, :g] for rt, k, t, g in rows] or [np.zeros(0)]).astype(np.float64)
        truth = np.array([min(g, int(rt.accepted[k, t])) for rt, k, t, g in rows], dtype=np.int64)
        return {"cu": cu, "confidence": conf, "margin": margin, "accepted": truth}, used

    def _cut_chains(self, batch, rows: list, used: np.ndarray) -> list:
        """Each chained kind's drafts cut as the engine's replica cuts them while its chain runs
        (`ChainCut`, from the trace's confidences); the passes each ran (`_passes`), which its
        cost is charged for."""
        self._passes = {}
        if not self.s.chain_stop:
            return rows
        for j in {j for j, name in enumerate(self.s.kinds) if name in self.s.chained}:
            mine = [i for i, (*_, got) in enumerate(rows) if used[i] == j and got > 0]
            if not mine:
                continue
            want = np.array([rows[i][3] for i in mine], dtype=np.int64)
            conf, margin = np.zeros((len(mine), want.max())), np.zeros((len(mine), want.max()))
            for row, i in enumerate(mine):
                rt, k, t, got = rows[i]
                conf[row, :got], margin[row, :got] = rt.confidence[k, t, :got], rt.margin[k, t, :got]
            rule = ChainStop.of(self.calibrators[j], self._curve(batch), len(batch), self.draft[j].per_pass)
            lengths, self._passes[j] = cut_lengths(rule, want, conf, margin)
            for row, i in enumerate(mine):
                rows[i] = (*rows[i][:3], int(lengths[row]))
        return rows

    def _prune(self, batch, drafts: dict, used: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        cu = drafts["cu"]
        if cu[-1] == 0:
            return np.zeros(len(batch), dtype=np.int64), None
        pos = ragged.positions(cu)
        p = np.zeros(len(pos))
        kind = np.repeat(used, ragged.lengths(cu))
        for k in np.unique(kind):
            m = kind == k
            p[m] = self.calibrators[k].estimate(drafts["confidence"][m], drafts["margin"][m], pos[m])
        truth = drafts["accepted"] if self.policy.needs_truth else None
        decision = self.policy.choose(DraftBatch(survival(p, cu), cu, truth), self._curve(batch))
        return decision.kept, p

    def _learn(self, o: _Outcome) -> None:
        """As `actors.engine.learning.learn`: calibration of judged drafts, the gate's trackers."""
        batch, drafts, used, lengths, kept, accepted, estimate = (o.batch, o.drafts, o.used, o.lengths, o.kept,
                                                                 o.accepted, o.estimate)
        available = o.available
        cu = drafts["cu"]
        idx, ok = verify_outcomes(cu, kept, accepted)
        if len(idx):
            pos = ragged.positions(cu)[idx]
            kind = np.repeat(used, ragged.lengths(cu))[idx]
            for k in np.unique(kind):
                m = kind == k
                self.calibrators[k].observe(drafts["confidence"][idx][m], drafts["margin"][idx][m], pos[m], ok[m])
        idx = np.flatnonzero(ragged.lengths(cu))  # the requests that drafted
        beyond = None if estimate is None else [estimate[cu[i] + kept[i]:cu[i + 1]] for i in idx.tolist()]
        verified = Verified.of([batch[i].rid for i in idx.tolist()], np.asarray(used)[idx], np.asarray(kept)[idx],
                               np.asarray(accepted)[idx], beyond)
        empty = [(x.rid, int(used[i])) for i, x in enumerate(batch) if lengths[i] > 0 and cu[i + 1] == cu[i]]
        if available is not None:
            ng = self.ngram  # the look-ahead of the requests it did not draft for, judged by what they emitted
            shadow = []
            for i, x in enumerate(batch):
                n = min(int(available[i, ng]), int(accepted[i]) + 1)
                if n > 0 and not (used[i] == ng and cu[i + 1] > cu[i]):
                    rt = self.trace.requests[x.q]
                    shadow.append((x.rid, ng, n, min(n, int(rt.accepted[self.kidx[ng], o.at[i]]))))
            if shadow:
                verified = verified.then(Verified.of(*zip(*shadow, strict=True)))
        self.gate.learn(verified, empty)

    def _advance_time(self, batch, feeding, kept, drafts, used) -> None:
        trace, costs = self.trace, self.costs
        prompt = [trace.requests[x.q].prompt_len for x in batch]
        counts = ragged.lengths(drafts["cu"])
        context = sum(x.cached(p) for x, p in zip(batch, prompt, strict=True))
        shape = StepShape(len(batch) + len(feeding), len(batch) + int(kept.sum()) + sum(n for *_, n in feeding),
                          context + sum(start for _, start, _ in feeding))
        forward = costs.forward_seconds(shape) if shape.tokens else 0.0
        draft = 0.0
        if counts[self.remote[used]].sum():  # a call to the drafter replicas
            draft = costs.shared
            for j in np.unique(used[counts > 0]):
                mine = np.nonzero((used == j) & (counts > 0))[0]
                caught = sum(batch[i].cached(prompt[i]) - batch[i].seen[j] for i in mine)
                passes = self._passes.get(int(j), int(counts[mine].max()))  # a cut chain ran its passes
                draft += float(self.draft[j].seconds(len(mine), int(counts[mine].sum()), caught, passes))
                for i in mine:
                    batch[i].seen[j] = batch[i].cached(prompt[i])
        if self.direct:  # context past the backlog limit is sent anyway, and the one kind catches up
            for x, p in zip(batch, prompt, strict=True):
                if x.cached(p) - x.seen[0] > self.s.backlog_tokens:
                    draft += self.draft[0].per_context * (x.cached(p) - x.seen[0])
                    x.seen[0] = x.cached(p)
        o = self.out
        o.steps += 1
        o.forward_seconds += forward
        o.draft_seconds += draft
        checks = self.policy.drafts and not self._checked_plain  # a plain arm's step costs plain decoding's own time
        own = costs if self._only is None else self.one_kind
        o.seconds += forward + draft + own.own_seconds(len(batch) + len(feeding), checks, bool(counts.sum()))
        if self._chose:  # the kind chooser's run, where the trace prices it apart
            o.choices += 1
            o.seconds += own.choose_seconds(len(batch))
        o.drafted += int(counts.sum())
        o.kept += int(kept.sum())
        for j in used[counts > 0]:
            name = self.s.kinds[j]
            o.chosen[name] = o.chosen.get(name, 0) + 1

    def _commit(self, batch, feeding, accepted) -> list[int]:
        """Advance every request; returns the rids that finished."""
        o = self.out
        for x, a in zip(batch, accepted, strict=True):
            made = min(int(a) + 1, self.trace.requests[x.q].length - x.t)
            x.t += made
            o.tokens += made
            o.accepted += made - 1
            o.decode_steps += 1
        for x, _, n in feeding:
            x.fed += n
            if x.fed == self.trace.requests[x.q].prompt_len:
                x.t = 1  # prefill's token
                o.tokens += 1
        done = [x.rid for x in self.running if x.t >= self.trace.requests[x.q].length]
        self.running = [x for x in self.running if x.t < self.trace.requests[x.q].length]
        return done


@dataclass
class HindsightGate(DraftingGate):
    """The engine's gate told, before each decision, how many drafts each kind would have had
    accepted for each request (`accepted` [R, kinds], set by the simulated run): its predictions
    are survival 1 up to that and 0 after, as far as the kind may draft (`GateInput.room`). The
    chooser, planner, exploration and costs are the engine's; so the gap between this and the
    real gate is what prediction costs, and what is left to the hindsight oracle is the
    decisions' own accounting."""

    accepted: np.ndarray | None = None

    def decide(self, g: GateInput) -> Plan:
        """Always the array path, where `predict` is asked (the plain-Python path for a few
        requests predicts as the trackers do)."""
        return self._decide_whole(g)

    def predict(self, g: GateInput) -> Predicted:
        room = g.room()
        width = int(room.max(initial=0))
        upto = np.minimum(room, self.accepted)
        rates = (np.arange(width)[None, None, :] < upto[:, :, None]).astype(np.float64)
        return Predicted(rates, room)


def simulate_trace(trace: Trace, settings: SimSettings, concurrency: int,
                   prior: LearnedState | None = None) -> SimResult:
    """One closed-loop run of the engine's decisions over every request of the trace, its
    estimators starting from `prior` (a bundle's, as a fresh engine does) or from nothing."""
    run = _Run(trace, settings, concurrency)
    if prior is not None:
        prior.restore(settings.kinds, run.calibrators, run.gate.trackers, run.gate.exploration)
    return run.run()


def oracle_step(gains: np.ndarray, kinds: np.ndarray, verify_per_token: float, base_seconds: float,
                draft: list[DraftCost], backlog: np.ndarray, shared: float) -> np.ndarray:
    """Which requests draft in a hindsight-perfect step: request i, if it drafts, drafts exactly
    the gains[i] drafts that kind kinds[i] would have accepted, so it gains gains[i] tokens for
    verify_per_token · gains[i] more forward and its kind's drafting (per request, per position,
    catching up on backlog[i]); a kind's pass costs its `fixed` once, any drafting `shared` once.
    Returns the mask [R] that maximises (R + Σ gains) / seconds. For each set of kinds in use
    the best requests form a prefix of the gain-to-cost order (a ratio of sums is maximised by
    every item above the optimum ratio), so the scan is exact for a linear verify cost. A chained
    kind's passes (`per_pass`) run once for the longest of its requests: the scan charges each
    request what it adds to that longest chain (then a heuristic, no longer exact)."""
    r = len(gains)
    best_rate, best = r / base_seconds if r else 0.0, np.zeros(r, dtype=bool)
    cost = np.array([verify_per_token * g + draft[k].per_request + draft[k].per_position * g
                     + draft[k].per_context * b for g, k, b in zip(gains, kinds, backlog, strict=True)])
    cand = np.nonzero(gains > 0)[0]
    used_kinds = sorted({int(kinds[i]) for i in cand})
    for subset in range(1, 2 ** len(used_kinds)):
        inside = {k for j, k in enumerate(used_kinds) if subset >> j & 1}
        mine = [i for i in cand if int(kinds[i]) in inside]
        order = sorted(mine, key=lambda i: -gains[i] / cost[i] if cost[i] > 0 else -np.inf)
        seconds = base_seconds + shared + sum(draft[k].fixed for k in inside)
        tokens, longest = float(r), dict.fromkeys(inside, 0)
        for n, i in enumerate(order):
            k = int(kinds[i])
            tokens += gains[i]
            seconds += cost[i] + draft[k].per_pass * max(0, int(gains[i]) - longest[k])
            longest[k] = max(longest[k], int(gains[i]))
            if tokens / seconds > best_rate * (1 + 1e-12):
                best_rate, best = tokens / seconds, np.zeros(r, dtype=bool)
                best[order[:n + 1]] = True
    return best


class _OracleRun(_Run):
    """Knows each request's acceptance at its position under every hosted kind: drafts with the
    kind that would have had the most accepted (the cheaper on ties), exactly that many, for the
    requests `oracle_step` picks; keeps every draft."""

    def _plan(self, batch):
        r = len(batch)
        zeros = np.zeros(r, dtype=np.int64)
        if not r:
            return zeros, zeros, None
        gains, kinds, backlog = np.zeros(r, dtype=np.int64), zeros.copy(), np.zeros(r)
        for i, x in enumerate(batch):
            rt = self.trace.requests[x.q]
            cap = max(0, min(self.block - 1, self._remaining(x) - 1))
            per_kind = [min(cap, int(rt.accepted[k, x.t])) for k in self.kidx]
            # most accepted, then the cheapest to draft that many
            j = max(range(len(per_kind)), key=lambda j: (per_kind[j], -self.draft[j].per_position))
            gains[i], kinds[i] = per_kind[j], j
            backlog[i] = x.cached(rt.prompt_len) - x.seen[j]
        curve = self._curve(batch)
        base = float(curve.seconds(np.array([r]))[0])
        span = max(1, int(gains.sum()))  # the verify curve's slope over the tokens the oracle may add
        per_token = (float(curve.seconds(np.array([r + span]))[0]) - base) / span
        costs = self.costs
        plain = costs.own_seconds(r, True, False)
        mask = oracle_step(gains, kinds, per_token, base + plain, self.draft, backlog,
                           costs.shared + costs.own_seconds(r, True, True) - plain)
        return np.where(mask, gains, 0), kinds, None

    def _prune(self, batch, drafts, used):
        return ragged.lengths(drafts["cu"]), None

    def _learn(self, *args) -> None:
        pass


def oracle_run(trace: Trace, kinds: tuple[str, ...], concurrency: int, block: int | None = None) -> SimResult:
    """The hindsight bound over the trace at concurrency C with these kinds hosted (its chains
    drafted as far as it plans: it knows what passes)."""
    return _OracleRun(trace, SimSettings(policy="oracle", kinds=kinds, block=block, chain_stop=False),
                      concurrency).run()


def prior_from_trace(trace: Trace, concurrency: int = 4, runs: int = 2) -> LearnedState:
    """What an engine hosting every kind of the trace has learnt about acceptance after serving
    the trace's requests `runs` times at `concurrency` (calibration and the trackers' rates per
    kind): a bundle's prior. Costs are left out — they belong to a machine, and the engine
    profiles its own at start-up."""
    run = _Run(trace, SimSettings(kinds=trace.kinds), concurrency)
    for _ in range(runs - 1):  # the same requests again, behind the first pass (new request ids)
        run.queue.extend(range(len(trace.requests)))
    run.run()
    kinds = {name: KindState.of(cal, tracker) for name, cal, tracker in
             zip(trace.kinds, run.calibrators, run.gate.trackers, strict=True)}
    return LearnedState(kinds, explored=run.gate.exploration.steps)


def shuffled(trace: Trace, n: int) -> list[Trace]:
    """The trace, then n − 1 shuffles of its requests (fixed seeds). A closed loop over one draw
    of prompts in one order is chaotic (a cell moves ±3 % with the order alone), so a setting is
    judged over several orders. (The n-gram kind's rows keep the corpus of the recorded order,
    at every lag: a shuffle moves which outputs a request could have drafted from.)"""
    out = [trace]
    for o in range(1, n):
        reqs = list(trace.requests)
        np.random.default_rng(o).shuffle(reqs)
        out.append(replace(trace, requests=tuple(reqs)))
    return out


@dataclass(frozen=True)
class HostedChoice:
    """Which kinds `--drafter tuned` hosts, and why: every candidate set's score."""

    kinds: tuple[str, ...]
    scores: dict[tuple[str, ...], float]  # each set's tok/s over `ar`'s, geometric mean over the cells


def choose_hosted(traces: list[Trace], prior: LearnedState | None = None, levels: tuple[int, ...] = (1, 4, 16, 64),
                  orders: int = 2) -> HostedChoice:
    """The kinds a unit hosts for per-request choice (`--drafter tuned`): of every set of two or more of the
    traces' kinds, the one whose choice replays fastest — its tok/s over plain decoding's in each
    cell (trace, request order, concurrency), geometric mean; ties go to the smaller set, then
    the traces' order. A kind that only ever takes requests from better ones costs a unit its
    memory, its replicas' calls and the chooser's mistakes; the training traces say whether it
    earns them. Every set pays the own time of an engine of several kinds (the trace's), so a
    smaller set is not credited cheaper steps. One kind traced: that kind."""
    kinds = traces[0].kinds
    if any(t.kinds != kinds for t in traces):
        raise ValueError("the traces hold different kinds: " + "; ".join(",".join(t.kinds) for t in traces))
    sets = [c for n in range(2, len(kinds) + 1) for c in combinations(kinds, n)] or [kinds]
    logs = {s: 0.0 for s in sets}
    cells = 0
    for trace in traces:
        for tr in shuffled(trace, orders):
            for c in levels:
                ar = simulate_trace(tr, SimSettings(policy="ar", kinds=kinds[:1]), c, prior).tok_s
                for s in sets:
                    logs[s] += math.log(simulate_trace(tr, SimSettings(kinds=s), c, prior).tok_s / ar)
                cells += 1
    scores = {s: math.exp(v / cells) for s, v in logs.items()}
    best = sets[0]
    for s in sets[1:]:
        if scores[s] > scores[best] * (1 + 1e-9):
            best = s
    return HostedChoice(best, scores)
