"""The drafting gate: plain decoding when drafting cannot pay, full drafts when it is free."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core import drafting
from dcut_core import gate as gate_module
from dcut_core.drafting import (
    AcceptanceTracker,
    DraftCost,
    DraftingCosts,
    Exploration,
    Survival,
    Verified,
)
from dcut_core.gate import DraftingGate, GateInput, KindReach, replay
from dcut_core.planning import DraftPlanner, numpy_sum
from dcut_core.pruning import StepCost


def linear(fixed, per_token):
    return StepCost(lambda n: per_token * n.astype(np.float64), fixed)


def one_kind_plan(rows, verify, cost, catchup=None, **shape):
    """One kind's plan for ragged prediction rows."""
    return DraftPlanner(**shape).plan(Survival.of(rows), verify, DraftingCosts([cost]), catchup=catchup)


def test_tracker_learns_per_position_rates_and_request_factors():
    t = AcceptanceTracker(block=4, halflife_steps=1e9)
    rng = np.random.default_rng(1)
    predicted = {1: [], 2: []}
    for step in range(3000):  # request 1 accepts each draft with 0.8, request 2 with 0.2
        for rid, p in ((1, 0.8), (2, 0.2)):
            t.observe(rid, kept=4, accepted=int(np.argmin(np.append(rng.random(4) < p, False))))
            if step >= 1000:
                predicted[rid].append(np.cumprod(t.predict(rid, 4)).sum())
    assert t.global_rate[0] == pytest.approx(0.5, abs=0.03)
    # What a request's prediction must get right is how many drafts it accepts, Σ survival:
    # 0.8 + 0.8² + 0.8³ + 0.8⁴ = 2.36 and 0.25 of 4 kept. The factor follows the last few steps,
    # so one prediction is noisy; on average it is right (the second within its +0.5 prior).
    assert np.mean(predicted[1]) == pytest.approx(2.36, rel=0.1)
    assert np.mean(predicted[2]) == pytest.approx(0.25, rel=0.5)
    t.forget(1)
    assert t.predict(1, 2) == pytest.approx(np.clip(t.global_rate[:2], 0, 0.99))


def test_a_request_that_stopped_drafting_drifts_back_to_the_global_rate():
    t = AcceptanceTracker(block=4, halflife_steps=1e9)
    for _ in range(50):
        t.observe(1, kept=4, accepted=3)  # the population accepts well
    for _ in range(3):
        t.observe(7, kept=4, accepted=0)  # request 7: three misses in a row
    low = t.predict(7, 1)[0]
    assert low < 0.5 * t.global_rate[0]
    for _ in range(12):
        t.skipped([7])
    assert t.predict(7, 1)[0] == pytest.approx(t.global_rate[0], rel=0.15)
    t.skipped([99])  # never seen: nothing to relax
    assert 99 not in t.factor


def test_gate_predicts_each_request_and_kind_as_its_tracker_does_zeros_past_its_room():
    trackers = [AcceptanceTracker(block=6), AcceptanceTracker(block=4)]
    for rid, acc in ((1, 5), (2, 0), (3, 2), (1, 4), (2, 1)):
        trackers[0].observe(rid, kept=5, accepted=acc)
        trackers[1].observe(rid, kept=3, accepted=min(acc, 3))
    gate = DraftingGate(trackers, Exploration())
    rids = [1, 2, 3, 9, 2]
    caps = np.array([5, 0, 3, 2, 7])
    available = np.array([[-1, -1], [-1, -1], [-1, 1], [-1, 0], [-1, -1]])
    g = GateInput.capture(rids, caps, np.full(5, 40), KindReach(np.zeros((5, 2)), available=available),
                          StepCost(lambda n: 0.01 + 0.001 * n), DraftingCosts([DraftCost(), DraftCost()]))
    got = gate.predict(g)
    assert got.rates.shape == (5, 2, 7)
    for i, rid in enumerate(rids):
        for k, t in enumerate(trackers):
            n = int(got.lengths[i, k])
            want = t.predict(rid, n)  # past a tracker's block: zeros
            assert got.rates[i, k, :len(want)].tolist() == want.tolist() and not got.rates[i, k, len(want):].any()
    assert got.lengths.tolist() == [[5, 5], [0, 0], [3, 1], [2, 0], [7, 7]]
    empty = GateInput.capture([], np.zeros(0), np.zeros(0), KindReach(np.zeros((0, 2))),
                              StepCost(lambda n: 0.01 + 0 * n), DraftingCosts([DraftCost(), DraftCost()]))
    assert gate.predict(empty).rates.shape == (0, 2, 0)


