"""Counterfactual traces and the simulator that replays the engine's decisions over them: exact
hand-made cases, a straightforward reference loop for the static policies, and the hindsight
oracle's step against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import json

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core.cost_model import CostModel, StepShape
from dcut_core.counterfactual import KindRows, RequestTrace, Trace, TraceCosts, accepted_prefix
from dcut_core.drafting import DraftCost
from dcut_core.hardware import ModelShape
from dcut_core.trace_sim import SimSettings, oracle_run, oracle_step, simulate_trace

SHAPE = ModelShape("tiny", layers=2, hidden=8, heads=2, kv_heads=2, head_dim=4, vocab=32, intermediate=16)


DRAFT = DraftCost(0.002, 0.0, 0.0005)


def costs(fixed=0.010, per_token=0.001, kinds=1, draft=DRAFT, overhead=0.0) -> TraceCosts:
    model = CostModel(SHAPE, 1, {"fixed": fixed, "dense": per_token})  # linear in tokens, no context term
    return TraceCosts(model, 1.0, (draft,) * kinds, own=(overhead, 0.0))


def request(prompt_len: int, accepted: list[list[int]], block: int, conf: float = 0.9) -> RequestTrace:
    """accepted[k][t] for t = 1 .. T−1 (row 0 is prefill's); every kind drafts a full block."""
    k, t = len(accepted), len(accepted[0]) + 1
    acc = np.zeros((k, t), dtype=np.int64)
    acc[:, 1:] = accepted
    count = np.full((k, t), block - 1, dtype=np.int64)
    count[:, 0] = 0
    width = block - 1
    return RequestTrace(prompt_len, np.arange(t, dtype=np.int64), count, acc,
                        np.full((k, t, width), conf, np.float32), np.full((k, t, width), 0.5, np.float32),
                        np.zeros((k, t, width), np.int64))


def test_accepted_prefix():
    assert accepted_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert accepted_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert accepted_prefix(np.array([1, 2, 3]), np.array([1])) == 1
    assert accepted_prefix(np.array([7]), np.array([1])) == 0


def test_trace_packs_to_the_same_bytes_and_back():
    trace = Trace(("block", "ngram"), 4, 8, (request(5, [[1, 3, 0, 2, 1], [0, 0, 3, 1, 0]], 4),), costs(kinds=2),
                  {"model": "tiny"})
    raw = msgpack.packb(trace.as_dict())
    again = Trace.from_dict(msgpack.unpackb(raw))
    assert msgpack.packb(again.as_dict()) == raw
    assert again.requests[0].accepted.tolist() == trace.requests[0].accepted.tolist()
    assert again.costs.draft == trace.costs.draft


def lagged(r: RequestTrace, k: int, accepted: int) -> KindRows:
    """Kind k's rows of r with every position accepting at most `accepted` (as a thinner corpus would)."""
    acc = np.minimum(r.accepted[k], accepted)
    return KindRows(r.count[k].copy(), acc, r.confidence[k].copy(), r.margin[k].copy(), r.tokens[k].copy())


def corpus_trace() -> Trace:
    reqs = [request(6, [[2, 1, 3, 0, 2, 1, 2, 0, 1], [3, 3, 2, 3, 1, 3, 3, 2, 3]], 5) for _ in range(6)]
    reqs = [dataclasses.replace(r, corpus={4: lagged(r, 1, 1), 16: lagged(r, 1, 0)}) for r in reqs]
    return Trace(("block", "ngram"), 5, 10, tuple(reqs), costs(kinds=2), corpus_kind="ngram")


def test_rows_by_corpus_lag_pack_to_the_same_bytes_and_serve_the_largest_lag_up_to_a_concurrency():
    trace = corpus_trace()
    raw = msgpack.packb(trace.as_dict())
    again = Trace.from_dict(msgpack.unpackb(raw))
    assert msgpack.packb(again.as_dict()) == raw and again.corpus_lags == (4, 16) and again.corpus_kind == "ngram"
    assert trace.at_concurrency(1) is trace and trace.at_concurrency(3) is trace
    for c, lag in ((4, 4), (15, 4), (16, 16), (64, 16)):
        seen = trace.at_concurrency(c)
        for r, s in zip(trace.requests, seen.requests, strict=True):
            assert s.accepted[1].tolist() == r.corpus[lag].accepted.tolist()  # the n-gram kind's, at that lag
            assert s.accepted[0].tolist() == r.accepted[0].tolist() and s.tokens.shape == r.tokens.shape
    plain = dataclasses.replace(trace, corpus_kind=None, requests=tuple(
        dataclasses.replace(r, corpus=None) for r in trace.requests))
    assert Trace.from_dict(msgpack.unpackb(msgpack.packb(plain.as_dict()))).corpus_lags == ()  # older traces


def test_a_replay_at_a_concurrency_drafts_from_the_corpus_a_loop_there_holds():
    trace = corpus_trace()
    settings = SimSettings(kinds=("ngram",), block=5)
    for c in (2, 4, 6):
        got = simulate_trace(trace, settings, c)
        want = simulate_trace(dataclasses.replace(trace.at_concurrency(c), corpus_kind=None, requests=tuple(
            dataclasses.replace(r, corpus=None) for r in trace.at_concurrency(c).requests)), settings, c)
        assert (got.tokens, got.steps, got.accepted, got.seconds) == (want.tokens, want.steps, want.accepted,
                                                                       want.seconds)
    assert simulate_trace(trace, settings, 4).mat < simulate_trace(trace, settings, 2).mat  # a thinner corpus


def test_rows_by_corpus_lag_that_do_not_fit_are_refused():
    trace = corpus_trace()
    r = trace.requests[0]
    with pytest.raises(ValueError, match="the kind they belong to"):
        dataclasses.replace(trace, corpus_kind=None)
    with pytest.raises(ValueError, match="corpus lag 1"):
        dataclasses.replace(trace, requests=(dataclasses.replace(r, corpus={1: r.corpus[4]}),))
    short = KindRows(*(a[:-1] for a in (r.corpus[4].count, r.corpus[4].accepted, r.corpus[4].confidence,
                                         r.corpus[4].margin, r.corpus[4].tokens)))
    with pytest.raises(ValueError, match="corpus lag 4"):
        dataclasses.replace(trace, requests=(dataclasses.replace(r, corpus={4: short, 16: r.corpus[16]}),))
    with pytest.raises(ValueError, match="same corpus lags"):
        dataclasses.replace(trace, requests=(r, dataclasses.replace(r, corpus={4: r.corpus[4]})))
    with pytest.raises(ValueError, match="no mtp"):
        dataclasses.replace(trace, corpus_kind="mtp")


def test_a_malformed_trace_is_refused():
    r = request(5, [[1, 3, 0]], 4)
    with pytest.raises(ValueError, match="kinds"):
        Trace(("block", "ngram"), 4, 8, (r,), costs(kinds=2))
    with pytest.raises(ValueError, match="version"):
        Trace.from_dict({"version": 99})


def test_full_policy_one_request_by_hand():
    """Block 4, accepted 2 at every position: prefill gives token 1, then each step commits 3
    (2 accepted + bonus) until 10 tokens: 1 + 3 + 3 + 3 = 10 in 1 prefill + 3 decode steps."""
    trace = Trace(("block",), 4, 10, (request(6, [[2] * 9], 4),), costs())
    out = simulate_trace(trace, SimSettings(policy="full", kinds=("block",)), 1)
    assert (out.tokens, out.steps, out.decode_steps, out.accepted) == (10, 4, 3, 6)
    # prefill forward: 6 tokens; decode steps verify 1 + 3 drafts, the last 1 + 2 (3 tokens left:
    # drafts are capped at remaining − 1)
    forward = (0.010 + 0.001 * 6) + 2 * (0.010 + 0.001 * 4) + (0.010 + 0.001 * 3)
    assert out.seconds == pytest.approx(forward + 2 * (0.002 + 0.0005 * 3) + (0.002 + 0.0005 * 2))
    assert out.mat == pytest.approx(3.0)
    assert out.forward_seconds == pytest.approx(forward) and out.rest_seconds == pytest.approx(0.0, abs=1e-12)
    own = simulate_trace(dataclasses.replace(trace, costs=costs(overhead=0.003)),
                         SimSettings(policy="full", kinds=("block",)), 1)
    assert own.rest_seconds == pytest.approx(4 * 0.003)  # the step's own time: the part that is neither pass


def reference_static(trace: Trace, policy: str, concurrency: int,
                     load_block: tuple[int, int] | None = None) -> tuple[int, int, float]:
    """(tokens, steps, seconds) of a static policy (ar, full, fixed-K) with one kind, written
    as plainly as possible: requests enter in order, a whole prompt prefills in one step; with
    `load_block` (requests, block) a step decoding more than that many drafts within that block."""
    keep = {"ar": 0, "full": trace.block - 1}[policy] if policy in ("ar", "full") else int(policy[6:])
    queue, running, tokens, steps, seconds = list(range(len(trace.requests))), [], 0, 0, 0.0
    c, d = trace.costs, trace.costs.draft[0]
    while queue or running:
        while queue and len(running) < concurrency:
            running.append([queue.pop(0), 0])  # [request, tokens committed]
        decoding = [x for x in running if x[1] > 0]
        fresh = [x for x in running if x[1] == 0]
        kept, drafted = [], 0
        block = trace.block if load_block is None or len(decoding) <= load_block[0] else load_block[1]
        for q, t in decoding:
            r = trace.requests[q]
            n = 0 if policy == "ar" else max(0, min(block - 1, trace.max_tokens - t - 1, int(r.count[0, t])))
            drafted += n
            kept.append((n, min(keep, n)))  # (drafted, kept)
        context = sum(trace.requests[q].prompt_len + t - 1 for q, t in decoding)
        shape = StepShape(len(running), len(decoding) + sum(k for _, k in kept) +
                          sum(trace.requests[q].prompt_len for q, _ in fresh), context)
        seconds += c.forward_seconds(shape) + c.own_seconds(len(running), policy != "ar", drafted > 0)
        if drafted:
            seconds += float(d.seconds(sum(1 for n, _ in kept if n), drafted, 0, max(n for n, _ in kept)))
        for x, (_, k) in zip(decoding, kept, strict=True):
            a = min(k, int(trace.requests[x[0]].accepted[0, x[1]]))
            made = min(a + 1, trace.requests[x[0]].length - x[1])
            x[1] += made
            tokens += made
        for x in fresh:
            x[1], tokens = 1, tokens + 1
        running = [x for x in running if x[1] < trace.requests[x[0]].length]
        steps += 1
    return tokens, steps, seconds


@settings(max_examples=80, deadline=None)
@given(data=st.data(), block=st.integers(2, 6), concurrency=st.integers(1, 4), policy=st.sampled_from(
    ["ar", "full", "fixed-1", "fixed-2"]))
def test_static_policies_equal_a_plain_reference_loop(data, block, concurrency, policy):
    """... also with a shorter block above a load (`SimSettings.load_block`, as `Engine._caps`)."""
    n = data.draw(st.integers(1, 5))
    reqs = []
    for _ in range(n):
        t = data.draw(st.integers(1, 12))
        acc = data.draw(st.lists(st.integers(0, block - 1), min_size=t - 1, max_size=t - 1))
        reqs.append(request(data.draw(st.integers(1, 20)), [acc], block))
    trace = Trace(("block",), block, 12, tuple(reqs), costs())
    if policy.startswith("fixed-") and int(policy[6:]) > block:
        return
    load_block = data.draw(st.none() | st.tuples(st.integers(0, 3), st.integers(2, block)))
    out = simulate_trace(trace, SimSettings(policy=policy, kinds=("block",), load_block=load_block), concurrency)
    tokens, steps, seconds = reference_static(trace, policy, concurrency, load_block)
    assert (out.tokens, out.steps) == (tokens, steps)
    assert out.tokens == trace.output_tokens
    assert out.seconds == pytest.approx(seconds)


def test_dcut_and_auto_run_the_real_gate_and_produce_every_token():
    rng = np.random.default_rng(0)
    reqs = tuple(request(8, rng.integers(0, 4, size=(3, 30)).tolist(), 5, conf=0.7) for _ in range(6))
    trace = Trace(("block", "mtp", "ngram"), 5, 31, reqs, costs(kinds=3))
    for kinds in (("block",), ("block", "mtp", "ngram")):
        out = simulate_trace(trace, SimSettings(policy="dcut", kinds=kinds), 4)
        assert out.tokens == trace.output_tokens and out.steps > 0
        assert out.drafted > 0  # it speculated
    bound = oracle_run(trace, ("block", "mtp", "ngram"), 4)
    assert bound.tokens == trace.output_tokens
    assert bound.kept == bound.accepted  # the oracle drafts exactly what is accepted


def test_the_oracle_is_never_beaten_by_a_policy_on_its_own_kinds():
    rng = np.random.default_rng(1)
    reqs = tuple(request(8, rng.integers(0, 5, size=(2, 40)).tolist(), 6) for _ in range(5))
    trace = Trace(("block", "ngram"), 6, 41, reqs, costs(kinds=2))
    bound = oracle_run(trace, ("block", "ngram"), 2).tok_s
    for policy in ("ar", "full", "fixed-2", "dcut"):
        for kinds in (("block",), ("ngram",), ("block", "ngram")):
            assert simulate_trace(trace, SimSettings(policy=policy, kinds=kinds), 2).tok_s <= bound * 1.0001


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_oracle_step_equals_brute_force(data):
    r = data.draw(st.integers(0, 6))
    k = data.draw(st.integers(1, 3))
    gains = np.array(data.draw(st.lists(st.integers(0, 6), min_size=r, max_size=r)), dtype=np.int64)
    kinds = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=r, max_size=r)), dtype=np.int64)
    backlog = np.array(data.draw(st.lists(st.integers(0, 50), min_size=r, max_size=r)), dtype=np.float64)
    money = st.floats(0.0, 0.01)
    draft = [DraftCost(data.draw(money), data.draw(money), data.draw(money), data.draw(st.floats(0, 1e-4)))
             for _ in range(k)]
    per_token, base, shared = data.draw(st.floats(0, 0.01)), data.draw(st.floats(0.001, 0.05)), data.draw(money)

    def rate(mask) -> float:
        used = {int(kinds[i]) for i in range(r) if mask[i]}
        seconds = base + (shared if used else 0.0) + sum(draft[j].fixed for j in used)
        seconds += sum(per_token * gains[i] + draft[kinds[i]].per_request + draft[kinds[i]].per_position * gains[i]
                       + draft[kinds[i]].per_context * backlog[i] for i in range(r) if mask[i])
        return (r + sum(gains[i] for i in range(r) if mask[i])) / seconds

    best = max(rate(m) for m in itertools.product([False, True], repeat=r))
    got = oracle_step(gains, kinds, per_token, base, draft, backlog, shared)
    assert rate(got) == pytest.approx(best, rel=1e-9)


