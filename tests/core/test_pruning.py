"""Pruning policies: exact hand cases, brute force optimality, hypothesis properties."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core.decision import choose_kept
from dcut_core.pruning import (
    Ar,
    Dcut,
    DcutBuckets,
    DraftBatch,
    FixedK,
    Full,
    Oracle,
    StepCost,
    Tetris,
    kept_top_m,
    policy_from_name,
)


def linear(fixed: float, per_token: float) -> StepCost:
    return StepCost(lambda n: per_token * n.astype(np.float64), fixed)


def objective(rows: list[np.ndarray], kept: tuple[int, ...], cost: StepCost) -> float:
    tokens = len(rows) + sum(float(r[:k].sum()) for r, k in zip(rows, kept, strict=True))
    return tokens / float(cost.seconds(np.array([len(rows) + sum(kept)]))[0])


def random_rows(rng: np.random.Generator, r: int, max_drafted: int) -> list[np.ndarray]:
    rows = []
    for _ in range(r):
        p = rng.uniform(0.0, 1.0, rng.integers(0, max_drafted + 1))
        if rng.random() < 0.3:  # coarse values make exact ties common
            p = np.round(p, 1)
        rows.append(np.cumprod(p))
    return rows


def random_cost(rng: np.random.Generator) -> StepCost:
    kind = rng.integers(3)
    fixed, a = rng.uniform(0.1, 2.0), rng.uniform(0.0, 0.5)
    if kind == 0:
        return linear(fixed, a)
    if kind == 1:  # knee: flat until a threshold, then linear
        knee = rng.integers(1, 12)
        return StepCost(lambda n: a * np.maximum(n - knee, 0).astype(np.float64), fixed)
    step = rng.integers(2, 6)  # padded shapes: a step function
    return StepCost(lambda n: a * np.ceil(n / step).astype(np.float64), fixed)


# -- exact hand cases ---------------------------------------------------------------------------


def test_dcut_hand_case():
    # fixed 1, each verify token 0.1. Keeping only the 0.9 draft: (2 + 0.9) / (1 + 0.3) = 2.2308;
    # adding 0.8·0.9 = 0.72: (2 + 1.62) / 1.4 = 2.5857; adding 0.5: (2 + 2.12) / 1.5 = 2.7467;
    # next best 0.1 (0.72·0.139) ... the scan finds the maximum among all budgets.
    rows = [np.array([0.9, 0.72, 0.1]), np.array([0.5, 0.05])]
    cost = linear(1.0, 0.1)
    kept = Dcut(guard_threshold=0.0, fill_step=False).choose(DraftBatch.from_rows(rows), cost).kept
    best = max(itertools.product(range(4), range(3)), key=lambda k: objective(rows, k, cost))
    assert tuple(kept) == best == (2, 1)


def test_dcut_keeps_nothing_when_verification_is_expensive():
    rows = [np.array([0.3, 0.1]), np.array([0.2])]
    d = Dcut(guard_threshold=0.0).choose(DraftBatch.from_rows(rows), linear(0.0, 1.0))
    assert d.kept.tolist() == [0, 0]
    assert d.expected_tokens == 2.0 and d.predicted_seconds == 2.0


def test_ties_go_to_the_smaller_budget():
    # Constant cost and a zero-survival draft: keeping it changes nothing, so it is pruned.
    rows = [np.array([0.5, 0.0])]
    assert choose_kept(rows, lambda n: 1.0).tolist() == [1]


def test_equal_survivals_are_taken_in_request_order_and_stay_prefix_closed():
    rows = [np.array([0.5, 0.5, 0.5]), np.array([0.5, 0.5])]
    batch = DraftBatch.from_rows(rows)
    # per-request budget 2 -> 4 of the 5 equal values: request 0 first, both prefixes.
    assert Tetris(2).choose(batch, linear(1, 0)).kept.tolist() == [3, 1]


def test_low_load_guard_keeps_everything_when_the_gain_is_small():
    rows = [np.array([0.9, 0.8, 0.3]), np.array([0.9, 0.2])]
    batch = DraftBatch.from_rows(rows)
    cost = linear(1.0, 0.08)  # pruning the 0.2 draft gains 1.2 %
    exact = Dcut(guard_threshold=0.0, fill_step=False).choose(batch, cost)
    assert exact.kept.sum() < 5 and not exact.guard
    guarded = Dcut(guard_threshold=0.5).choose(batch, cost)
    assert guarded.kept.tolist() == [3, 2] and guarded.guard


def test_step_cost_is_filled_with_the_next_best_drafts():
    # Cost jumps every 4 verify tokens; zero-survival drafts are free inside the paid step.
    rows = [np.array([0.9, 0.0, 0.0]), np.array([0.9, 0.0])]
    cost = StepCost(lambda n: np.ceil(n / 4.0), 0.0)
    bare = Dcut(guard_threshold=0.0, fill_step=False).choose(DraftBatch.from_rows(rows), cost)
    filled = Dcut(guard_threshold=0.0, fill_step=True).choose(DraftBatch.from_rows(rows), cost)
    assert bare.kept.tolist() == [1, 1]  # 4 tokens: one step
    assert filled.kept.sum() == 2  # 2 + 2 = 4 tokens already fill the step exactly
    rows = [np.array([0.9, 0.0, 0.0]), np.array([0.0, 0.0])]
    filled = Dcut(guard_threshold=0.0, fill_step=True).choose(DraftBatch.from_rows(rows), cost)
    assert filled.kept.sum() == 2 and filled.predicted_seconds == 1.0


def test_max_budget_caps_kept_drafts():
    rows = [np.full(8, 0.99), np.full(8, 0.98)]
    d = Dcut(max_budget=5).choose(DraftBatch.from_rows(rows), linear(1.0, 0.0))
    assert d.kept.sum() == 5


def test_simple_policies():
    rows = [np.array([0.9, 0.5, 0.1]), np.array([0.8]), np.array([])]
    batch = DraftBatch.from_rows(rows)
    cost = linear(1.0, 0.1)
    assert Ar().choose(batch, cost).kept.tolist() == [0, 0, 0]
    assert Full().choose(batch, cost).kept.tolist() == [3, 1, 0]
    assert FixedK(2).choose(batch, cost).kept.tolist() == [2, 1, 0]
    assert FixedK(2).name == "fixed-2"
    assert Tetris(1).choose(batch, cost).kept.tolist() == [2, 1, 0]  # top-3: 0.9, 0.8, 0.5


def test_buckets_only_use_the_listed_keep_ratios():
    rows = [np.linspace(0.9, 0.1, 8), np.linspace(0.8, 0.05, 8)]
    batch = DraftBatch.from_rows(rows)
    for per_token in (0.0, 0.02, 0.1, 0.5, 5.0):
        d = DcutBuckets().choose(batch, linear(1.0, per_token))
        assert d.kept.sum() in {4, 8, 12, 16}


def test_oracle_keeps_exactly_the_accepted_drafts_when_tokens_cost_something():
    rows = [np.array([0.9, 0.8, 0.7]), np.array([0.9, 0.9])]
    batch = DraftBatch.from_rows(rows, accepted_len=[1, 2])
    assert Oracle().choose(batch, linear(1.0, 0.01)).kept.tolist() == [1, 2]
    with pytest.raises(ValueError):
        Oracle().choose(DraftBatch.from_rows(rows), linear(1.0, 0.01))


def test_bad_survivals_are_rejected():
    with pytest.raises(ValueError, match="non-increasing"):
        choose_kept([np.array([0.2, 0.5])], lambda n: 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        choose_kept([np.array([1.5])], lambda n: 1.0)
    with pytest.raises(ValueError, match="positive"):
        choose_kept([np.array([0.5])], lambda n: 0.0)
    # a rise across a request boundary is fine
    assert choose_kept([np.array([0.1]), np.array([0.9])], lambda n: 1.0).tolist() == [1, 1]
    # a value that is not a probability, wherever it sits: first, last, alone, repeated, inside a
    # row, in a 2-D array (the range is read from each row's ends once the rows are non-increasing)
    for bad in (np.nan, np.inf, -np.inf, -0.1, 1.5):
        for rows in ([np.array([bad])], [np.array([0.5, 0.4]), np.array([bad, 0.3])], [np.array([0.6, bad])],
                     [np.array([bad, bad])], [np.array([0.9, bad, 0.1])],
                     [np.array([]), np.array([0.5, bad]), np.array([0.2])], np.array([[0.9, 0.8], [0.7, bad]])):
            with pytest.raises(ValueError, match=r"\[0, 1\]"):
                choose_kept(rows, lambda n: 1.0)


def test_policy_names():
    assert policy_from_name("fixed-3", block=8).name == "fixed-3"
    assert policy_from_name("dcut", block=8, guard_threshold=0.1).guard_threshold == 0.1
    for name in ("ar", "full", "tetris", "dcut-buckets", "dcut", "oracle"):
        assert policy_from_name(name, block=16).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        policy_from_name("fastest", block=8)
    with pytest.raises(ValueError):
        policy_from_name("fixed-9", block=8)


# -- brute force --------------------------------------------------------------------------------


def test_dcut_reaches_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(400):
        rows = random_rows(rng, int(rng.integers(1, 5)), 5)
        cost = random_cost(rng)
        plans = list(itertools.product(*[range(len(r) + 1) for r in rows]))
        values = np.array([objective(rows, k, cost) for k in plans])
        best = values.max()
        min_budget = min(sum(k) for k, v in zip(plans, values, strict=True) if v >= best * (1 - 1e-12))
        kept = choose_kept(rows, lambda n, c=cost: float(c.seconds(np.array([n]))[0]))
        assert objective(rows, tuple(kept), cost) >= best * (1 - 1e-12)
        assert kept.sum() == min_budget
        assert all(0 <= k <= len(r) for k, r in zip(kept, rows, strict=True))


def test_the_survival_floor_changes_no_decision():
    """Dropping drafts below rate_lb · min_marginal before the sort is exact: same kept counts,
    guard and prediction as the full scan, on random batches (ties included) and fitted curves."""
    from dcut_core.cost_model import preset
    from dcut_core.hardware import MODELS

    rng = np.random.default_rng(7)
    for trial in range(400):
        rows = random_rows(rng, int(rng.integers(1, 40)), 16)
        if trial % 2:
            cm = preset(MODELS["moe-35b-a3b"], "h20", ep=int(rng.choice([1, 8])))
            with_floor = cm.verify_curve(len(rows), int(rng.integers(0, 50_000)))
        else:
            fixed, a = rng.uniform(0.1, 2.0), rng.uniform(0.001, 0.5)
            with_floor = StepCost(lambda n, a=a: a * n.astype(np.float64), fixed, min_marginal=a)
        assert with_floor.min_marginal > 0
        without = StepCost(with_floor.verify_seconds, with_floor.fixed_seconds)
        batch = DraftBatch.from_rows(rows)
        for policy in (Dcut(), Dcut(guard_threshold=0.0), Dcut(guard_threshold=0.3)):
            a, b = policy.choose(batch, with_floor), policy.choose(batch, without)
            assert a.kept.tolist() == b.kept.tolist() and a.guard == b.guard
            assert a.predicted_seconds == pytest.approx(b.predicted_seconds)


def test_a_tabulated_curve_answers_as_the_curve_inside_and_outside_its_table():
    """`StepCost.tabulated` (the engine's step: one table for the gate and pruning) gives every
    value the curve gives, and every policy the same decision, at counts inside its table and
    beyond it."""
    from dcut_core.cost_model import preset
    from dcut_core.hardware import MODELS

    rng = np.random.default_rng(3)
    for trial in range(200):
        rows = random_rows(rng, int(rng.integers(1, 12)), 8)
        cost = (preset(MODELS["moe-35b-a3b"], "h20", ep=8).verify_curve(len(rows), int(rng.integers(0, 9000)))
                if trial % 2 else random_cost(rng))
        r, n = len(rows), sum(len(x) for x in rows)
        table = cost.tabulated(r, r + int(rng.integers(0, n + 1)))  # at times shorter than the drafts
        assert table.min_marginal == cost.min_marginal
        counts = np.arange(r, r + n + 4, dtype=np.int64)
        assert table.seconds(counts).tolist() == cost.seconds(counts).tolist()
        assert table.seconds(counts[::-1]).tolist() == cost.seconds(counts[::-1]).tolist()
        batch = DraftBatch.from_rows(rows)
        for policy in (Dcut(), Dcut(guard_threshold=0.0), Dcut(max_budget=3), DcutBuckets()):
            a, b = policy.choose(batch, table), policy.choose(batch, cost)
            assert a.kept.tolist() == b.kept.tolist() and a.guard == b.guard
            assert a.predicted_seconds == b.predicted_seconds


def test_guarded_dcut_never_loses_more_than_the_threshold():
    rng = np.random.default_rng(1)
    for _ in range(300):
        rows = random_rows(rng, int(rng.integers(1, 5)), 5)
        cost = random_cost(rng)
        batch = DraftBatch.from_rows(rows)
        best = Dcut(guard_threshold=0.0, fill_step=False).choose(batch, cost)
        for policy in (Dcut(), Dcut(guard_threshold=0.1), DcutBuckets(), Tetris(2), Full()):
            d = policy.choose(batch, cost)
            assert d.expected_rate <= best.expected_rate * (1 + 1e-12)
        assert Dcut(guard_threshold=0.1).choose(batch, cost).expected_rate >= best.expected_rate / 1.1


def test_oracle_beats_every_policy_on_realised_tokens():
    rng = np.random.default_rng(2)
    for _ in range(200):
        rows = random_rows(rng, int(rng.integers(1, 5)), 5)
        acc = [int(rng.integers(0, len(r) + 1)) for r in rows]
        batch = DraftBatch.from_rows(rows, accepted_len=acc)
        cost = random_cost(rng)

        def realised(kept, acc=acc, cost=cost):
            toks = len(acc) + sum(min(int(k), a) for k, a in zip(kept, acc, strict=True))
            return toks / float(cost.seconds(np.array([len(acc) + int(sum(kept))]))[0])

        oracle = realised(Oracle().choose(batch, cost).kept)
        for policy in (Dcut(), Full(), FixedK(2), Tetris(2), DcutBuckets(), Ar()):
            assert realised(policy.choose(batch, cost).kept) <= oracle * (1 + 1e-12)


# -- properties ---------------------------------------------------------------------------------

survival_rows = st.lists(
    st.lists(st.floats(0.0, 1.0, allow_nan=False), max_size=8).map(
        lambda p: np.cumprod(np.array(p, dtype=np.float64))
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(rows=survival_rows, budget=st.integers(0, 70))
def test_top_budget_is_prefix_closed_and_monotone(rows, budget):
    batch = DraftBatch.from_rows(rows)
    total = int(batch.drafted.sum())
    a = Dcut(max_budget=budget, guard_threshold=0.0, fill_step=False).choose(batch, linear(1, 0)).kept
    b = Dcut(max_budget=budget + 1, guard_threshold=0.0, fill_step=False).choose(batch, linear(1, 0)).kept
    # With free verification every positive-survival draft is worth keeping, up to the cap.
    assert a.sum() <= min(budget, total)
    assert (a <= batch.drafted).all() and (a >= 0).all()
    assert (b >= a).all()  # a larger budget never drops a draft it kept before
    kept_values = np.concatenate([r[:k] for r, k in zip(rows, a, strict=True)] + [np.zeros(0)])
    dropped = np.concatenate([r[k:] for r, k in zip(rows, a, strict=True)] + [np.zeros(0)])
    if len(kept_values) and len(dropped):
        assert kept_values.min() >= dropped.max()  # the kept set is a global top-m


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), max_size=6).map(
    lambda p: np.sort(np.array(p, dtype=np.float64))[::-1]), min_size=1, max_size=8), data=st.data())
def test_kept_top_m_is_the_global_top_m_with_ties_in_flat_order(rows, data):
    """Against the obvious reference: sort every draft by (−survival, flat index), keep the first
    m, count them per request. Few distinct values, so ties straddle the m-th value often; also
    when the caller names a superset of the top m (`within`, as the floored scan does)."""
    batch = DraftBatch.from_rows(rows)
    s, n = batch.survival, len(batch.survival)
    m = data.draw(st.integers(0, n))
    order = sorted(range(n), key=lambda i: (-s[i], i))
    owner = np.repeat(np.arange(len(rows)), batch.drafted)
    want = np.bincount(owner[order[:m]], minlength=len(rows))
    order_desc = np.sort(s)[::-1]
    assert kept_top_m(batch, order_desc, m).tolist() == want.tolist()
    if m:
        within = np.flatnonzero(s >= order_desc[m - 1] - data.draw(st.sampled_from([0.0, 0.3])))
        assert kept_top_m(batch, order_desc, m, within).tolist() == want.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_prefix_counts_by_runs_and_by_search_count_each_requests_prefix(sizes):
    """Both ways of counting a plan's kept entries (binary search; runs of taken entries, from
    `RUNS_FROM` requests) against a count of each request's own, with empty requests and
    prefixes that fill a request up to the next one's first entry."""
    from dcut_core.ragged import offsets_from_lengths, prefix_counts

    drafted = np.array([d for d, _ in sizes], dtype=np.int64)
    want = np.minimum(drafted, [k for _, k in sizes])
    cu = offsets_from_lengths(drafted)
    take = np.concatenate([np.arange(cu[i], cu[i] + want[i]) for i in range(len(sizes))]).astype(np.int64)
    for runs in (False, True, None):
        got = prefix_counts(take, cu, runs)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()