def test_drafts_pruning_left_out_teach_the_tracker_through_their_calibrated_estimates():
    """Pruning verifies the confident drafts, so outcomes alone overrate deep positions (a deep
    draft is judged only when it looked good). Drafted positions past the kept ones, reached
    because every kept draft passed, count with their calibrated acceptance: the rates the
    gate plans with are then those of all drafts, not of the selected ones."""
    rng = np.random.default_rng(4)
    n = 6
    naive, fair = AcceptanceTracker(block=n + 1, halflife_steps=1e9), AcceptanceTracker(block=n + 1,
                                                                                        halflife_steps=1e9)
    for _ in range(4000):
        p = rng.beta(2, 2, n)  # calibrated conditional acceptance of each drafted position
        ok = rng.random(n) < p
        kept = int(np.argmin(p > 0.6)) if (p <= 0.6).any() else n  # keep the confident prefix
        accepted = int(np.argmin(ok[:kept])) if not ok[:kept].all() else kept
        naive.observe(1, kept, accepted)
        fair.observe(1, kept, accepted, beyond=p[kept:])
    truth = 0.5  # mean of Beta(2, 2): every position's acceptance over all drafts
    assert np.all(naive.global_rate[:3] > truth + 0.1)  # selected drafts only: far too hopeful
    np.testing.assert_allclose(fair.global_rate[:n], truth, atol=0.05)
    assert fair.observations == 4000  # a step whose drafts were all pruned still teaches


def test_beyond_is_ignored_once_a_kept_draft_failed():
    t = AcceptanceTracker(block=4, halflife_steps=1e9)
    before = t.global_rate.copy()
    t.observe(1, kept=2, accepted=1, beyond=np.array([0.9, 0.9]))  # positions 2, 3 never reached
    np.testing.assert_array_equal(t.global_rate[2:], before[2:])


def test_exploration_probes_requests_in_turn_with_its_own_counter():
    from dcut_core.drafting import Exploration

    ex = Exploration(every=3, requests=2, warmup=0)
    masks = [ex.probe(5, warming=False) for _ in range(7)]
    # Steps 0, 3, 6 explore, two requests each, moving on through the batch.
    assert [m is not None for m in masks] == [True, False, False, True, False, False, True]
    assert [np.flatnonzero(m).tolist() for m in masks if m is not None] == [[0, 1], [2, 3], [0, 4]]
    assert ex.steps == 7


def test_exploration_probes_every_step_while_warming_and_never_more_requests_than_the_batch():
    from dcut_core.drafting import Exploration

    ex = Exploration(every=50, requests=4, warmup=64)
    masks = [ex.probe(3, warming=True) for _ in range(5)]
    assert all(m is not None and m.sum() == 3 for m in masks)
    assert ex.probe(0, warming=True) is None


def gate(**kw):
    from dcut_core.drafting import Exploration
    from dcut_core.gate import DraftingGate

    return DraftingGate([AcceptanceTracker(block=8)], Exploration(every=50, requests=2, warmup=0), **kw)


def decide(g, rids, caps, remaining, lag, verify, draft):
    """The gate's drafts [R] for one kind."""
    return g.decide(GateInput.capture(rids, caps, remaining, KindReach(np.asarray(lag)[:, None]), verify,
                                      DraftingCosts([draft]))).lengths


