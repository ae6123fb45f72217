"""How the engine's step is put together, on a real local Ray: prefill rides in the step's one
forward, the drafters' context travels lazily, plain decoding keeps no drafter state, and the
drafting gate starts from a measured drafter profile."""

from __future__ import annotations

import numpy as np
import pytest

from actors.engine.backlog import Backlog, ContextLedger
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.engine.stages import Feed
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from dcut_core.cost_model import CostModel, OnlineCorrection, preset
from dcut_core.learners import PRIOR_DRAFT_COST
from tests.actors.conftest import holding_drafts

MAX_TOKENS = 10
UNPROFILED = PRIOR_DRAFT_COST  # the engine's prior before the start-up profile
RNG = np.random.default_rng(11)
PROMPTS = [(RNG.integers(1, 96, 4).tolist() * 16)[: 5 + 7 * i] for i in range(8)]  # 5 .. 54 tokens


pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    return greedy_decode(LocalTarget(load_model(f"{tiny_bundle}/target")), list(range(len(PROMPTS))), PROMPTS,
                         MAX_TOKENS)


def engine(bundle: str, tmp_path, **kw) -> Engine:
    cfg = dict(target_dir=f"{bundle}/target", drafter_dir=f"{bundle}/drafter", block=6, policy="fixed-4",
               cost_model_cache=str(tmp_path), max_running=8, cpus_per_drafter=0.5)
    return Engine(EngineConfig(**(cfg | kw)))


def count_forwards(eng: Engine) -> list[int]:
    calls = [0]
    inner = eng.target.run  # the engine's one forward a step (a `VerifyBatch`)

    def run(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    eng.target.run = run
    return calls


def test_prefill_rides_in_the_decode_step_and_long_prompts_span_steps(tiny_bundle, reference, tmp_path):
    eng = engine(tiny_bundle, tmp_path, prefill_chunk=8, prefill_budget=12)
    try:
        calls = count_forwards(eng)
        params = SamplingParams(max_tokens=MAX_TOKENS)
        first = eng.add(PROMPTS[0], params)  # 5 tokens: fed and first token drawn in one step
        rec = eng.step()
        assert rec.prefill_tokens == 5 and rec.requests == 0 and calls[0] == 1
        late = eng.add(PROMPTS[7], params)  # 54 tokens: at most 8 a step (the chunk), 12 in all
        steps_fed = 0
        while not eng.scheduler.get(late).prefilled:
            calls[0] = 0
            rec = eng.step()
            steps_fed += 1
            assert calls[0] == 1  # one forward: decode and prefill together
            assert rec.prefill_tokens == min(8, 54 - 8 * (steps_fed - 1))
            assert rec.requests == (1 if eng.scheduler.get(first).finish_reason is None else 0)
        assert steps_fed == 7  # ceil(54 / 8)
        while eng.pending:
            eng.step()
        assert eng.scheduler.finished[first].output == reference[0]
        assert eng.scheduler.finished[late].output == reference[7]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_ngram_kind_indexes_a_long_prompt_as_its_chunks_are_fed(tiny_bundle, reference, tmp_path, overlap):
    """With a learner thread (`overlap`) a prompt fed over several steps is in the n-gram kind's
    index chunk by chunk, each by the end of the step whose forward feeds it, so its first
    decode step has nothing of it left to index; without one, the first decode step indexes it
    (a request that never drafts n-gram costs nothing). Outputs stay greedy either way."""
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="dcut", prefill_chunk=8, prefill_budget=12,
                 overlap=overlap)
    try:
        rid = eng.add(PROMPTS[7], SamplingParams(max_tokens=MAX_TOKENS))  # 54 tokens: 7 chunks
        indexed = []
        while not eng.scheduler.get(rid).prefilled:
            eng.step()
            history = eng.lookahead.drafter._history.get(rid)
            indexed.append(len(history.tokens) if history is not None else 0)
        fed = [min(8 * (i + 1), 54) for i in range(7)]
        assert indexed == (fed if overlap else [0] * 7)
        eng.step()  # its first decode step: the look-ahead follows it
        assert len(eng.lookahead.drafter._history[rid].tokens) == 55
        while eng.pending:
            eng.step()
        assert eng.scheduler.finished[rid].output == reference[7]
    finally:
        eng.shutdown()


def test_a_steps_drafts_are_priced_beside_its_prefill_chunks():
    # The gate's and pruning's curve of a step that also feeds prompt chunks is the whole
    # forward's (its requests and fed tokens included); under a concave cost a draft adds less
    # there than to a decode-only step (replay at 16 / 64 requests: +2.8 / +3.0 %, session 37).
    shape = preset("moe-35b-a3b", "cpu").model
    cost = OnlineCorrection(CostModel(shape, 1, {"fixed": 4e-3, "dense": 5e-5, "kv_read": 1e-6, "batching": 1e-3}))
    owner = type("Owner", (), {"cost": cost})()
    feeding = [Feed(None, 0, [1] * 50), Feed(None, 30, [1] * 20)]  # a fresh prompt, and one's second chunk
    decode_only = Engine._verify_curve(owner, 16, 1600, [])
    mixed = Engine._verify_curve(owner, 16, 1600, feeding)
    n = np.arange(16, 48)
    np.testing.assert_allclose(decode_only.seconds(n), cost.verify_curve(16, 1600).seconds(n))
    np.testing.assert_allclose(mixed.seconds(n), cost.verify_curve(18, 1630).seconds(n + 70))
    assert np.diff(mixed.seconds(n)).max() < np.diff(decode_only.seconds(n)).min()