@settings(max_examples=150, deadline=None)
@given(rows=survival_rows, fixed=st.floats(0.01, 10.0), a=st.floats(0.0, 2.0), factor=st.floats(1.0, 10.0))
def test_budget_shrinks_as_verify_tokens_get_dearer(rows, fixed, a, factor):
    """Dearer verify tokens never keep more drafts — but where the plans' rates differ by less
    than float rounding (a draft's gain and its cost both ~1e-16 of the step: hypothesis found
    survivals of 2.2e-16 at a per-token cost of 2.2e-16) either plan is the argmax, and the
    rounding, not the cost, decides."""
    batch = DraftBatch.from_rows(rows)
    exact = Dcut(guard_threshold=0.0, fill_step=False)
    cheap_cost, dear_cost = linear(fixed, a), linear(fixed, a * factor)
    cheap = exact.choose(batch, cheap_cost).kept
    dear = exact.choose(batch, dear_cost).kept
    if dear.sum() > cheap.sum():
        for cost in (cheap_cost, dear_cost):
            one, other = objective(rows, tuple(cheap.tolist()), cost), objective(rows, tuple(dear.tolist()), cost)
            assert one == pytest.approx(other, rel=1e-12)


def test_choose_kept_calls_a_vectorisable_cost_once_with_an_array():
    calls = []

    def cost(n):
        calls.append(n)
        return 0.004 + 0.0002 * np.asarray(n, dtype=np.float64)

    rows = [np.cumprod(np.full(8, p)) for p in (0.9, 0.6, 0.3)]
    kept = choose_kept(rows, cost, fixed_cost=0.001)
    assert len(calls) == 1 and isinstance(calls[0], np.ndarray)
    assert kept.tolist() == choose_kept(rows, lambda n: float(cost(int(n))), fixed_cost=0.001).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=6), min_size=1, max_size=6),
       st.floats(1e-4, 1e-2), st.floats(0.0, 1e-3), st.integers(0, 6))