def test_gate_drafts_when_it_pays_and_not_when_it_does_not():
    g = gate()
    for _ in range(30):
        g.trackers[0].observe(0, 7, 7)  # request 0 accepts everything
    flat = StepCost(lambda n: np.full(len(n), 0.01), 0.0)
    cheap, dear = DraftCost(1e-4, 0.0, 1e-5), DraftCost(1.0, 0.0, 0.0)
    caps = np.array([7, 7])
    assert decide(g, [0, 1], caps, np.array([40, 40]), np.zeros(2), flat, cheap)[0] > 0
    lengths = decide(g, [0, 1], caps, np.array([40, 40]), np.zeros(2), flat, dear)
    assert lengths.tolist() in ([0, 0], [7, 7])  # plain decoding, or the exploring step of its schedule


def test_gate_explores_on_its_own_schedule_and_charges_catch_up_by_remaining_share():
    g = gate(planner=DraftPlanner())
    dear = DraftCost(1.0, 0.0, 0.0)
    flat = StepCost(lambda n: np.full(len(n), 0.01), 0.0)
    caps = np.array([3, 3, 3])
    first = decide(g, [0, 1, 2], caps, np.full(3, 9), np.zeros(3), flat, dear)
    assert first.tolist() == [3, 3, 0]  # step 0 of the schedule explores, two requests
    assert decide(g, [0, 1, 2], caps, np.full(3, 9), np.zeros(3), flat, dear).tolist() == [0, 0, 0]
    # The catch-up charge: backlog × min(1, (1 + Σ predicted survival) / remaining).
    predicted = [np.array([0.5, 0.5]), np.array([0.5, 0.5]), np.array([0.5])]
    charge = g.catch_up_charge(Survival.of(predicted), np.array([10.0, 10.0, 10.0]), np.array([1, 3, 100]))
    assert np.allclose(charge, [10.0, 10.0 * 1.75 / 3, 10.0 * 1.5 / 100])


def test_a_step_where_no_kind_may_draft_plans_nothing_and_spends_no_probe():
    """The look-ahead found nothing (the n-gram kind's only column: 0 available) or every cap is
    0: a plain plan at once, each idle request's factor drifting back as on any idle step, and the
    exploration schedule's counter left for a step where a probe can draft."""
    from dcut_core.drafting import Exploration

    g = DraftingGate([AcceptanceTracker(block=8)], Exploration(every=1, requests=2, warmup=0))
    for _ in range(3):
        g.trackers[0].observe(5, 7, 0)  # request 5's own factor falls below the global rate
    low = g.trackers[0].factors([5])[0]
    flat = StepCost(lambda n: np.full(len(n), 0.01), 0.0)
    nothing = KindReach(np.zeros((2, 1)), available=np.zeros((2, 1), dtype=np.int64))
    for caps, reach in ((np.array([7, 7]), nothing), (np.zeros(2, dtype=np.int64), KindReach(np.zeros((2, 1))))):
        plan = g.decide(GateInput.capture([5, 6], caps, np.array([40, 40]), reach, flat,
                                          DraftingCosts([DraftCost(1e-4, 0.0, 1e-5)])))
        assert plan.lengths.tolist() == [0, 0] and not plan.drafting and plan.kinds.tolist() == [0, 0]
    assert g.exploration.steps == 0  # every=1 would have probed both steps
    assert low < g.trackers[0].factors([5])[0] < 1.0  # skipped twice: drifting back toward the global rate
    probe = g.decide(GateInput.capture([5, 6], np.array([7, 7]), np.array([40, 40]), KindReach(np.zeros((2, 1))),
                                       StepCost(lambda n: np.full(len(n), 0.01), 0.0),
                                       DraftingCosts([DraftCost(1.0, 0.0, 0.0)])))
    assert probe.lengths.tolist() == [7, 7] and g.exploration.steps == 1  # the first probe, where it can draft


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.0, 1.0) | st.sampled_from([0.0, 0.5, 1e-300, 0.99]), max_size=128))
def test_numpy_sum_adds_a_row_as_numpy_does_to_the_last_bit(values):
    assert numpy_sum(list(values)) == np.sum(np.array(values, dtype=np.float64))
    if values:  # one row of a matrix summed along its rows, as the planner and the gate sum them
        assert numpy_sum(list(values)) == np.array([values, values[::-1]]).sum(axis=1)[0]


