"""The drafting-cost learner: its level correction and refits (dcut_core/learners.py)."""

import math

import numpy as np
from hypothesis import given, settings
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
    assert fit.log_ratio == 0.0
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