def test_choose_kept_is_the_same_whether_the_cost_takes_arrays_or_ints(probs, fixed, per_token, knee):
    rows = [np.cumprod(np.sort(np.asarray(p))[::-1]) for p in probs]
    vector = lambda n: fixed + per_token * np.maximum(np.asarray(n, dtype=np.float64) - knee, 0)  # noqa: E731
    scalar = lambda n: fixed + per_token * max(n - knee, 0)  # noqa: E731  (fails on arrays: per-count path)
    assert choose_kept(rows, vector).tolist() == choose_kept(rows, scalar).tolist()


def test_policies_say_what_they_need_of_the_engine():
    from dcut_core.pruning import policy_from_name

    caps = {n: (p.drafts, p.needs_cost_model, p.gated, p.needs_truth)
            for n in ("ar", "full", "fixed-4", "tetris", "dcut-buckets", "dcut", "oracle")
            for p in [policy_from_name(n, 8)]}
    assert caps == {"ar": (False, False, False, False), "full": (True, False, False, False),
                    "fixed-4": (True, False, False, False), "tetris": (True, False, False, False),
                    "dcut-buckets": (True, True, False, False), "dcut": (True, True, True, False),
                    "oracle": (True, True, False, True)}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5), st.integers(0, 5), st.integers(0, 2**31))