def test_lazy_drafter_context_drafts_what_eager_context_drafts(tiny_bundle, reference, tmp_path):
    """The gate runs plain decoding for a few steps, then drafts: the drafter catches up on the
    context it missed and drafts exactly what a drafter fed every step drafts."""
    runs = {}
    for limit in (0, 512):  # 0: every commit sent at once (eager); 512: held until a draft needs it
        eng = engine(tiny_bundle, tmp_path, drafter_backlog_tokens=limit)
        try:
            eng.plan = holding_drafts(eng, 4)
            rids = [eng.add(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS]
            for _ in range(4):
                eng.step()
            held = eng.drafters.ledger.tokens()
            while eng.pending:
                eng.step()
            out = [eng.claim(r) for r in rids]
            assert [s.output for s in out] == reference
            runs[limit] = (held, [s.accepted for s in out], [s.drafted for s in out])
        finally:
            eng.shutdown()
    assert runs[0][0] == 0 and runs[512][0] >= sum(map(len, PROMPTS))  # prompts and 3 steps, held back
    assert runs[512][2] == runs[0][2]
    assert runs[512][1] == runs[0][1]  # the same drafts were accepted
    assert sum(map(sum, runs[512][1])) > 0


def test_plain_decoding_keeps_no_drafter_state(tiny_bundle, reference, tmp_path):
    eng = engine(tiny_bundle, tmp_path, policy="dcut")
    try:
        eng.set_policy("ar")
        calls = []
        run = eng.target.run
        eng.target.run = lambda batch: calls.append(batch.capture_layers) or run(batch)
        out = eng.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS))
        assert [s.output for s in out] == reference
        assert calls and all(c == () for c in calls)  # no hidden states captured
        assert eng.drafters.ledger.tokens() == 0
    finally:
        eng.shutdown()


def test_the_drafting_gate_starts_from_a_measured_drafter_profile(tiny_bundle, reference, tmp_path):
    eng = engine(tiny_bundle, tmp_path, policy="dcut")
    try:
        cost = eng.draft_cost.costs[0]
        assert cost != UNPROFILED and cost.fixed + cost.per_request > 0
        assert len(eng.draft_cost.fits[0]._y) >= 8  # every profiled shape was timed, with and without catch-up
        out = eng.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS))
        assert [s.output for s in out] == reference
    finally:
        eng.shutdown()


def test_backlog_holds_tokens_rows_and_feature_spans_and_sends_past_its_limit():
    b = Backlog(limit=4)
    assert not b.add(7, [1, 2], 10)  # prompt of 10 fed, two tokens committed
    assert b.add(7, [3, 4, 5], 12)  # 5 tokens > 4: send now
    assert b.size(7) == 5 and b.tokens() == 5
    c = b.take([7, 8])
    assert c.rids == [7] and c.tokens == [[1, 2, 3, 4, 5]] and c.spans == {7: (0, 12)} and c.size == 5
    assert b.take([7]) is None and b.tokens() == 0
    b.add(7, [6], 14)
    assert b.take([7]).spans == {7: (12, 14)}  # the next span starts where the last one ended
    b.drop([7])
    b.add(7, [9], 3)  # dropped (e.g. refed after a rebuilt EP group): from position 0 again
    assert b.take([7]).spans == {7: (0, 3)}
    # A step in which the request drafted brings its rows along; later steps leave theirs on the ranks.
    b.take([7])
    h = np.arange(6, dtype=np.float32).reshape(3, 2)
    b.add(7, [1, 2, 3], 6, {4: h})  # positions 3, 4, 5: rows sent along
    b.add(7, [4], 7)  # position 6: on its rank
    c = b.take([7])
    assert c.features[0][4].dtype == np.float16 and c.features[0][4].tolist() == h.tolist()
    assert c.spans == {7: (6, 7)}  # after the rows sent along
    b.add(7, [5], 8)
    with pytest.raises(RuntimeError):  # rows sent along are always older than rows on the ranks
        b.add(7, [6], 9, {4: h[:1]})
    tokens_only = Backlog(features=False)  # an n-gram drafter needs no features
    tokens_only.add(1, [4], 5)
    assert tokens_only.take([1]).spans == {}