def _gate_pair(kinds: int, seed: int) -> tuple[DraftingGate, DraftingGate]:
    """Two gates of the engine's shape with the same random history (trackers, probe counter)."""
    rng = np.random.default_rng(seed)
    pair = []
    for _ in range(2):
        g = DraftingGate([AcceptanceTracker(block=16) for _ in range(kinds)],
                         Exploration(every=int(rng.integers(1, 4)), requests=2, warmup=int(rng.integers(0, 40))),
                         DraftPlanner(slack=2, extend=True), teach_empty=kinds > 1)
        pair.append(g)
        rng = np.random.default_rng(seed)  # the second gate's history is the first's
    return pair[0], pair[1]


def _random_step(rng: np.random.Generator, kinds: int) -> GateInput:
    """A step of 0–8 requests (ids from a small pool, so factors repeat), caps up to 15, the
    n-gram column's look-ahead found 0–15 or anything, some kinds disallowed, a backlog, the
    kinds' costs (a chained one among them), a concave or a stepped verify curve; with several
    kinds, the step's one kind (the payoff check's arm)."""
    r = int(rng.integers(0, 9))
    rids = rng.choice(12, size=r, replace=False).tolist()
    caps = rng.integers(0, 16, r) * (rng.random(r) < 0.9)
    remaining = caps + rng.integers(1, 60, r)
    available = None
    if rng.random() < 0.7:
        available = np.full((r, kinds), -1, dtype=np.int64)
        available[:, -1] = rng.integers(0, 16, r)
    allowed = rng.random((r, kinds)) < 0.85 if rng.random() < 0.3 else None
    reach = KindReach(rng.integers(0, 300, (r, kinds)) * (rng.random((r, kinds)) < 0.5), allowed, available,
                      int(rng.integers(0, kinds)) if kinds > 1 else None)
    base, per = rng.uniform(0.005, 0.02), rng.uniform(0.0, 0.002)
    verify = StepCost(lambda n: base + per * np.sqrt(n), 0.0) if rng.random() < 0.5 else \
        StepCost(lambda n: base + per * (n // 4), 0.0)
    money = lambda: float(rng.choice([0.0, 1e-5, 1e-4, 1e-3, rng.uniform(0, 3e-3)]))  # noqa: E731
    costs = DraftingCosts([DraftCost(money(), money(), money(), money() / 100, money() * (k == 0))
                           for k in range(kinds)], money(), money(), np.arange(kinds) < kinds - 1)
    return GateInput.capture(rids, caps, remaining, reach, verify, costs)


def _teach(rng: np.random.Generator, gates: tuple[DraftingGate, ...], step: GateInput, kinds: int) -> None:
    """The same random verifications of some of the step's requests, to every gate."""
    picked = [rid for rid in step.rids if rng.random() < 0.6]
    if not picked:
        return
    kept = rng.integers(0, 16, len(picked))
    accepted = [int(rng.integers(0, n + 1)) for n in kept]
    kind = rng.integers(0, kinds, len(picked))
    beyond = [rng.uniform(0, 1, int(rng.integers(0, 4))) for _ in picked]
    for g in gates:
        g.learn(Verified.of(picked, kind, kept, accepted, beyond))


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 1, 3]))
def test_a_few_requests_of_one_kind_are_decided_in_plain_python_as_the_array_code_decides(seed, kinds):
    """Plan for plan to the last bit, over a history of random steps and verifications: the
    kinds, the lengths, the probes spent, and the trackers' factors the idle drift moves."""
    in_turn, whole = _gate_pair(kinds, seed)
    rng = np.random.default_rng(seed + 1)
    asked, real = [], DraftPlanner.plan_rows  # what each path asks the plain-Python scan: rows, sums, charges

    def plan_rows(planner, *args):
        asked.append([a.table.tolist() if isinstance(a, DraftingCosts) else a for a in args])
        return real(planner, *args)

    spy = mock.patch.object(DraftPlanner, "plan_rows", autospec=True, side_effect=plan_rows)
    for _ in range(25):
        step = _random_step(rng, kinds)
        with spy:
            a = in_turn._decide_in_turn(step)
            b = whole._decide_whole(step)
        assert len(asked) in (0, 2) and (not asked or asked[0] == asked[1])
        asked.clear()
        assert (a.kinds.tolist(), a.lengths.tolist(), a.fallback.tolist(), a.chosen) == \
            (b.kinds.tolist(), b.lengths.tolist(), b.fallback.tolist(), b.chosen)
        assert a.lengths.dtype == b.lengths.dtype == np.int64
        assert in_turn.exploration.steps == whole.exploration.steps
        for ta, tb in zip(in_turn.trackers, whole.trackers, strict=True):
            assert ta.factor == tb.factor and ta._sums == tb._sums
        _teach(rng, (in_turn, whole), step, kinds)


