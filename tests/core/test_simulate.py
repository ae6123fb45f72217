"""The simulator: exact small cases, then the published reproduction it exists for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcut_core.cost_model import preset
from dcut_core.drafting import DraftCost
from dcut_core.pruning import Ar, Dcut, Full, policy_from_name
from dcut_core.published import (
    BATCHES,
    DENSE_SPEEDUP,
    DENSE_VERIFY_MS,
    EQUAL_BUDGET,
    PUBLISHED_TRACE,
    equal_budget,
    fit_dense_ar,
)
from dcut_core.simulate import LinearAr, SimConfig, TableCost, fit_ar, simulate
from dcut_core.traces import RecordedTrace, SyntheticTrace


def fixed_trace(accepted: int, drafts: int = 7, conf: float = 0.9) -> RecordedTrace:
    """Every request, every step: the same confidences and the same accepted length."""
    return RecordedTrace(np.full((1, drafts), conf), np.array([drafts]), np.array([accepted]))


def test_table_cost_hits_the_table_and_interpolates_linearly():
    t = DENSE_VERIFY_MS
    assert t.seconds(16, np.array([16 * 8]))[0] == pytest.approx(22.7e-3)
    assert t.seconds(64, np.array([64 * 16]))[0] == pytest.approx(133.9e-3)
    # B = 8 lies a third of the way from 4 to 16; 10 tokens per request between columns 8 and 12
    want = (2 / 3) * (8.7 + 0.5 * (9.7 - 8.7)) + (1 / 3) * (22.7 + 0.5 * (29.8 - 22.7))
    assert t.seconds(8, np.array([80]))[0] == pytest.approx(want * 1e-3)
    # below the first column: the line through the first two, never under the floor
    assert t.seconds(4, np.array([4]))[0] == pytest.approx((8.2 - 3 * 0.125) * 1e-3)
    assert TableCost((1, 2), (1.0, 2.0), ((1.0, 5.0), (1.0, 5.0)), floor_ms=0.5).seconds(1, np.array([0]))[0] == 5e-4


def test_full_policy_on_a_fixed_trace_is_exact():
    cost = TableCost((1, 8), (1.0, 8.0), ((2.0, 9.0), (2.0, 9.0)))  # 1 ms per verify token per request + 1 ms
    r = simulate(Full(), SimConfig(batch=2, block=8, steps=10, output_len=1000), fixed_trace(3), cost.curve,
                 lambda b: 2e-3)
    assert r.mat == 4.0  # 3 accepted + bonus, every step
    assert r.seconds == pytest.approx(10 * 9e-3)
    assert r.keep_ratio == 1.0
    assert r.speedup == pytest.approx((80 / 0.09) / (2 / 2e-3))


def test_ar_policy_matches_its_own_cost_and_requests_end():
    cost = TableCost((1, 4), (1.0, 2.0), ((1.0, 2.0), (1.0, 2.0)))
    r = simulate(Ar(), SimConfig(batch=4, block=8, steps=50, output_len=7), fixed_trace(5), cost.curve,
                 lambda b: 1e-3)
    assert r.mat == 1.0 and r.kept == 0 and r.speedup == pytest.approx(1.0)
    # requests of 7 tokens that accept 5 drafts make 6 then 1 token: MAT 3.5 over their 2 steps
    full = simulate(Full(), SimConfig(batch=4, block=8, steps=50, output_len=7), fixed_trace(5), cost.curve,
                    lambda b: 1e-3)
    assert full.mat == pytest.approx(3.5)


def test_draft_cost_is_charged_per_call_request_and_draft():
    cost = TableCost((1, 8), (1.0, 8.0), ((1.0, 1.0), (1.0, 1.0)))
    cfg = SimConfig(batch=2, block=8, steps=5, output_len=1000, draft_cost=DraftCost(1e-3, 1e-3, 1e-4))
    r = simulate(Full(), cfg, fixed_trace(2), cost.curve, lambda b: 1e-3)
    assert r.seconds == pytest.approx(5 * (1e-3 + 1e-3 + 2e-3 + 14e-4))


def test_fit_ar_recovers_a_line_and_stays_non_negative():
    ar = fit_ar([4, 8, 16, 64], [0.005 + 0.0002 * b for b in (4, 8, 16, 64)])
    assert ar.a == pytest.approx(0.005) and ar.b == pytest.approx(0.0002)
    assert fit_ar([4, 8], [0.01, 0.005]).b == 0.0
    assert isinstance(fit_ar([1, 2], [0.001, 0.004]), LinearAr)


def test_recorded_trace_reads_unpruned_steps_only():
    records = [
        {"drafted": [2, 3], "kept": [2, 3], "accepted": [1, 3], "survival": [0.8, 0.4, 0.9, 0.9, 0.45]},
        {"drafted": [2], "kept": [1], "accepted": [1], "survival": [0.5, 0.1]},  # pruned: censored
    ]
    t = RecordedTrace.from_steps(records)
    assert t.accepted.tolist() == [1, 3] and t.lengths.tolist() == [2, 3] and t.block == 4
    np.testing.assert_allclose(t.conditional[0, :2], [0.8, 0.5])
    np.testing.assert_allclose(t.conditional[1], [0.9, 1.0, 0.5])
    draw = t.draw(np.random.default_rng(0), np.zeros(5), 3)
    assert draw.accepted.tolist() == [3] * 5  # only the second row has 3 drafts
    with pytest.raises(ValueError, match="unpruned"):
        RecordedTrace.from_steps(records[1:])


def test_synthetic_trace_accepted_length_follows_its_confidences():
    tr = SyntheticTrace(mean=0.8, concentration=4.0, token_noise=1.0, conf_noise=0.0)
    rng = np.random.default_rng(1)
    d = tr.draw(rng, tr.new_requests(rng, 20000), 1)
    # with noiseless confidences, P(first draft accepted | confidence) = confidence
    bins = np.digitize(d.confidence[:, 0], [0.25, 0.5, 0.75])
    for b in range(4):
        sel = bins == b
        assert abs(d.accepted[sel].mean() - d.confidence[sel, 0].mean()) < 0.03


def test_policies_face_the_same_requests_and_dcut_beats_full_where_verification_is_steep():
    cfg = SimConfig(batch=64, block=16, steps=300)
    full = simulate(Full(), cfg, PUBLISHED_TRACE, DENSE_VERIFY_MS.curve, lambda b: 0.013)
    dcut = simulate(Dcut(), cfg, PUBLISHED_TRACE, DENSE_VERIFY_MS.curve, lambda b: 0.013)
    oracle = simulate(policy_from_name("oracle", 16), cfg, PUBLISHED_TRACE, DENSE_VERIFY_MS.curve, lambda b: 0.013)
    assert dcut.speedup > 1.3 * full.speedup
    assert oracle.speedup > dcut.speedup
    assert dcut.keep_ratio < 0.6 < full.keep_ratio


def test_published_trace_reproduces_the_equal_budget_experiment():
    glob, depth = equal_budget(PUBLISHED_TRACE, steps=600)
    np.testing.assert_allclose(glob, EQUAL_BUDGET.global_topk, rtol=0.05)
    np.testing.assert_allclose(depth, EQUAL_BUDGET.same_depth, rtol=0.05)


def test_dense_b16_rows_land_within_15_percent_of_the_published_cells():
    ar = fit_dense_ar(PUBLISHED_TRACE)  # fitted to the DFlash-B16 row only
    for pol in ("full", "dcut-buckets"):
        for b, pub in zip(BATCHES, DENSE_SPEEDUP[(pol, 16)], strict=True):
            r = simulate(policy_from_name(pol, 16), SimConfig(b, 16), PUBLISHED_TRACE, DENSE_VERIFY_MS.curve, ar)
            assert r.speedup == pytest.approx(pub, rel=0.15), (pol, b)


def test_moe_cost_is_flat_and_dcut_keeps_more_than_on_dense():
    cm = preset("moe-35b-a3b", "h20", 8)
    curve = cm.verify_curve(64, 64 * 1024).seconds(np.array([64 * 4, 64 * 16]))
    dense = DENSE_VERIFY_MS.seconds(64, np.array([64 * 4, 64 * 16]))
    assert curve[1] / curve[0] < 1.5 < dense[1] / dense[0]
    cfg = SimConfig(batch=64, block=16, steps=200)
    moe = simulate(Dcut(), cfg, PUBLISHED_TRACE, lambda b: cm.verify_curve(b, b * 1024), lambda b: 0.01)
    den = simulate(Dcut(), cfg, PUBLISHED_TRACE, DENSE_VERIFY_MS.curve, lambda b: 0.01)
    assert moe.keep_ratio > den.keep_ratio + 0.05


def test_the_coordinators_own_time_interpolates_and_extends_its_measurements():
    """Linear between measured batch sizes, along the last segment beyond them, `dcut`'s for a
    policy not measured; read from benchmarks/coordinator.py's records (first block per policy)."""
    from dcut_core.own_time import MEASURED, OwnTime

    own = OwnTime({"ar": ((1, 1.0), (16, 2.5), (64, 4.0)), "dcut": ((1, 2.0), (64, 8.3))}, "test")
    assert own.ms("ar", 1) == 1.0 and own.ms("ar", 8.5) == pytest.approx(1.75) and own.ms("ar", 64) == 4.0
    assert own.ms("ar", 112) == pytest.approx(4.0 + 48 * 1.5 / 48)  # the last segment's slope
    assert own.ms("oracle", 33) == own.ms("dcut", 33) == pytest.approx(2.0 + 32 * 6.3 / 63)
    recs = [{"policy": "ar", "block": 8, "requests": 1, "own_ms": 0.5}, {"policy": "ar", "block": 8, "requests": 4,
                                                                        "own_ms": 1.1},
            {"policy": "dcut", "block": 8, "requests": 1, "own_ms": 1.5}, {"policy": "dcut", "block": 16,
                                                                          "requests": 1, "own_ms": 9.0}]
    got = OwnTime.from_records(recs, "file")
    # one dcut point: beyond it, at least ar's growth (0.2 ms a request along ar's last segment)
    assert got.points == {"ar": ((1, 0.5), (4, 1.1)), "dcut": ((1, 1.5),)}
    assert got.ms("dcut", 100) == pytest.approx(1.5 + 99 * 0.2)
    with pytest.raises(ValueError, match="ar and dcut"):
        OwnTime.from_records(recs[:2], "file")
    assert MEASURED.ms("dcut", 4096) > MEASURED.ms("dcut", 1024) > MEASURED.ms("ar", 1024)


