"""Acceptance estimates: survival, censoring, calibration quality."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core import acceptance, ragged
from dcut_core.acceptance import (
    Calibrator,
    brier_score,
    expected_calibration_error,
    hindsight_outcomes,
    judged_drafts,
    survival,
    verify_outcomes,
)


def test_survival_is_the_running_product_per_request():
    flat, cu = ragged.flatten([[0.5, 0.5, 0.0], [], [0.9, 1.0]])
    np.testing.assert_allclose(survival(flat, cu), [0.5, 0.25, 0.0, 0.9, 0.9])


def test_hindsight_outcomes_judge_unverified_drafts_against_what_the_step_emitted():
    tokens, cu = ragged.flatten([[5, 6, 7], [5, 9], [], [1, 2, 3, 4]], dtype=np.int64)
    emitted, cu_e = ragged.flatten([[5, 6], [5, 6, 7], [3], [1, 2, 3, 4, 5]], dtype=np.int64)
    judged, accepted = hindsight_outcomes(tokens, cu, emitted, cu_e)
    assert judged.tolist() == [2, 2, 0, 4]  # at most what was emitted: later tokens are unknown
    assert accepted.tolist() == [2, 1, 0, 4]


@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), min_size=1,
                                                                              max_size=6)), min_size=1, max_size=8))
def test_hindsight_outcomes_equal_a_request_by_request_comparison(rows):
    tokens, cu = ragged.flatten([d for d, _ in rows], dtype=np.int64)
    emitted, cu_e = ragged.flatten([e for _, e in rows], dtype=np.int64)
    judged, accepted = hindsight_outcomes(tokens, cu, emitted, cu_e)
    for (d, e), n, a in zip(rows, judged, accepted, strict=True):
        assert n == min(len(d), len(e))
        run = 0
        while run < n and d[run] == e[run]:
            run += 1
        assert a == run


def test_verify_outcomes_censor_pruned_and_post_rejection_drafts():
    cu = ragged.offsets_from_lengths([4, 3, 2, 0])
    # r0 kept 3, accepted 1: d0 yes, d1 no, d2 censored (after rejection), d3 pruned.
    # r1 kept 3, accepted 3: all yes.  r2 kept 0: nothing judged.
    idx, ok = verify_outcomes(cu, kept=[3, 3, 0, 0], accepted=[1, 3, 0, 0])
    assert idx.tolist() == [0, 1, 4, 5, 6]
    assert ok.tolist() == [True, False, True, True, True]
    with pytest.raises(ValueError):
        verify_outcomes(cu, kept=[1, 0, 0, 0], accepted=[2, 0, 0, 0])


def synthetic(rng, n, distort):
    """True acceptance q; the drafter reports a distorted confidence and a margin."""
    q = rng.uniform(0.02, 0.98, n)
    conf = distort(q)
    margin = np.clip(conf - rng.uniform(0, 0.3, n), 0, 1)
    pos = rng.integers(0, 16, n)
    return conf, margin, pos, q, rng.random(n) < q


def under_confident(q):
    z = np.log(q) - np.log1p(-q)
    return 1.0 / (1.0 + np.exp(-0.4 * z))


def over_confident(q):
    return q ** 0.3


@pytest.mark.parametrize("distort", [under_confident, over_confident])
def test_calibration_lowers_ece_and_brier(distort):
    rng = np.random.default_rng(0)
    cal = Calibrator()
    conf, margin, pos, _, y = synthetic(rng, 20000, distort)
    cal.observe(conf, margin, pos, y)
    conf, margin, pos, _, y = synthetic(rng, 20000, distort)  # held out
    raw_ece, raw_brier = expected_calibration_error(conf, y), brier_score(conf, y)
    est = cal.estimate(conf, margin, pos)
    assert raw_ece > 0.08
    assert expected_calibration_error(est, y) < 0.03
    assert brier_score(est, y) < raw_brier


def test_uncalibrated_estimate_is_the_raw_confidence():
    cal = Calibrator()
    conf = np.array([0.1, 0.5, 0.93])
    np.testing.assert_allclose(cal.estimate(conf, np.zeros(3), np.zeros(3)), conf, atol=1e-9)


def test_the_estimate_is_the_logistic_of_the_design_matrix():
    """`Calibrator.estimate` sums its terms directly; it equals the model its fit is written in,
    sigmoid(features @ weights), to rounding, for any weights (zeros included) and block."""
    rng = np.random.default_rng(5)
    for _ in range(500):
        cal = Calibrator(block=int(rng.integers(1, 17)), weights=rng.normal(size=4) * (rng.random(4) < 0.7))
        n = int(rng.integers(0, 12))
        conf, margin, pos = rng.random(n), rng.random(n), rng.integers(0, 16, n)
        z = cal.features(conf, margin, pos) @ cal.weights
        np.testing.assert_allclose(cal.estimate(conf, margin, pos), 1.0 / (1.0 + np.exp(-z)), rtol=1e-12, atol=1e-15)


def test_censoring_keeps_the_estimate_unbiased():
    # Every draft is accepted with p = 0.8 given its prefix; the drafter always says 0.5.
    # Requests keep a random prefix (pruning) and stop at the first rejection. Counting the
    # unjudged drafts as rejections would pull the estimate far below 0.8.
    rng = np.random.default_rng(1)
    cal = Calibrator(ridge=1e-3)
    r, block = 4000, 8
    cu = ragged.offsets_from_lengths(np.full(r, block))
    kept = rng.integers(0, block + 1, r)
    first_reject = rng.geometric(0.2, r) - 1  # accepted drafts before the first rejection
    accepted = np.minimum(first_reject, kept)
    idx, ok = verify_outcomes(cu, kept, accepted)
    conf = np.full(len(idx), 0.5)
    pos = ragged.positions(cu)[idx]
    cal.observe(conf, np.zeros(len(idx)), pos, ok)
    cal.fit()
    est = cal.estimate(np.full(block, 0.5), np.zeros(block), np.arange(block))
    np.testing.assert_allclose(est, 0.8, atol=0.03)


def test_refits_come_once_a_quarter_of_the_kept_drafts_are_new():
    """Every 256 judged drafts while few are kept, then once a quarter of the kept window is new:
    a fit's cost grows with the window, its cost per observation does not. The kept window
    stays `keep` (the fit trims it) and the weights keep moving toward the data."""
    cal = Calibrator(block=8, keep=4096)
    fits, fit = [], cal.fit
    cal.fit = lambda: (fits.append(cal.observed), fit())
    rng = np.random.default_rng(1)
    for _ in range(200):
        conf = rng.uniform(0.05, 1.0, 100)
        cal.observe(conf, np.zeros(100), rng.integers(0, 8, 100), rng.uniform(size=100) < 0.5 * conf)
    gaps = np.diff([0, *fits])
    assert fits[:4] == [300, 600, 900, 1200]  # 256 new each (in steps of 100): the window under 1,024
    assert all(g >= min(n, 4096) // 4 for g, n in zip(gaps, fits, strict=True))
    assert all(g <= max(256, min(n, 4096) // 4) + 100 for g, n in zip(gaps, fits, strict=True))
    assert sum(len(x[0]) for x in cal._seen) <= 4096 + cal._pending
    assert cal.weights[1] < 1.0  # the fits learnt that confidences are twice too high


def test_ece_and_brier_exact():
    assert expected_calibration_error(np.array([0.9, 0.9]), np.array([1, 0]), bins=10) == pytest.approx(0.4)
    assert brier_score(np.array([1.0, 0.0]), np.array([1, 1])) == pytest.approx(0.5)


@given(st.lists(st.integers(0, 3), max_size=30))
def test_groups_cover_every_item_once_under_its_own_label(labels):
    labels = np.array(labels, dtype=np.int64)
    seen = np.zeros(len(labels), dtype=np.int64)
    found = []
    for k, mine in ragged.groups(labels):
        assert (labels[mine] == k).all()
        seen[mine] += 1
        found.append(k)
    assert (seen == 1).all() and found == sorted(set(labels.tolist()))  # in label order


@given(st.lists(st.lists(st.integers(0, 9), max_size=5), min_size=1, max_size=6), st.data())
def test_gather_takes_the_first_entries_of_the_chosen_rows_in_their_order(rows, data):
    flat, cu = ragged.flatten(rows, dtype=np.int64)
    pick = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=6))
    lengths = data.draw(st.lists(st.integers(0, 6), min_size=len(pick), max_size=len(pick)))
    idx, out = ragged.gather(cu, np.array(pick, dtype=np.int64), np.array(lengths, dtype=np.int64))
    assert [flat[idx[out[j]:out[j + 1]]].tolist() for j in range(len(pick))] == \
        [rows[r][:n] for r, n in zip(pick, lengths, strict=True)]
    whole, _ = ragged.gather(cu, np.array(pick, dtype=np.int64))
    assert flat[whole].tolist() == [t for r in pick for t in rows[r]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=20), st.integers(0, 2**31 - 1))
def test_judged_drafts_in_turn_and_as_arrays_equal_a_draft_by_draft_reference(lengths, seed):
    """A few requests walked in plain Python, many as arrays: the same judged drafts, outcomes
    and positions as a draft-by-draft reference."""
    rng = np.random.default_rng(seed)
    kept = [int(rng.integers(0, n + 1)) for n in lengths]
    accepted = [int(rng.integers(0, k + 1)) for k in kept]
    cu = ragged.offsets_from_lengths(lengths)
    want = ([], [], [])
    for i, n in enumerate(lengths):
        for j in range(n):
            if j < kept[i] and j <= accepted[i]:
                for out, v in zip(want, (int(cu[i]) + j, j < accepted[i], j), strict=True):
                    out.append(v)
    for limit in (0, 64):  # every request as arrays; every request in turn
        with mock.patch.object(acceptance, "IN_TURN_REQUESTS", limit):
            got = judged_drafts(cu, kept, accepted)
        assert [g.tolist() for g in got] == [list(w) for w in want]
        assert [g.dtype for g in got] == [np.dtype(np.int64), np.dtype(bool), np.dtype(np.int64)]