def test_decide_takes_the_plain_python_path_for_a_few_requests_with_no_kind_to_choose():
    rng = np.random.default_rng(3)
    spy = {name: mock.patch.object(DraftingGate, name, autospec=True, side_effect=getattr(DraftingGate, name))
           for name in ("_decide_in_turn", "_decide_whole")}
    one, three = _gate_pair(1, 0)[0], _gate_pair(3, 0)[0]
    with spy["_decide_in_turn"] as in_turn, spy["_decide_whole"] as whole:
        few = _random_step(rng, 1)
        one.decide(few)
        assert (in_turn.call_count, whole.call_count) == (1, 0)
        many = GateInput.capture(list(range(gate_module.IN_TURN_BATCH + 1)), np.full(9, 7), np.full(9, 40),
                                 KindReach(np.zeros((9, 1))), linear(0.01, 1e-4), DraftingCosts([DraftCost()]))
        one.decide(many)
        assert (in_turn.call_count, whole.call_count) == (1, 1)
        chosen = GateInput.capture([1, 2], np.full(2, 7), np.full(2, 40), KindReach(np.zeros((2, 3))),
                                   linear(0.01, 1e-4), DraftingCosts([DraftCost()] * 3))
        three.decide(chosen)  # three kinds to choose from: the chooser's array path
        assert (in_turn.call_count, whole.call_count) == (1, 2)
        armed = GateInput.capture([1, 2], np.full(2, 7), np.full(2, 40), KindReach(np.zeros((2, 3)), only=1),
                                  linear(0.01, 1e-4), DraftingCosts([DraftCost()] * 3))
        assert three.decide(armed).kinds.tolist() == [1, 1]  # the step's one kind: nothing to choose
        assert (in_turn.call_count, whole.call_count) == (2, 2)
        wide = GateInput.capture([1], np.array([200]), np.array([400]), KindReach(np.zeros((1, 1))),
                                 linear(0.01, 1e-4), DraftingCosts([DraftCost()]))
        one.decide(wide)  # a row longer than numpy sums in one block: the array path decides it
        assert (in_turn.call_count, whole.call_count) == (3, 3)