def test_a_2d_array_flattens_as_its_rows(r, k, seed):
    from dcut_core.ragged import flatten

    x = np.random.default_rng(seed).random((r, k))
    flat, cu = flatten(x)
    ref_flat, ref_cu = flatten(list(x))
    assert np.array_equal(flat, ref_flat) and np.array_equal(cu, ref_cu)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50_000), max_size=6), max_size=12))
def test_token_lists_flatten_as_arrays_of_their_rows_do(rows):
    from dcut_core.ragged import flatten

    flat, cu = flatten(rows, dtype=np.int64)  # lists: one pass over them all
    ref_flat, ref_cu = flatten([np.asarray(r, dtype=np.int64) for r in rows], dtype=np.int64)  # row by row
    assert flat.dtype == np.int64 and np.array_equal(flat, ref_flat) and np.array_equal(cu, ref_cu)
    nested, nested_cu = flatten([[r] for r in rows if r], dtype=np.int64)  # rows of rows flatten each row
    assert np.array_equal(nested, np.concatenate([r for r in rows if r] or [[]]).astype(np.int64))
    assert np.array_equal(nested_cu, np.cumsum([0] + [len(r) for r in rows if r]))


def test_a_curve_beside_fed_tokens_is_the_same_forward_further_on():
    curve = StepCost(lambda n: 1e-3 * np.sqrt(np.asarray(n, dtype=np.float64)) + 2e-3, 0.5e-3, 1e-5)
    assert curve.beside(0) is curve
    n = np.arange(1, 40)
    np.testing.assert_array_equal(curve.beside(70).seconds(n), curve.seconds(n + 70))
    assert curve.beside(70).min_marginal == curve.min_marginal