def test_learned_state_round_trips_and_restores_kinds_by_name():
    from dcut_core.acceptance import Calibrator
    from dcut_core.drafting import AcceptanceTracker, Exploration
    from dcut_core.learned import LearnedState
    from dcut_core.trace_sim import prior_from_trace

    rng = np.random.default_rng(2)
    reqs = tuple(request(8, rng.integers(0, 4, size=(2, 30)).tolist(), 5, conf=0.8) for _ in range(6))
    trace = Trace(("block", "ngram"), 5, 31, reqs, costs(kinds=2))
    prior = prior_from_trace(trace)
    assert set(prior.kinds) == {"block", "ngram"} and all(k.observations > 0 for k in prior.kinds.values())
    assert all(k.draft is None for k in prior.kinds.values())  # a machine's costs are not a model's prior
    again = LearnedState.from_dict(json.loads(json.dumps(prior.as_dict())))
    assert again == prior
    cals, trackers = [Calibrator(block=5), Calibrator(block=5)], [AcceptanceTracker(block=5), AcceptanceTracker(5)]
    missing = again.restore(("ngram", "mtp"), cals, trackers, Exploration())
    assert missing == ["mtp"]
    assert tuple(trackers[0].accepted) == prior.kinds["ngram"].accepted
    assert tuple(cals[0].weights) == prior.kinds["ngram"].weights
    assert (trackers[1].accepted == AcceptanceTracker(block=5).accepted).all()  # untouched: cold