def test_gate_input_holds_the_verify_cost_at_every_count_the_decision_can_ask():
    curve = StepCost(lambda n: 0.002 + 1e-4 * n + 3e-6 * np.sqrt(n), 0.001)
    g = GateInput.capture([4, 9, 2], np.array([3, 0, 5]), np.array([10, 1, 7]), KindReach(np.array([[0], [4], [2]])),
                          curve, DraftingCosts([DraftCost(1e-3, 2e-4, 1e-5, 1e-6)]))
    counts = np.arange(3, 3 + 8 + 1)
    assert np.array_equal(g.verify().seconds(counts), curve.seconds(counts))  # bit for bit
    back = GateInput.from_dict(g.as_dict())
    assert back.rids == g.rids and back.costs.draft == g.costs.draft
    assert all(np.array_equal(a, b) for a, b in ((back.caps, g.caps), (back.verify_table, g.verify_table),
                                                 (back.remaining, g.remaining), (back.lag, g.lag)))
    # The captured table is checked once (capture, or reading a log), not at every lookup.
    assert g.verify().checked
    bad = {**g.as_dict(), "verify_table": [0.01, -1.0, *g.verify_table[2:].tolist()]}
    with pytest.raises(ValueError, match="finite and positive"):
        GateInput.from_dict(bad)


def test_a_gate_input_logged_before_kinds_were_one_path_reads_as_one_kind():
    """Step logs written while one kind had a path of its own hold a flat cost and a per-request
    backlog: they read as K = 1."""
    old = {"rids": [3, 5], "caps": [2, 4], "remaining": [9, 9], "backlog": [0.0, 6.0],
           "verify_table": [0.01 + 1e-3 * n for n in range(7)], "draft": [1e-3, 2e-4, 1e-5, 1e-6, 0.0],
           "allowed": None}
    g = GateInput.from_dict(old)
    assert g.costs.draft == [DraftCost(1e-3, 2e-4, 1e-5, 1e-6, 0.0)] and g.lag.tolist() == [[0.0], [6.0]]
    assert g.costs.shared_fixed == 0.0 and GateInput.from_dict(g.as_dict()).lag.tolist() == g.lag.tolist()


def test_replay_of_a_logged_history_reproduces_every_plan():
    """A gate deciding and learning over a random history, logged as the engine logs it; a
    fresh gate replaying the log asks for exactly the same drafts at every step, and one with
    another setting asks for something else."""
    rng = np.random.default_rng(3)
    live = gate()
    log, rids, next_rid = [], [0, 1, 2], 3
    for _ in range(300):
        if rng.random() < 0.1:  # requests come and go
            rids = [r for r in rids if rng.random() < 0.7] + [next_rid]
            next_rid += 1
        caps = rng.integers(0, 8, len(rids))
        fixed = rng.uniform(0.005, 0.02)
        verify = StepCost(lambda n, a=fixed: a + 2e-4 * n, 0.0)
        draft = DraftCost(rng.uniform(0, 0.01), 1e-4, 1e-5, 1e-6)
        plan = live.decide(GateInput.capture(rids, caps, rng.integers(1, 50, len(rids)),
                                             KindReach(rng.integers(0, 30, (len(rids), 1))), verify,
                                             DraftingCosts([draft])))
        g, planned, lengths = plan.seen, plan.lengths, plan.lengths
        kept = np.minimum(lengths, rng.integers(0, 8, len(rids)))
        accepted = np.array([rng.integers(0, k + 1) for k in kept])
        beyond = [rng.uniform(0, 1, int(n - k)) for n, k in zip(lengths, kept, strict=True)]
        cu = np.concatenate([[0], np.cumsum([len(b) for b in beyond])]).tolist()
        live.learn(Verified.of(rids, np.zeros(len(rids)), kept, accepted, beyond))  # one step, one batch
        log.append({"gate": {"input": g.as_dict(), "lengths": planned.tolist()},
                    "observed": {"rids": rids, "kept": kept.tolist(), "accepted": accepted.tolist(),
                                 "beyond": np.concatenate(beyond).tolist(), "beyond_cu": cu}})
    plans = replay(gate(), log)
    assert len(plans) == 300 and sum(p[1].sum() > 0 for p, _ in plans) > 30
    assert all(np.array_equal(logged, got) for logged, got in plans)
    other = replay(gate(planner=DraftPlanner()), log)
    assert any(not np.array_equal(logged, got) for logged, got in other)


