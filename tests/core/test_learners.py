"""The drafting-cost learner: its level correction and refits (dcut_core/learners.py)."""

import math

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dcut_core.drafting import DraftCost
from dcut_core.learners import DraftCostLearner, RateFit

TRUE = DraftCost(2e-3, 4e-4, 1e-4, 2e-5, 1e-3)
SHAPES = [(r, r * n, c, n) for r in (1, 4, 16) for n in (1, 3, 7) for c in (0, 50)]


def seconds(cost: DraftCost, shape) -> float:
    return float(cost.seconds(*shape))


def test_the_level_follows_measured_passes_between_refits():
    """Passes measured at 2 × the start-up profile's price: from the first one on, every shape
    is priced 2 × (the correction is a level, the rates' shape is kept until a refit)."""
    fit = RateFit(TRUE, refit_every=1000)
    fit.observe(16, 112, 2 * seconds(TRUE, (16, 112, 0, 7)), 0, 7)
    for shape in SHAPES:
        assert math.isclose(seconds(fit.cost, shape), 2 * seconds(TRUE, shape), rel_tol=1e-9)
    fit.observe(1, 7, 8 * seconds(TRUE, (1, 7, 0, 7)), 0, 7)  # the running mean of the log ratios: 4 ×
    assert math.isclose(seconds(fit.cost, (4, 12, 0, 3)), 4 * seconds(TRUE, (4, 12, 0, 3)), rel_tol=1e-9)


def test_a_refit_recovers_the_rates_and_restarts_the_level():
    """Noise-free passes of a true cost, the learner seeded at half of it: the level corrects at
    once, and the refit after 16 distinct shapes prices every shape as the true cost — not
    the true cost times the old correction."""
    fit = RateFit(DraftCost(*(0.5 * np.array([TRUE.fixed, TRUE.per_request, TRUE.per_position,
                                                 TRUE.per_context, TRUE.per_pass]))), refit_every=16)
    for shape in SHAPES[:16]:
        fit.observe(shape[0], shape[1], seconds(TRUE, shape), shape[2], shape[3])
    assert fit.due
    fit.settle()  # the refit the 16th pass made due
    assert fit.log_ratio == 0.0 and not fit.due
    for shape in SHAPES:
        assert math.isclose(seconds(fit.cost, shape), seconds(TRUE, shape), rel_tol=1e-6)
    fit.observe(2, 6, seconds(TRUE, (2, 6, 0, 3)), 0, 3)  # exact again: the level stays 1
    assert math.isclose(fit.log_ratio, 0.0, abs_tol=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 15), st.integers(0, 500),
                          st.floats(0.25, 4.0)), min_size=1, max_size=15))
def test_the_level_is_the_geometric_mean_of_the_ratios(passes):
    """Before any refit, the cost is the seed's times the geometric mean of measured / seeded
    over the passes seen (a brute-force reference)."""
    fit = RateFit(TRUE, refit_every=1000)
    ratios = []
    for r, n, c, f in passes:
        shape = (r, r * n, c, n)
        fit.observe(r, r * n, f * seconds(TRUE, shape), c, n)
        ratios.append(f)
    level = math.exp(np.mean(np.log(ratios)))
    assert math.isclose(seconds(fit.cost, (8, 40, 10, 5)), level * seconds(TRUE, (8, 40, 10, 5)), rel_tol=1e-9)


def test_restored_costs_are_used_as_saved_and_a_free_kind_learns_only_by_refit():
    learner = DraftCostLearner(2, free=(1,))
    learner.restore([TRUE, None], 3e-4)
    assert learner.costs[0] == TRUE and learner.shared == 3e-4
    learner.observe_kind(1, 4, 20, 1e-4, 0, 5)  # a free kind's zero price has no level to correct
    assert seconds(learner.costs[1], (4, 20, 0, 5)) == 0.0


