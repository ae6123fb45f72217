"""The drafting gate's plan (dcut_core/planning.py): plain decoding when drafting cannot pay, full
drafts when it is free, the brute-force best where the scan is exact — and the plain-Python scan
for a few positions makes the array scan's plan to the last bit."""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core import planning
from dcut_core.drafting import DraftCost, DraftingCosts, Survival
from dcut_core.planning import DraftPlanner
from dcut_core.pruning import StepCost


def linear(fixed, per_token):
    return StepCost(lambda n: per_token * n.astype(np.float64), fixed)


def one_kind_plan(rows, verify, cost, catchup=None, **shape):
    """One kind's plan for ragged prediction rows."""
    return DraftPlanner(**shape).plan(Survival.of(rows), verify, DraftingCosts([cost]), catchup=catchup)


def test_free_drafting_and_flat_verification_draft_everything_worth_anything():
    plan = one_kind_plan([np.full(4, 0.8), np.full(4, 0.5)], linear(1.0, 0.0), DraftCost())
    assert plan.lengths.tolist() == [4, 4] and plan.drafting


def test_expensive_drafter_call_means_plain_decoding():
    plan = one_kind_plan([np.full(4, 0.6), np.full(4, 0.6)], linear(1.0, 0.01), DraftCost(fixed=5.0))
    assert plan.lengths.tolist() == [0, 0] and not plan.drafting
    assert plan.predicted_seconds == plan.ar_seconds == pytest.approx(1.02)


def test_per_request_cost_skips_weak_requests():
    # Drafting a request costs 0.3 s on top of a 1 s step; the 0.1-acceptance request is not worth it.
    plan = one_kind_plan([np.full(3, 0.95), np.full(3, 0.1)], linear(1.0, 0.0), DraftCost(per_request=0.3))
    assert plan.lengths[0] == 3 and plan.lengths[1] == 0


def test_slack_extends_only_drafting_requests_and_never_past_their_cap():
    rows = [np.array([0.9, 0.8, 0.1, 0.1, 0.1]), np.array([0.9, 0.1]), np.array([0.05, 0.05])]
    verify, cost = linear(1.0, 0.2), DraftCost(per_request=0.05)
    base = one_kind_plan(rows, verify, cost)
    assert base.lengths.tolist() == [2, 1, 0]
    wide = one_kind_plan(rows, verify, cost, slack=2)
    assert wide.lengths.tolist() == [4, 2, 0]
    assert wide.expected_tokens == base.expected_tokens  # the plan itself is unchanged


def test_slack_and_extension_add_no_pass_to_a_chained_kind():
    """A chained kind (MTP: one sequential pass a position, `per_pass`) is widened by slack and
    extension only as deep as the plan already drafts with it — a deeper position is one more
    pass for every request on the chain, which the plan did not price. A kind drafting all its
    positions in one pass (block, n-gram) keeps both."""
    rows = [np.array([0.9, 0.8, 0.5, 0.5, 0.5]), np.array([0.9, 0.1, 0.1]), np.array([0.95, 0.9, 0.9, 0.9])]
    verify = linear(1.0, 0.2)
    parallel = DraftCost(per_request=0.05, per_position=1e-4)
    chained = DraftCost(per_request=0.05, per_position=1e-4, per_pass=0.01)
    planner = DraftPlanner(slack=2, extend=True)
    for kinds in ([0, 1, 1], [1, 1, 1], [1, 0, 1]):
        kinds = np.array(kinds)
        costs = DraftingCosts([parallel, chained])
        plain = DraftPlanner().plan(Survival.of(rows), verify, costs, kinds)
        wide = planner.plan(Survival.of(rows), verify, costs, kinds)
        depth = plain.lengths[kinds == 1].max(initial=0)
        assert (wide.lengths[kinds == 1] <= depth).all(), (kinds, plain.lengths, wide.lengths)
        assert (wide.lengths >= plain.lengths).all() and wide.expected_tokens == plain.expected_tokens
        one = kinds == 0
        assert (wide.lengths[one] == np.where(plain.lengths[one] > 0, [len(rows[i]) for i in np.flatnonzero(one)],
                                              0)).all()  # the parallel kind: widened to every position