def sequential_learn(t: AcceptanceTracker, entries) -> tuple[np.ndarray, np.ndarray, dict, int]:
    """The batch's meaning written out, one entry and one position at a time: each judged
    position decays and adds its outcome, each position past the kept ones counts softly; then
    each request's factor sums, against the rates after the whole batch."""
    d = 0.5 ** (1.0 / t.halflife_steps)
    acc, jud, sums, seen = t.accepted.tolist(), t.judged.tolist(), dict(t._sums), t.observations
    for _, k, a, b in entries:
        soft = b is not None and a >= k and k < t.block and len(b) > 0
        seen += k > 0 or soft
        for p in range(min(a + 1, k)):
            acc[p], jud[p] = acc[p] * d + (p < a), jud[p] * d + 1.0
        if soft:
            reach = 1.0
            for q, x in enumerate(b[:t.block - k]):
                acc[k + q], jud[k + q] = d * acc[k + q] + reach * x, d * jud[k + q] + reach
                reach *= x
    expected = np.cumsum(np.cumprod(np.array(acc) / np.array(jud)))
    for rid, k, a, _ in entries:
        if k > 0:
            s_a, s_e, n = sums.get(rid, (0.0, 0.0, 0))
            sums[rid] = (0.7 * s_a + a, 0.7 * s_e + expected[k - 1], n + 1)
    return np.array(acc), np.array(jud), sums, seen


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 9), st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_a_batch_of_verifications_is_learnt_as_its_entries_one_by_one(block, seed, estimates, whole):
    """Both ways of adding the counts (entry by entry, and whole-array for a large batch:
    `WHOLE_BATCH_CELLS` moved so that every batch here takes the one under test)."""
    rng = np.random.default_rng(seed)
    t = AcceptanceTracker(block=block)
    for _ in range(2):  # a history first, then the batch under test
        entries = []
        for _ in range(int(rng.integers(0, 40 if rng.random() < 0.3 else 12))):
            k = int(rng.integers(0, block + 1))
            b = rng.uniform(0, 1, int(rng.integers(0, block + 1))) if estimates else None
            entries.append((int(rng.integers(0, 5)), k, int(rng.integers(0, k + 1)), b))
        want = sequential_learn(t, entries)
        with mock.patch.object(drafting, "WHOLE_BATCH_CELLS", 0 if whole else 1 << 60):
            t.learn(Verified.of([e[0] for e in entries], np.zeros(len(entries)), [e[1] for e in entries],
                                [e[2] for e in entries], [e[3] for e in entries] if estimates else None))
        assert np.allclose(t.accepted, want[0], rtol=1e-12) and np.allclose(t.judged, want[1], rtol=1e-12)
        assert t._sums.keys() == want[2].keys() and t.observations == want[3]
        assert all(np.allclose(t._sums[r], want[2][r], rtol=1e-12) for r in want[2])


def test_verified_entries_keep_their_estimates_through_then_and_of_kind():
    a = Verified.of([1, 2], [0, 1], [2, 1], [1, 1], [np.array([0.5]), np.array([0.25, 0.75])])
    b = Verified.of([3], [1], [4], [0])
    both = a.then(b)
    assert both.rids.tolist() == [1, 2, 3] and both.beyond_cu.tolist() == [0, 1, 3, 3]
    one = both.of_kind(1)
    assert one.rids.tolist() == [2, 3] and one.beyond.tolist() == [0.25, 0.75] and one.beyond_cu.tolist() == [0, 2, 2]
    assert Verified.from_dict(both.as_dict()).beyond.tolist() == both.beyond.tolist()