def test_choose_kept_bounded_by_its_costs_least_step_decides_as_the_full_scan():
    """`choose_kept` drops drafts below the floor its cost's least step between counts allows;
    on random batches (ties frequent) and linear, knee and padded costs (no floor where a step
    is flat) it keeps what the full scan without a bound keeps."""
    rng = np.random.default_rng(46)
    for _ in range(400):
        rows = random_rows(rng, int(rng.integers(1, 30)), 16)
        cost = random_cost(rng)
        if rng.random() < 0.5:  # a strictly rising cost: the floor applies
            cost = StepCost(lambda n, c=cost: c.verify_seconds(n) + 1e-3 * n, cost.fixed_seconds)
        full = Dcut(fill_step=False, guard_threshold=0.0).choose(DraftBatch.from_rows(rows), cost).kept
        vector = choose_kept(rows, cost.verify_seconds, cost.fixed_seconds)
        scalar = choose_kept(rows, lambda n, c=cost: float(c.verify_seconds(np.array([n]))[0]), cost.fixed_seconds)
        counts = len(rows) + np.arange(sum(map(len, rows)) + 1)
        told = choose_kept(rows, cost.verify_seconds, cost.fixed_seconds,  # the bound given: asked lazily
                           min_step=float(np.diff(cost.verify_seconds(counts)).min(initial=0.0)))
        assert vector.tolist() == full.tolist() == scalar.tolist() == told.tolist()