def test_a_state_saved_at_one_block_estimates_the_same_in_an_engine_of_another():
    """The calibration's position feature is position / block: a state saved at block 8 (the
    bundle's prior) restored into a block-16 calibrator estimates every draft as before (its
    position weight rescaled), and the tracker's saved positions are the first of its 16."""
    from dcut_core.acceptance import Calibrator
    from dcut_core.drafting import AcceptanceTracker, Exploration
    from dcut_core.learned import KindState, LearnedState

    rng = np.random.default_rng(3)
    saved_cal = Calibrator(block=8, refit_every=64)
    conf, margin, pos = rng.uniform(0.05, 0.95, 2000), rng.uniform(0, 1, 2000), rng.integers(0, 7, 2000)
    saved_cal.observe(conf, margin, pos, rng.uniform(size=2000) < conf * (1 - pos / 10))
    assert abs(saved_cal.weights[3]) > 0.1  # the position matters in what it learnt
    tracker = AcceptanceTracker(block=8)
    state = LearnedState({"ngram": KindState.of(saved_cal, tracker)})
    cal16, tracker16 = Calibrator(block=16), AcceptanceTracker(block=16)
    state.restore(("ngram",), [cal16], [tracker16], Exploration())
    np.testing.assert_allclose(cal16.estimate(conf, margin, pos), saved_cal.estimate(conf, margin, pos), rtol=1e-12)
    same = Calibrator(block=8)
    state.restore(("ngram",), [same], [AcceptanceTracker(block=8)], Exploration())
    assert tuple(same.weights) == tuple(saved_cal.weights)  # the same block: as saved, to the bit