def test_plan_matches_brute_force_when_draft_cost_is_per_position():
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = [rng.uniform(0, 1, rng.integers(0, 4)) for _ in range(rng.integers(1, 4))]
        verify = linear(rng.uniform(0.5, 2), rng.uniform(0, 0.3))
        cost = DraftCost(fixed=rng.uniform(0, 1), per_position=rng.uniform(0, 0.2))
        plan = one_kind_plan(rows, verify, cost)

        def rate(k, rows=rows, verify=verify, cost=cost):
            tok = len(rows) + sum(float(np.cumprod(r)[:n].sum()) for r, n in zip(rows, k, strict=True))
            sec = verify.seconds(np.array([len(rows) + sum(k)]))[0] + cost.seconds(0, sum(k))
            return tok / float(sec)

        best = max(rate(k) for k in itertools.product(*[range(len(r) + 1) for r in rows]))
        assert rate(tuple(plan.lengths)) >= best * (1 - 1e-9)


def test_context_to_catch_up_is_charged_to_the_request_that_drafts():
    # Two equal requests in a 1 s step; the second has 1000 context tokens its drafter has not
    # seen yet. At 5 ms per token that catch-up (5 s) outweighs the 3.1 tokens drafting gains.
    rows = [np.full(4, 0.9), np.full(4, 0.9)]
    cost = DraftCost(per_request=0.01, per_context=0.005)
    plan = one_kind_plan(rows, linear(1.0, 0.01), cost, catchup=np.array([0, 1000]))
    assert plan.lengths.tolist() == [4, 0]
    # With nothing to catch up both draft; without the argument nothing changes.
    both = one_kind_plan(rows, linear(1.0, 0.01), cost, catchup=np.zeros(2))
    assert both.lengths.tolist() == [4, 4]
    assert one_kind_plan(rows, linear(1.0, 0.01), cost).lengths.tolist() == [4, 4]


def test_catch_up_plan_matches_brute_force_over_whole_requests():
    # Per-request costs make the plan a heuristic in general; when every request drafts all or
    # nothing (one position each) it is exact, so compare there.
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        rows = [rng.uniform(0, 1, 1) for _ in range(n)]
        catchup = rng.integers(0, 50, n)
        verify = linear(rng.uniform(0.5, 2), rng.uniform(0, 0.1))
        cost = DraftCost(fixed=rng.uniform(0, 0.3), per_request=rng.uniform(0, 0.05),
                         per_position=rng.uniform(0, 0.05), per_context=rng.uniform(0, 0.01))
        plan = one_kind_plan(rows, verify, cost, catchup=catchup)

        def rate(k, rows=rows, verify=verify, cost=cost, catchup=catchup):
            on = np.array(k) > 0
            tok = len(rows) + sum(float(r[0]) for r, d in zip(rows, on, strict=True) if d)
            sec = verify.seconds(np.array([len(rows) + sum(k)]))[0]
            if on.any():
                sec += cost.fixed + cost.per_request * on.sum() + cost.per_position * sum(k)
                sec += cost.per_context * catchup[on].sum()
            return tok / float(sec)

        best = max(rate(k) for k in itertools.product(*[range(2) for _ in rows]))
        # Sorted by survival, the scan may miss a cheaper subset (3000 random cases: worst 98.4 %).
        assert rate(tuple(plan.lengths)) >= best * 0.98


def test_extend_drafts_every_position_that_pays_for_its_own_drafting():
    # The verify curve makes only the first two positions of request 0 worth verifying, but
    # drafting a position costs almost nothing: pruning, with the drafts' real confidences,
    # decides what gets verified — so the drafter is asked for every position whose predicted
    # survival pays for drafting it, at the plan's own rate.
    rows = [np.array([0.9, 0.8, 0.5, 0.5, 0.5]), np.array([0.9, 0.1]), np.array([0.05, 0.05])]
    verify = linear(1.0, 0.2)
    cheap = one_kind_plan(rows, verify, DraftCost(per_request=0.05, per_position=1e-4), extend=True)
    assert cheap.lengths.tolist() == [5, 2, 0]  # request 2 still does not draft at all
    base = one_kind_plan(rows, verify, DraftCost(per_request=0.05, per_position=1e-4))
    assert base.lengths.tolist() == [2, 1, 0] and cheap.expected_tokens == base.expected_tokens
    # When a drafted position costs a lot, only those that pay are added (survival ≥ rate × cost).
    dear = one_kind_plan(rows, verify, DraftCost(per_request=0.05, per_position=0.1), extend=True)
    rate = dear.expected_tokens / dear.predicted_seconds
    surv = np.cumprod(rows[0])
    assert dear.lengths[0] == max(2, int((surv >= rate * 0.1).sum()))
    assert dear.lengths[2] == 0