def test_what_one_request_cannot_tell_apart_stays_where_it_was():
    """At one request every pass has requests = 1 and a chain's positions = passes: the fit
    cannot split a call's time from a request's, nor a position's from a pass's. The refit
    prices those passes exactly and moves the current cost the least it must (equal shifts on
    columns the passes see alike, no rate below zero) — not to an arbitrary split, which prices
    the same passes very differently at four requests."""
    seed = DraftCost(1.2e-3, 0.0, 3e-5, 3e-5, 1.2e-3)
    data = DraftCost(1.0e-3, 0.0, 2e-4, 3e-5, 1.1e-3)  # sums per column pair: 1.0e-3 and 1.3e-3
    fit = RateFit(seed, refit_every=1000)
    shapes = [(1, n, c, n) for n in (1, 2, 3, 5, 7) for c in (0, 1, 4)]
    for r, p, c, n in shapes:
        fit.observe(r, p, seconds(data, (r, p, c, n)), c, n)
    now = fit.cost  # the seed at the passes' level (the correction before the refit)
    fit.refit()
    got = fit.fitted
    for shape in shapes:
        assert math.isclose(seconds(got, shape), seconds(data, shape), rel_tol=1e-6)
    assert got.per_request < 1e-9 and math.isclose(got.fixed, 1.0e-3, rel_tol=1e-6)
    shift = 1.3e-3 - (now.per_position + now.per_pass)
    assert math.isclose(got.per_position, now.per_position + shift / 2, rel_tol=1e-4)
    assert math.isclose(got.per_pass, now.per_pass + shift / 2, rel_tol=1e-4)
    assert math.isclose(got.per_context, data.per_context, rel_tol=1e-6)  # the catch-up varied: measured


def test_a_rate_no_pass_measured_keeps_its_value():
    """Passes with no catch-up say nothing of its rate: the refit keeps it (an unpinned fit set it
    to 0, and the next switch of kind was priced free)."""
    fit = RateFit(TRUE, refit_every=1000)
    for r, p, _, n in SHAPES:
        fit.observe(r, p, seconds(TRUE, (r, p, 0, n)), 0, n)
    fit.refit()
    assert math.isclose(fit.fitted.per_context, TRUE.per_context, rel_tol=1e-6)
    for shape in SHAPES:
        assert math.isclose(seconds(fit.fitted, shape), seconds(TRUE, shape), rel_tol=1e-6)


RATE = st.one_of(st.just(0.0), st.floats(1e-7, 3e-3))  # seconds: none, or 0.1 µs to 3 ms


@settings(max_examples=60, deadline=None)
@given(st.lists(RATE, min_size=5, max_size=5), st.lists(RATE, min_size=5, max_size=5))
@example([2 ** -9, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2 ** -9, 1e-7])  # found by hypothesis (session 32)
def test_measured_rates_are_recovered_from_any_current_cost(true, now):
    """Passes of every shape, noise-free: whatever the current cost, the refit finds the true
    rates (the pull toward the current cost does not bias what the passes measure; columns of
    rates 100 × apart are solved at one scale). The pull is not nothing: a current cost of 2 ms
    a context token where the passes measure none leaves ~1e-9 s a token, 3e-5 of a pass at the
    measured contexts (≤ 50 tokens) and 3e-4 at ten times that, hence the looser tolerance for
    the shape past every measured one."""
    true_cost, fit = DraftCost(*true), RateFit(DraftCost(*now), refit_every=1000)
    if seconds(true_cost, (1, 1, 0, 1)) <= 0:
        return
    for r, p, c, n in SHAPES:
        fit.observe(r, p, seconds(true_cost, (r, p, c, n)), c, n)
    fit.refit()
    for shape, tol in [*((s, 1e-4) for s in SHAPES), ((64, 64 * 15, 500, 15), 1e-3)]:
        assert math.isclose(seconds(fit.fitted, shape), seconds(true_cost, shape), rel_tol=tol, abs_tol=1e-9)


def test_refits_come_every_refit_every_passes_also_once_the_window_is_full():
    """The kept passes stop growing at `keep`; refits still come one in `refit_every` passes (a
    count of the kept ones refitted at every pass once it reached `keep`, 1–2 ms each in the
    step: docs/benchmarks.md, session 24), each made by `settle`, off the drafting stage."""
    fit = RateFit(TRUE, refit_every=16, keep=64)
    refits, made = [], RateFit.refit
    fit.refit = lambda: (refits.append(fit._passes), made(fit))
    rng = np.random.default_rng(0)
    for _ in range(64 + 5 * 16 + 3):
        r, n = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        fit.observe(r, r * n, seconds(TRUE, (r, r * n, 0, n)), 0, n)
        assert len(refits) == (fit._passes - 1) // 16  # observing marks a refit due, never makes it
        fit.settle()  # where the engine learns from the step
        assert not fit.due
    assert refits == list(range(16, 64 + 5 * 16 + 1, 16))