def test_a_one_kind_setting_pays_the_one_kind_engines_own_time():
    """A trace of several kinds may carry the own time of a one-kind engine measured beside the
    unit (`own_one`): a one-kind setting is charged that, a setting of several kinds the unit's;
    without it (older traces) every setting pays the unit's."""
    import dataclasses

    reqs = tuple(request(6, [[2, 1, 3, 0, 2, 1, 2, 0, 1], [0, 3, 1, 2, 0, 1, 3, 2, 0]], 5) for _ in range(4))
    trace = Trace(("block", "ngram"), 5, 10, reqs, costs(kinds=2))
    dear = dataclasses.replace(trace.costs, own_policy=(0.004, 0.0), own_drafting=(0.002, 0.0))
    cheap = dataclasses.replace(dear, own_one=((0.0, 0.0), (0.0, 0.0)))
    one, several = SimSettings(kinds=trace.kinds[:1]), SimSettings(kinds=trace.kinds)
    runs = {name: (simulate_trace(dataclasses.replace(trace, costs=c), one, 2),
                   simulate_trace(dataclasses.replace(trace, costs=c), several, 2))
            for name, c in (("dear", dear), ("cheap", cheap))}
    assert runs["cheap"][0].seconds < runs["dear"][0].seconds  # the one-kind setting: its own time
    assert runs["cheap"][1].seconds == runs["dear"][1].seconds  # several kinds: the unit's, either way
    again = type(trace.costs).from_dict(msgpack.unpackb(msgpack.packb(cheap.as_dict())))
    assert again.own_one == cheap.own_one and type(trace.costs).from_dict(dear.as_dict()).own_one is None