def test_the_ledger_answers_what_each_kind_lacks():
    """One hosted kind lacks its backlog; of several, each lacks the context since it last
    drafted; a kind the replicas do not draft (n-gram) lacks nothing; dropped requests start over."""
    one = ContextLedger(np.array([False, True]), limit=100, features=False)  # n-gram, MTP
    one.queue(3, [1, 2, 3], 10)
    assert one.lag([3, 4], [10, 6]).tolist() == [[0, 3], [0, 0]]
    one.take([3])
    assert one.lag([3], [10]).tolist() == [[0, 0]]
    several = ContextLedger(np.array([False, True, True]), limit=100)  # n-gram, MTP, block
    assert several.lag([5], [12]).tolist() == [[0, 12, 12]]  # nothing drafted yet: the whole context
    several.drafted([5], [2], [12])
    assert several.lag([5], [15]).tolist() == [[0, 15, 3]]
    assert len(several) == 1
    several.drop([5])
    assert several.lag([5], [15]).tolist() == [[0, 15, 15]] and len(several) == 0


def test_step_overhead_charges_what_drafting_adds_outside_the_passes():
    from dcut_core.learners import StepOverhead

    o = StepOverhead(halflife_steps=10)
    assert o.extra == 0.0
    for _ in range(5):
        o.observe(False, 0.001)
    assert o.extra == 0.0  # no drafting step seen yet
    for _ in range(5):
        o.observe(True, 0.004)
    assert abs(o.extra - 0.003) < 1e-12
    for _ in range(200):
        o.observe(True, 0.0005)  # drafting became cheaper than plain steps' bookkeeping: never negative
    assert o.extra == 0.0


def test_drafts_of_one_part_for_the_whole_batch_merge_as_scattered_parts_do():
    """`merge_drafts` passes one part that covers the batch through as it is: the same drafts,
    kinds and offsets as the general scatter of the same drafts split in two parts."""
    from actors.drafter.base import DraftOutput
    from actors.engine.stages import merge_drafts

    counts = [3, 0, 2, 1]
    cu = np.concatenate([[0], np.cumsum(counts)])
    tokens, conf = np.arange(6) + 10, np.linspace(0.9, 0.4, 6)
    whole = DraftOutput(tokens, cu, conf, 1 - conf, compute_s=0.5, kinds=np.array([2, 2, 1, 2]))
    one = merge_drafts(4, [([0, 1, 2, 3], whole)], np.zeros(4, dtype=np.int64), 0.7)

    def part(idx):
        lo, hi = cu[idx[0]], cu[idx[-1] + 1]
        return idx, DraftOutput(tokens[lo:hi], cu[idx[0]:idx[-1] + 2] - lo, conf[lo:hi], 1 - conf[lo:hi],
                                compute_s=0.5, kinds=whole.kinds[idx])
    two = merge_drafts(4, [part([0, 1]), part([2, 3])], np.zeros(4, dtype=np.int64), 0.7)
    for a, b in ((one.tokens, two.tokens), (one.cu, two.cu), (one.confidence, two.confidence),
                 (one.margin, two.margin), (one.kinds, two.kinds)):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    assert one.kinds.tolist() == [2, 2, 1, 2] and one.cu.tolist() == [0, 3, 3, 5, 6]


@pytest.mark.parametrize("only", ["mtp", "ngram"])
def test_a_payoff_arm_of_one_kind_drafts_with_that_kind_alone_and_outputs_stay_greedy(tiny_bundle, reference,
                                                                                      tmp_path, only):
    """An engine of several kinds measures, beside plain decoding and the gate over every kind, the
    gate over each kind alone (dcut_core/payoff.py). A step on such an arm drafts with that kind
    only — no chooser, the n-gram look-ahead only for the n-gram kind — and is measured as that
    arm; outputs stay plain greedy decoding's."""
    from dcut_core.payoff import PayoffCheck, arms_of

    kinds = ("mtp", "ngram")
    eng = engine(tiny_bundle, tmp_path, drafter=",".join(kinds), drafter_dir=None, policy="dcut",
                 drafter_dirs=(("mtp", f"{tiny_bundle}/mtp"),))
    try:
        assert eng.payoff.arms == arms_of(kinds) == ("plain", "drafting", "kind:mtp", "kind:ngram")
        want = eng.payoff.arms.index(f"kind:{only}")
        eng.payoff = check = PayoffCheck(eng.payoff.arms, least_requests=1, plain_requests=1)
        check.arm = lambda r, measured=True: want  # every step on the one kind's arm
        plans, looks, plan = [], [], eng.plan
        eng.plan = lambda st: plans.append(plan(st)) or (looks.append(st.lookahead), plans[-1])[1]
        seqs = eng.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS) for _ in PROMPTS])
    finally:
        eng.shutdown()
    assert [s.output for s in seqs] == reference
    drafting = [p for p in plans if p.drafting]
    assert drafting and all((p.kinds == kinds.index(only)).all() for p in drafting)  # speculation happened, one kind
    assert all(p.seen.only == kinds.index(only) for p in plans if p.seen is not None)
    assert (only == "ngram") == any(look is not None for look in looks)
    measured = {b: [len(o) for o in band.outcomes] for b, band in check.bands.items()}
    assert measured and all(n[want] > 0 and sum(n) == n[want] for n in measured.values())
    drafted = {k: v["drafted"] for k, v in eng.drafted_by_kind.items()}
    assert drafted[only] > 0 and all(v == 0 for k, v in drafted.items() if k != only)
