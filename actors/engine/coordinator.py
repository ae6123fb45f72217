"""The batch coordinator's logic (`Engine`): continuous batching, drafting, global D-Cut pruning,
lossless verification. `actors/engine/actor.py` wraps it as the `BatchCoordinator` Ray actor.

One decode step is the list in DESIGN.md, one method per stage:
schedule → look → plan → propose → prune → verify → accept → commit, handing a `Step` along
(`look`: the n-gram kind's drafts for every request, made here before the gate decides).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from actors import heap
from actors.drafter.kinds import kind as drafter_kind
from actors.engine.config import EngineConfig
from actors.engine.constraints import grammar_allowed
from actors.engine.costs import online, startup_cost_model, startup_draft_cost
from actors.engine.drafters import DrafterPool, hosted_drafter
from actors.engine.errors import EngineError, ErrorKind
from actors.engine.grammar import Grammars
from actors.engine.history import StepHistory
from actors.engine.kinds import count_kinds, learn_kind_costs
from actors.engine.learning import learn, plain, predicted_s, record
from actors.engine.lookahead import LOCAL_KIND, Lookahead, NgramLookahead
from actors.engine.placement import unit_placement_group
from actors.engine.sequence import SamplingParams, Scheduler, Sequence
from actors.engine.stages import (
    Accepted,
    Drafts,
    Feed,
    Pruned,
    Step,
    StepRecord,
    accept_tokens,
    empty_drafts,
    feed_chunks,
    merge_drafts,
)
from actors.engine.steplog import StepLog
from actors.engine.verification import oracle_lengths, verify_forward
from actors.engine.warm import SAVE_EVERY, WarmStart, snapshot, warm
from actors.ray_env import whereabouts
from actors.target.config import MoEConfig
from actors.target.driver import DriverGroup
from actors.target.group import EPGroup, EPGroupError, InProcessGroup
from dcut_core import ragged
from dcut_core.acceptance import Calibrator, survival
from dcut_core.chains import ChainStop
from dcut_core.cost_model import StepShape
from dcut_core.drafting import AcceptanceTracker, Exploration
from dcut_core.gate import LOOKAHEAD_REQUESTS, DraftingCosts, DraftingGate, GateInput, KindReach, Plan
from dcut_core.learners import DraftCostLearner, StepOverhead
from dcut_core.payoff import PLAIN, PayoffCheck, arms_of, kind_of
from dcut_core.pruning import DraftBatch, StepCost, policy_from_name

log = logging.getLogger(__name__)

FLAT_CURVE = StepCost(lambda n: np.ones(len(n)), 0.0)  # a policy without a cost model: every budget costs 1


class Engine:
    """The coordinator's logic, usable in-process (tests) or inside the `BatchCoordinator` actor."""

    checks_profile = True  # a cached start-up profile is checked against forwards timed at start

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.policy = policy_from_name(cfg.policy, cfg.block, **cfg.dcut_options(cfg.policy))
        self.unit_pg = unit_placement_group() if cfg.unit_placement else None
        self.target = self._new_target()
        self.drafters = DrafterPool(cfg, self.target, self.unit_pg)
        self.rebuilt = 0  # EP groups rebuilt after a failure
        self.rebuilding_since: float | None = None  # monotonic time the rebuild under way began
        self.eos = cfg.eos_token_id
        self.text_of = cfg.detokenizer()
        self.scheduler = Scheduler(cfg.max_running, self.text_of, self.eos)
        self.kinds = cfg.kinds  # the drafter kinds every replica hosts; each request drafts with one a step
        self.calibrators = [Calibrator(block=cfg.block) for _ in self.kinds]  # per kind: confidences differ
        # With one kind, a request it drafts nothing for (an n-gram drafter without a match) just
        # decodes plainly; with several, that try must teach the trackers, or the chooser picks
        # the same empty kind again and again.
        self.gate = DraftingGate([AcceptanceTracker(block=cfg.block) for _ in self.kinds],
                                 Exploration(cfg.explore_every, cfg.explore_requests, cfg.explore_warmup),
                                 cfg.planner(), teach_empty=len(self.kinds) > 1)
        local = self.kinds.index(LOCAL_KIND) if cfg.drafts and LOCAL_KIND in self.kinds else None
        self.lookahead = NgramLookahead(local, cfg.block, cfg.ngram_corpus_tokens) if local is not None else None
        self.remote = np.array([k != LOCAL_KIND for k in self.kinds])  # the kinds drafted on the replicas
        self.chained = [i for i, k in enumerate(self.kinds) if cfg.chain_stop and drafter_kind(k).chained]
        self.draft_cost = self._new_cost_learner()
        self.drafted_by_kind = {k: dict.fromkeys(("chosen", "drafted", "kept", "accepted"), 0) for k in self.kinds}
        self.overhead = StepOverhead()
        self.payoff = PayoffCheck(self._payoff_arms()) if cfg.drafting_gate and cfg.payoff_check else None
        self.model_cfg = MoEConfig.load(cfg.target_dir)
        self.warm_start = WarmStart(cfg)
        learned, self.started_from = self.warm_start.load()
        # Drafting costs that were learnt while serving beat a start-up profile: skip it then.
        self._profiled_drafter = learned is not None and all(
            k in learned.kinds and learned.kinds[k].draft is not None for k in self.kinds)
        self._profile_drafter()
        self.cost = None
        self._start_cost_model()
        if learned is not None:
            warm(self, learned)
        self.history = StepHistory()
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None
        self._next_rid = 0
        self._grammars: Grammars | None = None
        # The last committed step whose outcome the estimators have not learnt yet (`settle`), and
        # the requests that finished in it (forgotten by the gate once it is learnt). With
        # `overlap`, a step is learnt on `_learner`'s thread while the next step's forward runs.
        self._unlearnt: tuple[Step, list[int]] | None = None
        self._learner = ThreadPoolExecutor(1, thread_name_prefix="dcut-learn") if cfg.learns_behind else None
        self.gc_pauses = heap.Pauses().install()  # the collector's pauses in this process, for /metrics
        self._freeze_heap()

    def set_policy(self, name: str) -> None:
        """Switch the pruning policy between runs (same engine, same drafter; benchmarks)."""
        if len(self.scheduler):
            raise RuntimeError("switch policies only while no request is in flight")
        policy = policy_from_name(name, self.cfg.block, **self.cfg.dcut_options(name))
        if policy.drafts and not self.can_draft:
            raise ValueError("this engine was built without drafters (policy ar)")
        self.policy = policy
        if self.payoff is not None:  # another policy's drafting arm: measured anew
            self.payoff = PayoffCheck(self._payoff_arms())
        self._profile_drafter()
        self._start_cost_model()

    def _payoff_arms(self) -> tuple[str, ...]:
        return arms_of(self.kinds, self.cfg.payoff_kind_arms)

    @property
    def degraded(self) -> dict[str, int]:
        """Failures survived, by kind (logged as they happen; metrics)."""
        return self.drafters.lost | {"ep_group_rebuilt": self.rebuilt}

    @property
    def replicas(self) -> list:
        return self.drafters.replicas

    @property
    def can_draft(self) -> bool:
        """Some kind can draft: a replica hosts one, or the coordinator drafts n-gram itself."""
        return bool(self.drafters) or self.lookahead is not None

    # -- requests ---------------------------------------------------------------------------------

    def new_rid(self) -> int:
        self._next_rid += 1
        return self._next_rid - 1

    def add(self, prompt: list[int], params: SamplingParams, resume: list[int] | None = None) -> int:
        """Check and queue a request; returns its rid. `resume` is output it already has (a
        request moved from a failed engine): generation continues after it, and max_tokens
        counts it."""
        why = self.invalid(prompt, params, resume or ())
        if why is not None:
            raise ValueError(why)
        rid = self.new_rid()
        self.submit(rid, prompt, params, resume or ())
        return rid

    def submit(self, rid: int, prompt: list[int], params: SamplingParams, resume: list[int] = ()) -> None:
        """Queue a request already checked (`invalid`) under a rid from `new_rid` (a driver that
        names its streams before the request enters, between steps)."""
        self.scheduler.add(Sequence(rid, list(prompt), params, output=list(resume)))

    def invalid(self, prompt: list[int], params: SamplingParams, resume: list[int] = ()) -> str | None:
        """Why this engine cannot serve the request (None: it can): the one check of a request's
        content, for `add` and for the served path (`AsyncEngine`), whatever validated it before."""
        if not prompt:
            return "the prompt must not be empty"
        vocab = self.model_cfg.vocab_size
        ids = np.asarray([*prompt, *resume])
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
            return f"token ids must be integers in [0, {vocab})"
        unknown = set(params.drafters or ()) - set(self.kinds)
        if unknown:
            return (f"drafter {', '.join(sorted(unknown))} is not served here; this engine drafts with "
                    f"{', '.join(self.kinds)}")
        if params.constraint is not None:
            try:
                why = self.grammars().check(*params.constraint)
            except (ValueError, OSError) as exc:  # no tokenizer or EOS to constrain with
                why = str(exc)
            if why is not None:
                return f"structured output: {why}"
        return None

    def abort(self, rid: int) -> None:
        """Drop a request (client gone): it leaves the batch and its KV and drafter state are freed
        now, between steps."""
        running = any(s.rid == rid for s in self.scheduler.running)
        seq = self.scheduler.abort(rid)
        if running:
            self._release([seq])

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        rids = [self.add(p, s) for p, s in zip(prompts, params, strict=True)]
        while self.pending:
            self.step()
        return [self.claim(r) for r in rids]

    # -- what a driver (`AsyncEngine`, the load generator) reads between steps -----------------------

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return len(self.scheduler)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def progress(self) -> list[Sequence]:
        """The running requests, then the finished ones not yet claimed: what may have new
        output for its client since the last step."""
        return [*self.scheduler.running, *self.scheduler.finished.values()]

    def claim(self, rid: int) -> Sequence | None:
        """A finished request's result, handed over once; the engine forgets it."""
        return self.scheduler.claim(rid)

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> StepRecord | None:
        try:
            batch, feeding = self.schedule()
            if not batch and not feeding:
                self.settle()
                return None
            cached = [s.cached for s in batch]
            context = sum(cached)
            curve = self._verify_curve(len(batch), context, feeding)
            drafting = bool(batch) and self.can_draft and self.policy.drafts
            arm, only = None, None  # the payoff check's arm where this step's outcome is measured (feeding no prompt)
            if drafting and self.payoff is not None and self.policy.gated:
                played = self.payoff.arm(len(batch), measured=not feeding)
                drafting, only = played != PLAIN, kind_of(played)
                arm = None if feeding else played
            remaining = np.array([s.remaining for s in batch], dtype=np.int64) if drafting else None
            caps = self._caps(batch, remaining) if drafting else None
            if caps is not None:  # every count the gate and pruning ask about, computed once
                curve = curve.tabulated(len(batch), len(batch) + int(caps.sum()))
            st = Step(batch, feeding, time.perf_counter(), self.scheduler.census, context, curve, caps, cached=cached,
                      remaining=remaining, arm=arm, only=only)
            st.lookahead = self.look(st)
            st.plan = self.plan(st)
            st.drafts = self.propose(st)
            st.pruned = self.prune(st)
            st.out = self.verify(st)
            st.accepted = self.accept(st)
            return self.commit(st)
        except EPGroupError as exc:  # nothing of this step was committed: rebuild and go on
            self.recover_target(exc)
            return None

    def recover_target(self, exc: Exception) -> None:
        """A target rank died: build a new EP group; every running request is fed again (prompt
        and committed tokens) through the ordinary prefill path, and its drafter state rebuilt
        from that — even a request that had lost it (orphaned). Outputs stay those of an
        uninterrupted run."""
        self.settle()
        running = [s.rid for s in self.scheduler.running]
        log.warning("EP group failed (%s); rebuilding it and resuming %d requests", exc, len(running))
        self.rebuilt += 1
        self.rebuilding_since = time.monotonic()
        try:  # the old group goes first: its ranks' bundles and memory are the new one's
            self.target.shutdown()
        except Exception:  # already down: nothing of it to free
            log.exception("shutting the failed target down")
        heap.collect_everything()  # a rank and its guests refer to each other
        try:
            self.target = self._new_target()
        finally:
            self.rebuilding_since = None
        self._freeze_heap()  # the new group's model and ranks
        self.drafters.rebind(self.target)
        self.drafters.reset(running)
        self.scheduler.refeed()

    def fail_running(self, exc: Exception) -> list[Sequence]:
        """A step raised something no single request explains: the running requests finish with
        a retryable `EngineError` (the caller claims each and tells its client), and the target
        and drafters are rebuilt as after an EP-group failure, since the step may have left
        their state half-changed. Waiting requests stay queued. Returns the requests that
        failed."""
        self.settle()
        failed = list(self.scheduler.running)
        log.error("step failed (%s: %s); %d running requests fail, the target is rebuilt", type(exc).__name__,
                  exc, len(failed))
        self.scheduler.fail(failed, EngineError(ErrorKind.UNAVAILABLE, f"a step failed under this request "
                                                                        f"({type(exc).__name__}); retry it"))
        for s in failed:
            self.gate.forget(s.rid)
        self.drafters.release([s.rid for s in failed])
        if self.lookahead is not None:
            self.lookahead.release([s.rid for s in failed])
        self.recover_target(exc)
        return failed

    def schedule(self) -> tuple[list[Sequence], list[Feed]]:
        """Admit waiting requests; returns the decoding set and this step's prefill chunks."""
        # Ranks fill unevenly (placement is by request count): keep a quarter of the KV in reserve.
        for s in self.scheduler.admit(int(0.75 * self.target.kv_tokens * self.cfg.ep), self.cfg.block):
            self.drafters.admit(s.rid)
            if s.params.constraint is not None and s.grammar is None:
                s.grammar = self.grammars().matcher(*s.params.constraint, committed=s.output)
        decoding, unfed = self.scheduler.decoding()
        return decoding, feed_chunks(unfed, self.cfg.prefill_chunk, self.cfg.prefill_budget) if unfed else []

    def look(self, st: Step) -> Lookahead | None:
        """The n-gram kind's drafts for every request that may use it, up to its cap (None: the
        engine does not draft n-gram, nothing to draft for, or a batch above LOOKAHEAD_REQUESTS,
        where the kind drafts on demand)."""
        if self.lookahead is None or st.caps is None or len(st.batch) > LOOKAHEAD_REQUESTS:
            return None
        if st.only is not None and st.only != self.lookahead.kind:  # the step drafts another kind alone
            return None
        caps = st.caps
        if st.census.drafters:  # a request naming its kinds may leave this one out
            caps = np.where([not s.params.drafters or LOCAL_KIND in s.params.drafters for s in st.batch], caps, 0)
        return self.lookahead.look(st.batch, caps)

    def plan(self, st: Step) -> Plan:
        """Which drafter kind drafts for each request and how far: the gate decides (`dcut`),
        or every request drafts to its cap with the kind the gate would choose. What the n-gram
        kind can draft for each request is known (its look-ahead)."""
        batch = st.batch
        if st.caps is None:
            return Plan.plain(len(batch))
        allowed = None
        if st.census.drafters and any([s.params.drafters for s in batch]):
            allowed = np.array([[k in (s.params.drafters or self.kinds) for k in self.kinds] for s in batch])
        available = st.lookahead.available(len(self.kinds)) if st.lookahead is not None else None
        costs = DraftingCosts(self.draft_cost.costs, self.overhead.extra, self.draft_cost.shared, self.remote)
        reach = KindReach(self.drafters.lag(st.rids, st.cached), allowed, available, st.only)
        g = GateInput.capture(st.rids.tolist(), st.caps, st.remaining, reach, st.verify_cost, costs)
        gated = self.policy.gated and self.cfg.drafting_gate
        return self.gate.decide(g) if gated else self.gate.choose(g)

    def propose(self, st: Step) -> Drafts:
        """Every replica drafts for its shard in parallel (each request with its planned kind, or
        the fallback if that makes none), the coordinator drafts the n-gram kind's requests
        (their look-ahead, with confidences); gathered into one ragged batch. Each kind's cost
        learns from its own time."""
        t0 = time.perf_counter()
        outs = self.drafters.draft(st.batch, st.plan, self._chain_stops(st)) if st.plan.drafting else {}
        local = self.lookahead.draft(st.batch, st.plan) if self.lookahead is not None and st.plan.drafting else None
        if not outs and local is None:
            return empty_drafts(len(st.batch), st.plan.kinds)
        parts = [*outs.values(), *((local,) if local is not None else ())]
        drafts = merge_drafts(len(st.batch), parts, st.plan.kinds, time.perf_counter() - t0)
        if outs:
            learn_kind_costs(self.draft_cost, outs, drafts)
        if local is not None:  # the n-gram kind's own time: its drafts' confidences, here
            idx, out = local
            counts = ragged.lengths(out.cu)
            self.draft_cost.observe_kind(self.lookahead.kind, len(idx), int(out.cu[-1]), out.compute_s, 0,
                                         int(counts.max(initial=0)))
        return drafts

    def _chain_stops(self, st: Step) -> dict[int, ChainStop] | None:
        """Each chained kind's cut this step (`dcut_core.chains`): its calibration, and the prices
        of a verified token and of one more pass at this batch's plain-decoding rate."""
        if not self.chained:
            return None
        costs = self.draft_cost.costs
        return {k: ChainStop.of(self.calibrators[k], st.verify_cost, len(st.batch), costs[k].per_pass)
                for k in self.chained}

    def prune(self, st: Step) -> Pruned:
        """The policy's choice of kept drafts per request, from calibrated survivals (each kind's
        confidences through its own calibration)."""
        batch, drafts = st.batch, st.drafts
        if drafts.cu[-1] == 0:
            return Pruned(np.zeros(len(batch), dtype=np.int64))
        t0 = time.perf_counter()
        pos = ragged.positions(drafts.cu)
        counts = drafts.counts
        p = np.empty(len(pos))
        for k, mine in ragged.groups(np.repeat(drafts.kinds, counts)):
            p[mine] = self.calibrators[k].estimate(drafts.confidence[mine], drafts.margin[mine], pos[mine])
        allowed = grammar_allowed(st)
        if allowed is not None:  # a draft the grammar forbids (and all after it) can never be accepted
            p = np.where(pos < np.repeat(allowed, counts), p, 0.0)
        accepted_len, probe = None, 0.0
        if self.policy.needs_truth:
            t_probe = time.perf_counter()
            accepted_len = oracle_lengths(self._verify, self.target, st)
            probe = time.perf_counter() - t_probe
        db = DraftBatch(survival(p, drafts.cu), drafts.cu, accepted_len)
        kept = self.policy.choose(db, st.verify_cost).kept
        kept = kept if allowed is None else np.minimum(kept, allowed)  # for every policy
        return Pruned(kept, p, db.survival, time.perf_counter() - t0 - probe, probe)

    def verify(self, st: Step):
        """One forward for the step (`actors/engine/verification.py`); while it runs, on the
        learner thread, the estimators learn from the step before (`settle`) and the n-gram kind
        indexes the prompt chunks this step feeds (`NgramLookahead.ingest`: they are known
        before the forward; a long prompt indexed whole at its first decode step had held up
        every request's step, ~35 ms for 32k tokens here). Without a learner thread a prompt is
        indexed where its look-ahead first needs it: indexed ahead on the stepping thread, with
        nothing to hide it behind, a run of long prompts was 7–8 % slower (docs/benchmarks.md,
        session 41). The forward stays on this thread: the learner's wake-up (0.5 ms on these
        machines) is hidden behind it, and it runs while the forward waits (a GPU's kernels, the
        other ranks, the GIL released)."""
        ingests = bool(st.feeding) and self.lookahead is not None
        if self._learner is None or (self._unlearnt is None and not ingests):
            return self._verify(st)
        learning = self._learner.submit(self._behind_forward, st)
        try:
            out = self._verify(st)
        finally:
            wait([learning])  # nothing of the next step runs beside it
        learning.result()
        return out

    def _behind_forward(self, st: Step) -> None:
        """The learner thread's work while step `st`'s forward runs."""
        self.settle(late=True)
        if st.feeding and self.lookahead is not None:
            self.lookahead.ingest(st.feeding)

    def _verify(self, st: Step):
        return verify_forward(self.target, self.drafters, self.drafters.layers if self.policy.drafts else (), st)

    def grammars(self) -> Grammars:
        """The compiler of structured-output constraints for this model's tokenizer (built at the
        first constrained request)."""
        if self._grammars is None:
            if self.cfg.tokenizer_path is None or self.eos is None:
                raise ValueError("structured output needs the model's tokenizer and EOS token")
            self._grammars = Grammars(self.cfg.tokenizer_path, self.model_cfg.vocab_size, self.eos)
        return self._grammars

    def accept(self, st: Step) -> Accepted:
        return accept_tokens(st.batch, st.drafts, st.pruned.kept, st.out)

    def commit(self, st: Step) -> StepRecord:
        """Roll back rejected KV, learn from the outcome, commit tokens (decoded, and the first
        tokens of prompts whose prefill ended), retire finished requests, record the step."""
        batch, accepted = st.batch, st.accepted.counts
        # The forward cached each request's last token and kept drafts: only a request that kept a
        # draft it did not accept has KV to drop (none in a plain step; a dict entry and a cache
        # call a request had been ~1 µs each at 1,024 requests).
        rejected = (st.pruned.kept > np.asarray(accepted, dtype=np.int64)).nonzero()[0].tolist() if batch else []
        if rejected:
            self.target.truncate({batch[i].rid: st.cached[i] + 1 + accepted[i] for i in rejected})
        fed = self.scheduler.advance_prefill(st, self.eos)
        predicted = predicted_s(st, self.cost)  # before the cost model learns from this step
        committed = self.scheduler.record_step(st, self.eos)
        if self.policy.drafts and self.drafters:  # plain decoding, or the n-gram kind alone: no replica state
            held = [s.cached for s in batch]  # its features exist up to here: on its rank, or here (drafted this step)
            features = [{k: h[: 1 + a] for k, h in f.items()} if f else {}
                        for f, a in zip(st.out.features[:len(batch)], accepted, strict=True)]
            live = [c for c in [*zip(batch, committed, held, features, strict=True), *((*f, None) for f in fed)]
                    if c[0].finish_reason is None]
            if live:
                self.drafters.commit(*map(list, zip(*live, strict=True)), self.target)
        done = self.scheduler.finish_done()
        self._release(done, forget=False)
        rec = record(st, predicted, self.history, self.overhead)
        if st.arm is not None:  # its wall time so far: the forward, the drafting and this engine's own
            plain_s = self.cost.model.predict(StepShape(len(batch), len(batch), st.context))
            self.payoff.observe(len(batch), st.arm, sum(map(len, committed)),
                                time.perf_counter() - st.started, plain_s)
        self._unlearnt = (st, [s.rid for s in done])
        # Learnt now if there is no next forward to hide it behind, or little to learn (a plain
        # step: handing it to the learner thread would cost more than learning it).
        if self._learner is None or not self.pending or plain(st):
            self.settle()
        if self.history.steps % SAVE_EVERY == 0 and self.policy.drafts:
            self.save_learned()
        return rec

    def settle(self, late: bool = False) -> None:
        """The estimators learn from the last committed step (calibration, the gate's trackers,
        the cost model's correction, a drafting-cost refit its passes made due, the per-kind
        counters), the step log records it, the gate forgets the requests that finished in it
        and the n-gram kind's corpus takes in their outputs. `late`: the next step's gate has
        decided already (the step log says so, and `dcut_core.gate.replay` learns it in that
        order)."""
        if self._unlearnt is None:
            return
        st, done = self._unlearnt
        self._unlearnt = None
        self.draft_cost.settle()  # a refit the step's passes made due
        count_kinds(self.drafted_by_kind, self.kinds, st)
        learnt = learn(st, self.calibrators, self.gate, self.cost, log=self.step_log is not None)
        if self.step_log is not None:
            self.step_log.write(self.policy.name, st, learnt, late)
        for rid in done:
            self.gate.forget(rid)
        if self.lookahead is not None:
            self.lookahead.absorb(len(st.batch))

    def save_learned(self) -> None:
        """Save what the estimators learnt, for the next engine of this deployment (`warm.py`)."""
        self.settle()
        try:
            self.warm_start.save(snapshot(self))
        except OSError as exc:  # a full or read-only disk must not stop serving
            log.warning("could not save the learned state: %s", exc)

    # -- helpers ----------------------------------------------------------------------------------

    def _start_cost_model(self) -> None:
        """The target's profiled step cost, once, for the policies that read it."""
        c = self.cfg
        if self.cost is None and self.policy.needs_cost_model:
            self.cost = online(startup_cost_model(self.target, c, check=self.checks_profile))

    def _profile_drafter(self) -> None:
        """Seed the drafting gate's cost learner from a start-up profile of the drafter replicas'
        kinds (once)."""
        if self._profiled_drafter or not self.policy.gated or not self.drafters:
            return
        self.draft_cost = startup_draft_cost(self.drafters, self.model_cfg, self.cfg.max_running, self.cfg.block,
                                             self._new_cost_learner())
        self._profiled_drafter = True

    def _new_cost_learner(self) -> DraftCostLearner:
        """One drafting-cost fit per kind; the look-ahead's kind starts from nothing (its drafts
        are made already; their confidences cost microseconds) and learns its own time."""
        return DraftCostLearner(len(self.kinds), free=() if self.lookahead is None else (self.lookahead.kind,))

    def _verify_curve(self, requests: int, context: int, feeding: list[Feed]) -> StepCost:
        """The step's forward time by its decoding requests' verify tokens (the gate's and
        pruning's price of a draft): where the step also feeds prompt chunks, the whole forward's,
        so a draft is priced at what it adds to that forward, not to a decode-only one. Under a
        concave cost (`batching`) a draft costs less beside a prefill chunk, and against the
        longer step the tokens it may win weigh as they will."""
        if self.cost is None:
            return FLAT_CURVE
        if not feeding:
            return self.cost.verify_curve(requests, context)
        whole = self.cost.verify_curve(requests + len(feeding), context + sum(f.start for f in feeding))
        return whole.beside(sum(len(f.tokens) for f in feeding))

    def _caps(self, batch: list[Sequence], remaining: np.ndarray) -> np.ndarray:
        """[R] the most drafts each request may verify this step: within the block (a shorter one
        above `load_block`'s load), one fewer than the tokens it has left (the step's own token is
        the last), none for one without a drafter."""
        block, loaded = self.cfg.block, self.cfg.load_block
        if loaded is not None and len(batch) > loaded[0]:
            block = min(block, loaded[1])
        caps = np.minimum(remaining - 1, block - 1)
        np.maximum(caps, 0, out=caps)
        if self.drafters.orphaned:
            caps[[not self.drafters.drafting(s.rid) for s in batch]] = 0
        return caps

    def _freeze_heap(self) -> None:
        """The end of start-up (or of a rebuild): this process's heap frozen (actors/heap.py)."""
        if self.cfg.freeze_heap:
            heap.freeze()

    def _new_target(self) -> EPGroup:
        """The EP group: driven from this process (`in_process`, with the drafters as the ranks'
        guests), or every rank a Ray actor called per step."""
        cfg = self.cfg.ep_config(self.unit_pg, guests=hosted_drafter(self.cfg))
        if not self.cfg.in_process:
            return EPGroup(cfg)
        return InProcessGroup(cfg) if self.cfg.ep == 1 else DriverGroup(cfg)

    def _release(self, seqs: list[Sequence], forget: bool = True) -> None:
        """Free finished or aborted requests' KV and drafter state; the gate forgets them now
        (`forget`), or once their last step is learnt (`settle`)."""
        if not seqs:
            return
        rids = [s.rid for s in seqs]
        self.target.release(rids)
        self.drafters.release(rids)
        if self.lookahead is not None:
            self.lookahead.release(rids)
        if forget:
            self.settle()  # an aborted request may be in the step not learnt yet
            for rid in rids:
                self.gate.forget(rid)

    def forget_outputs(self) -> None:
        """The n-gram kind forgets the outputs of the requests served so far (its corpus): a
        benchmark's second run of the same prompts then drafts as a first run would."""
        if self.lookahead is not None:
            self.lookahead.forget_outputs()

    def held(self) -> dict[str, int]:
        """Request state each owner keeps, the ranks' and replicas' too (all 0 when nothing is in
        flight: a leak shows here). Between steps only."""
        self.settle()
        return {"scheduler": len(self.scheduler) + len(self.scheduler.finished), **self.gate.held(),
                **self.drafters.held(), **self.target.held(),
                "lookahead": self.lookahead.held() if self.lookahead is not None else 0}

    def placement(self) -> dict:
        """Where the unit's parts run (node and placement group of each): operators and tests."""
        drafters = self.drafters.whereabouts()
        ranks = [{k: r[k] for k in ("node", "placement_group", "pid")} for r in self.target.ranks]
        return {"coordinator": whereabouts(), "ranks": ranks, "drafters": drafters}

    def shutdown(self) -> None:
        self.settle()
        if self._learner is not None:
            self._learner.shutdown(wait=True)
        if self.policy.drafts and self.history.steps:
            self.save_learned()
        if self.step_log is not None:
            self.step_log.close()
        self.target.shutdown()
        self.drafters.shutdown()
        self.gc_pauses.remove()
        if self.cfg.freeze_heap:
            heap.thaw()  # what it let go of may hold cycles: collectable again