def test_a_trace_that_prices_the_chooser_apart_charges_each_of_its_runs():
    """A trace of several kinds may price a run of the kind chooser apart (`TraceCosts.choose`,
    a + b·R seconds a run; the unit's own-time lines then leave it out): a setting of several
    kinds pays it at each step where the chooser ran (`SimResult.choices`) — so a replay weighs
    how often it runs — and a one-kind setting never. Older traces (None) charge nothing apart."""
    import dataclasses

    reqs = tuple(request(6, [[2, 1, 3, 0, 2, 1, 2, 0, 1], [0, 3, 1, 2, 0, 1, 3, 2, 0]], 5) for _ in range(4))
    trace = Trace(("block", "ngram"), 5, 10, reqs, costs(kinds=2))
    runs = {}
    for name, choose in (("none", None), ("free", (0.0, 0.0)), ("dear", (1e-3, 0.0))):
        priced = dataclasses.replace(trace, costs=dataclasses.replace(trace.costs, choose=choose))
        runs[name] = [simulate_trace(priced, SimSettings(kinds=kinds), 2) for kinds in (trace.kinds, trace.kinds[:1])]
    several, one = runs["dear"]
    assert several.choices > 0 and one.choices == 0
    assert [r.seconds for r in runs["none"]] == [r.seconds for r in runs["free"]]
    assert several.choices == runs["free"][0].choices and several.tokens == runs["free"][0].tokens
    assert several.seconds == pytest.approx(runs["free"][0].seconds + 1e-3 * several.choices, rel=1e-9)
    assert one.seconds == runs["free"][1].seconds
    dear = dataclasses.replace(trace.costs, choose=(1e-3, 2e-4))
    assert type(trace.costs).from_dict(msgpack.unpackb(msgpack.packb(dear.as_dict()))).choose == dear.choose
    assert type(trace.costs).from_dict(trace.costs.as_dict()).choose is None and dear.for_kinds(1).choose is None