def test_dcut_in_plain_python_decides_as_the_array_code_to_the_last_bit():
    """`Dcut._choose_in_turn` (a few drafts) against `_choose_whole` on random batches with
    frequent ties, every kind of cost (a floor or none, padded steps), each setting: the same
    kept counts, guard, and expected tokens and seconds bit for bit."""
    from dcut_core.cost_model import preset
    from dcut_core.hardware import MODELS

    rng = np.random.default_rng(11)
    policies = (Dcut(), Dcut(guard_threshold=0.0), Dcut(guard_threshold=0.3), Dcut(fill_step=False),
                Dcut(max_budget=3), Dcut(max_budget=0), Dcut(guard_threshold=0.0, fill_step=False))
    for trial in range(600):
        rows = random_rows(rng, int(rng.integers(1, 9)), 8)
        if trial % 3 == 0:
            cost = preset(MODELS["moe-35b-a3b"], "h20", ep=int(rng.choice([1, 8]))).verify_curve(
                len(rows), int(rng.integers(0, 50_000)))
        elif trial % 3 == 1:
            a = rng.uniform(0.001, 0.5)
            cost = StepCost(lambda n, a=a: a * n.astype(np.float64), rng.uniform(0.1, 2.0), min_marginal=a)
        else:
            cost = random_cost(rng)
        batch = DraftBatch.from_rows(rows)
        for policy in policies:
            a, b = policy._choose_in_turn(batch, cost), policy._choose_whole(batch, cost)
            assert a.kept.dtype == b.kept.dtype and a.kept.tolist() == b.kept.tolist() and a.guard == b.guard
            assert (a.expected_tokens, a.predicted_seconds) == (b.expected_tokens, b.predicted_seconds)


def test_dcut_takes_the_plain_python_path_for_a_few_drafts_and_the_array_code_past_them():
    from unittest import mock

    from dcut_core import pruning

    few = DraftBatch.from_rows([np.full(7, 0.8)] * 2)
    many = DraftBatch.from_rows([np.full(7, 0.8)] * (pruning.IN_TURN_DRAFTS // 7 + 1))
    spy = {name: mock.patch.object(Dcut, name, autospec=True, side_effect=getattr(Dcut, name))
           for name in ("_choose_in_turn", "_choose_whole")}
    with spy["_choose_in_turn"] as in_turn, spy["_choose_whole"] as whole:
        Dcut().choose(few, linear(1.0, 0.01))
        assert (in_turn.call_count, whole.call_count) == (1, 0)
        Dcut().choose(many, linear(1.0, 0.01))
        assert (in_turn.call_count, whole.call_count) == (1, 1)