@st.composite
def planning_questions(draw):
    """A plan's inputs: 0–6 requests of 1–3 kinds, rows of 0–9 predictions (ties and zeros
    included), kinds with fixed, per-pass (chained) and replica-call costs, catch-up or not, a
    concave or a stepped verify curve, and every planner shape."""
    k = draw(st.integers(1, 3))
    r = draw(st.integers(0, 6))
    rate = st.sampled_from([0.0, 0.1, 0.5, 0.5, 0.9, 0.99, 1.0]) | st.floats(0.0, 1.0)
    rows = [np.array(draw(st.lists(rate, max_size=9)), dtype=np.float64) for _ in range(r)]
    money = st.sampled_from([0.0, 0.0, 1e-4, 0.05]) | st.floats(0.0, 0.2)
    costs = [DraftCost(*(draw(money) for _ in range(5))) for _ in range(k)]
    remote = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    drafting = DraftingCosts(costs, draw(money), draw(money), np.array(remote))
    kinds = np.array([draw(st.integers(0, k - 1)) for _ in range(r)], dtype=np.int64) if draw(st.booleans()) \
        else None if k == 1 else np.zeros(r, dtype=np.int64)
    catchup = np.array([draw(st.integers(0, 40)) for _ in range(r)]) if draw(st.booleans()) else None
    base, per = draw(st.floats(0.5, 2.0)), draw(st.floats(0.0, 0.3))
    if draw(st.booleans()):
        verify = StepCost(lambda n: base + per * np.sqrt(n.astype(np.float64)), 0.0)
    else:  # stepped: equal seconds at neighbouring budgets (ties in the ratio)
        verify = StepCost(lambda n: base + per * (n.astype(np.float64) // 4), 0.0)
    planner = DraftPlanner(draw(st.none() | st.integers(0, 12)), draw(st.integers(0, 3)), draw(st.booleans()))
    return planner, Survival.of(rows), verify, drafting, kinds, catchup


@settings(max_examples=400, deadline=None)
@given(planning_questions())
def test_the_plain_python_scan_makes_the_array_scans_plan_to_the_last_bit(question):
    planner, survival, verify, costs, kinds, catchup = question
    seconds_at = verify.seconds(len(survival.lengths) + np.arange(int(survival.lengths.sum()) + 1))
    whole = planner._plan_whole(survival, seconds_at, costs, kinds, catchup)
    in_turn = planner._plan_in_turn(survival, seconds_at, costs, kinds, catchup)
    assert in_turn.lengths.dtype == whole.lengths.dtype
    assert in_turn.lengths.tolist() == whole.lengths.tolist()
    assert (in_turn.expected_tokens, in_turn.predicted_seconds, in_turn.ar_seconds) == \
        (whole.expected_tokens, whole.predicted_seconds, whole.ar_seconds)


def test_plan_takes_the_plain_python_scan_for_a_few_positions_and_the_array_scan_past_them():
    verify, costs = linear(1.0, 0.01), DraftingCosts([DraftCost(per_request=0.01)])
    few = Survival.of([np.full(7, 0.8)] * 2)
    many = Survival.of([np.full(7, 0.8)] * (planning.IN_TURN_CELLS // 7 + 1))
    spy = {name: mock.patch.object(DraftPlanner, name, autospec=True, side_effect=getattr(DraftPlanner, name))
           for name in ("_plan_in_turn", "_plan_whole")}
    with spy["_plan_in_turn"] as in_turn, spy["_plan_whole"] as whole:
        DraftPlanner().plan(few, verify, costs)
        assert (in_turn.call_count, whole.call_count) == (1, 0)
        DraftPlanner().plan(many, verify, costs)
        assert (in_turn.call_count, whole.call_count) == (1, 1)