@pytest.mark.parametrize("ngram_better", [True, False])
def test_the_ngram_look_ahead_is_asked_only_where_it_drafts_and_teaches_every_step(ngram_better):
    """Two kinds: block, and n-gram, which finds a match only at every third position. With the
    look-ahead (the engine's way) n-gram is never asked where it finds nothing, and its tracker
    learns from the steps block drafted too. Without it, a better n-gram is asked where it has
    nothing (then drafts nothing and falls back), and a worse one at most a few times (the
    chooser's bonus tries a kind the unit has seldom verified; its caution doubts a kind the
    request has not: here that keeps the worse kind from being tried at all)."""
    block = 5
    r = request(6, [[1] * 23, [3] * 23] if ngram_better else [[3] * 23, [1] * 23], block)
    count = r.count.copy()
    count[1, 1:] = np.where(np.arange(1, 24) % 3 == 0, block - 1, 0)  # kind 1 is n-gram
    accepted = np.minimum(r.accepted, count)
    trace = Trace(("block", "ngram"), block, 24, tuple(RequestTrace(6, r.output, count, accepted, r.confidence,
                                                                    r.margin, r.tokens) for _ in range(3)),
                  costs(kinds=2, draft=DraftCost(1e-4, 0.0, 1e-5)))
    from dcut_core.trace_sim import _Run

    for lookahead in (True, False):
        run = _Run(trace, SimSettings(kinds=("block", "ngram"), lookahead=lookahead), 1)
        asked, taught = [], []
        plan, learn = run._plan, run.gate.learn

        def spy_plan(batch, plan=plan, asked=asked):
            lengths, kinds, fallback = plan(batch)
            asked += [int(trace.requests[x.q].count[1, x.t]) for x, n, k in zip(batch, lengths, kinds, strict=True)
                      if n and k == 1]
            return lengths, kinds, fallback

        def spy_learn(verified, empty=(), learn=learn, taught=taught):
            taught.extend(verified.kinds.tolist() + [k for _, k in empty])
            learn(verified, empty)

        run._plan, run.gate.learn = spy_plan, spy_learn
        out = run.run()
        assert out.tokens == 3 * 24
        if lookahead:
            assert all(n > 0 for n in asked) and bool(asked) == ngram_better
            if not ngram_better:  # it learnt from steps it did not draft
                assert taught.count(1) > 0
        elif ngram_better:
            assert 0 in asked
        else:
            assert taught.count(1) <= 3


def test_the_hindsight_gate_predicts_each_kinds_accepted_length_within_its_room():
    from dcut_core.drafting import Exploration
    from dcut_core.gate import DraftingCosts, GateInput, KindReach
    from dcut_core.pruning import StepCost
    from dcut_core.trace_sim import HindsightGate

    gate = HindsightGate([], Exploration())
    gate.accepted = np.array([[3, 0], [7, 2], [1, 5]])
    reach = KindReach(np.zeros((3, 2)), None, np.array([[-1, 1], [-1, 3], [-1, 0]]))
    g = GateInput.capture([1, 2, 3], [4, 4, 2], [40, 40, 40], reach,
                          StepCost(lambda n: 0.01 + 0.001 * np.asarray(n), 0.0), DraftingCosts([DRAFT, DRAFT]))
    p = gate.predict(g)
    # room: the cap, within the look-ahead's count for kind 1
    assert p.lengths.tolist() == [[4, 1], [4, 3], [2, 0]]
    expected = np.cumprod(p.rates, axis=2).sum(axis=2)
    assert expected.tolist() == [[3, 0], [4, 2], [1, 0]]