POINTS = st.lists(st.tuples(st.integers(1, 4096), st.floats(0.01, 50)), min_size=2, max_size=6,
                  unique_by=lambda p: p[0])


@given(POINTS, POINTS)
def test_own_time_never_falls_beyond_the_last_measurement_nor_grows_slower_than_plain_decodings(dcut, ar):
    """However noisy the measured points, extrapolation beyond the largest batch grows, at least
    as steeply as `ar`'s last segment does (the first GPU run's `dcut` pair fell with R)."""
    from dcut_core.own_time import OwnTime

    own = OwnTime({"ar": tuple(sorted(ar)), "dcut": tuple(sorted(dcut))}, "test")
    last = max(r for r, _ in dcut)
    (r0, y0), (r1, y1) = sorted(ar)[-2:]
    a, b = own.ms("dcut", last + 100), own.ms("dcut", last + 1000)
    assert own.ms("dcut", last) <= a <= b
    assert b - a >= 900 * (y1 - y0) / (r1 - r0) - 1e-9
    gpu = OwnTime({"ar": ((1, 0.90), (64, 1.81), (256, 3.29)), "dcut": ((1, 2.85), (64, 5.44), (256, 4.89))}, "run 2")
    assert gpu.ms("dcut", 1024) == pytest.approx(4.89 + 768 * (3.29 - 1.81) / 192)