def test_auto_told_in_hindsight_drafts_with_the_kind_that_would_be_accepted():
    """Kind 0 has every draft accepted on even positions and none on odd ones, kind 1 the
    reverse: only a gate that knows both picks the right one every step."""
    block, t = 6, 40
    even = [block - 1 if i % 2 == 0 else 0 for i in range(1, t)]
    odd = [0 if i % 2 == 0 else block - 1 for i in range(1, t)]
    reqs = tuple(request(8, [even, odd], block) for _ in range(3))
    trace = Trace(("block", "mtp"), block, t, reqs, costs(kinds=2))
    told = simulate_trace(trace, SimSettings(kinds=("block", "mtp"), hindsight=True), 1)
    guessed = simulate_trace(trace, SimSettings(kinds=("block", "mtp")), 1)
    assert told.tokens == guessed.tokens == sum(r.length for r in reqs)
    assert told.mat > guessed.mat and told.mat > 4.0
    assert told.tok_s > guessed.tok_s


def test_tuned_hosts_the_set_of_kinds_whose_choice_replays_fastest():
    """`choose_hosted`: a kind that never has a draft accepted is left out of `tuned` (its pass
    costs and it teaches nothing); the scores are each set's own replay over `ar`'s."""
    import math

    from dcut_core.trace_sim import choose_hosted, shuffled

    rng = np.random.default_rng(5)
    reqs = []
    for i in range(6):  # mtp accepts on even requests, n-gram on odd ones, block never
        good, poor = rng.integers(3, 5, size=24).tolist(), rng.integers(0, 2, size=24).tolist()
        reqs.append(request(8, [[0] * 24, good if i % 2 == 0 else poor, poor if i % 2 == 0 else good], 5))
    trace = Trace(("block", "mtp", "ngram"), 5, 25, tuple(reqs), costs(kinds=3))
    choice = choose_hosted([trace], levels=(1, 2), orders=2)
    assert set(choice.scores) == {("block", "mtp"), ("block", "ngram"), ("mtp", "ngram"), ("block", "mtp", "ngram")}
    assert choice.kinds == ("mtp", "ngram")
    assert choice.scores[choice.kinds] == max(choice.scores.values())
    cells = [simulate_trace(t, SimSettings(kinds=("mtp", "ngram")), c).tok_s
             / simulate_trace(t, SimSettings(policy="ar", kinds=("block",)), c).tok_s
             for t in shuffled(trace, 2) for c in (1, 2)]
    assert choice.scores[("mtp", "ngram")] == pytest.approx(math.exp(np.mean(np.log(cells))))
    one = Trace(("ngram",), 5, 25, (request(8, [[2] * 24], 5),), costs())
    assert choose_hosted([one], levels=(1,), orders=1).kinds == ("ngram",)
    with pytest.raises(ValueError, match="different kinds"):
        choose_hosted([trace, one], levels=(1,), orders=1)


def test_a_cut_chain_drafts_less_and_is_charged_the_passes_it_ran():
    """MTP's chains cut as the engine's replica cuts them (`chain_stop`): every token still made,
    fewer drafts than uncut where confidences fall (0.5 a draft: survivals 0.5, 0.25, ...), and
    each step's drafting time that of the passes the cut ran (`cut_lengths`)."""
    rng = np.random.default_rng(1)
    reqs = tuple(request(8, rng.integers(0, 5, size=(1, 30)).tolist(), 6, conf=0.5) for _ in range(4))
    trace = Trace(("mtp",), 6, 31, reqs, costs(draft=DraftCost(0.002, 0.0, 0.0002, 0.0, 0.003)))
    uncut = simulate_trace(trace, SimSettings(policy="full", kinds=("mtp",)), 2)
    cut = simulate_trace(trace, SimSettings(policy="full", kinds=("mtp",), chain_stop=True), 2)
    assert uncut.tokens == cut.tokens == trace.output_tokens
    assert 0 < cut.drafted < uncut.drafted and cut.draft_seconds < uncut.draft_seconds
    one = simulate_trace(trace, SimSettings(policy="full", kinds=("mtp",), chain_stop=True, chained=()), 2)
    assert one.drafted == uncut.drafted  # a kind not chained is never cut
