"""Cost model: expert counting, presets, fitting, online refinement, persistence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls as scipy_nnls

from dcut_core.cost_model import (
    TERMS,
    CostModel,
    OnlineCorrection,
    StepShape,
    expected_distinct_experts,
    fit,
    preset,
)
from dcut_core.hardware import HARDWARE, MODELS, ModelShape
from dcut_core.nnls import nnls

TINY_MOE = ModelShape("tiny", 4, 256, 4, 2, 64, 4096, 0, experts=8, top_k=2,
                      expert_intermediate=512, moe_layers=4, param_bytes=4, act_bytes=4)


def test_distinct_experts_match_the_published_table():
    # PUBLISHED.md: E=256, k=8 -> 8, 30.5, 102, 163, 222, 252, 256 for n = 1 ... 256.
    n = np.array([1, 4, 16, 32, 64, 128, 256])
    got = expected_distinct_experts(n, 256, 8)
    np.testing.assert_allclose(got, [8, 30.5, 102, 163, 222, 252, 256], atol=0.6)


def test_preset_curves_are_monotone_and_moe_is_flatter_than_dense():
    def kept_fraction_curve(model, ep):
        cm = preset(model, "h20", ep=ep)
        curve = cm.verify_curve(requests=64, context=64 * 1024)
        tokens = 64 + np.array([0.25, 0.5, 0.75, 1.0]) * 64 * 16
        return curve.seconds(tokens.astype(np.int64))

    dense = kept_fraction_curve("dense-8b", 1)
    moe = kept_fraction_curve("moe-35b-a3b", 8)
    assert (np.diff(dense) > 0).all() and (np.diff(moe) > 0).all()
    assert dense[-1] / dense[0] > 1.5 * (moe[-1] / moe[0])


def test_all_to_all_term_appears_with_expert_parallelism_and_grows_across_nodes():
    shape = StepShape(requests=32, tokens=256, context=32 * 512)
    parts = {ep: preset("moe-35b-a3b", "h200", ep=ep).breakdown(shape) for ep in (1, 8, 16, 64)}
    assert parts[1]["a2a_latency"] == 0 and parts[1]["a2a_bytes"] == 0
    assert 0 < parts[8]["a2a_latency"] < parts[16]["a2a_latency"] < parts[64]["a2a_latency"]
    # Leaving the NVLink domain (EP > 8) drops the bandwidth: the per-byte cost goes up.
    assert preset("moe-35b-a3b", "h200", 16).coef["a2a_bytes"] > preset("moe-35b-a3b", "h200", 8).coef["a2a_bytes"]
    assert HARDWARE["h200"].a2a_latency_s(8) == pytest.approx((77 + 114) * 1e-6)


def test_padding_makes_a_step_function():
    cm = preset(TINY_MOE, "cpu", pad_tokens=(8, 16, 32))
    c = cm.verify_curve(requests=2, context=100).seconds(np.arange(1, 40))
    assert len(np.unique(c[:8])) == 1 and len(np.unique(c[8:16])) == 1 and c[16] > c[15]
    assert (np.diff(c) >= 0).all()


def test_nnls_matches_scipy():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.normal(size=(int(rng.integers(5, 30)), int(rng.integers(1, 8))))
        b = rng.normal(size=a.shape[0])
        ours, ref = nnls(a, b), scipy_nnls(a, b)[0]
        assert (ours >= 0).all()
        assert np.linalg.norm(a @ ours - b) == pytest.approx(np.linalg.norm(a @ ref - b), rel=1e-7, abs=1e-9)


def grid_samples(model: CostModel, noise: float, seed: int) -> list[tuple[StepShape, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for r in (1, 2, 4, 8, 16, 32, 64):
        for per in (1, 2, 4, 8, 16):
            for ctx in (64, 256, 1024):
                s = StepShape(r, r * per, r * ctx)
                out.append((s, model.predict(s) * (1 + noise * rng.standard_normal())))
    return out


def test_fit_recovers_known_parameters():
    terms = ("fixed", "dense", "attention", "kv_read", "experts")
    truth = CostModel(TINY_MOE, 2, {"fixed": 4e-3, "dense": 80e-6, "attention": 2e-9,
                                    "kv_read": 5e-8, "experts": 1e-4})
    base = CostModel(TINY_MOE, 2, dict.fromkeys(terms, 0.0))
    exact = fit(base, grid_samples(truth, 0.0, 0), terms)
    for t in terms:
        assert exact.coef[t] == pytest.approx(truth.coef[t], rel=1e-6)
    # With a2a latency in the truth: it and `fixed` are collinear at one EP size, so the fit
    # can only find their sum.
    truth = CostModel(TINY_MOE, 2, {"fixed": 4e-3, "dense": 80e-6, "attention": 2e-9,
                                    "experts": 1e-4, "a2a_latency": 3e-4})
    noisy = fit(base, grid_samples(truth, 0.01, 1), ("fixed", "dense", "attention", "experts"))
    assert noisy.coef["fixed"] == pytest.approx(4e-3 + 4 * 3e-4, rel=0.05)
    assert noisy.coef["dense"] == pytest.approx(80e-6, rel=0.1)
    assert noisy.coef["experts"] == pytest.approx(1e-4, rel=0.1)


def test_a_concave_machine_is_priced_at_one_request_and_at_64():
    # A machine whose marginal token costs less in a bigger step (a CPU's products, a GPU below
    # its knee): the profile's terms find it — the price of a step's extra tokens, over its base,
    # within 1 % at one request and at 64 — where a fit without `batching` prices them dearer at
    # one request than at 64, relative to the truth (as the bundled model's CPU profile did,
    # session 37).
    truth = CostModel(TINY_MOE, 1, {"fixed": 4e-3, "dense": 40e-6, "kv_read": 5e-8, "experts": 2e-5,
                                    "batching": 6e-4})
    samples = grid_samples(truth, 0.0, 0)
    base = CostModel(TINY_MOE, 1, {})
    terms = ("fixed", "dense", "attention", "kv_read", "experts", "expert_flops", "batching")  # a profile's at EP 1
    with_it = fit(base, samples, terms)
    without = fit(base, samples, terms[:-1])

    def extra_price(model, r):  # what 2 drafts a request add, over the step without them
        b, e = model.base_and_extra(StepShape(r, 3 * r, 128 * r))
        return e / b

    for r in (1, 64):
        assert extra_price(with_it, r) == pytest.approx(extra_price(truth, r), rel=0.01)
    off = [extra_price(without, r) / extra_price(truth, r) for r in (1, 64)]
    assert off[0] > 1.3 * off[1] and off[0] > 1.3


def test_fit_rejects_bad_samples():
    base = preset(TINY_MOE, "cpu")
    with pytest.raises(ValueError, match="at least"):
        fit(base, [(StepShape(1, 1, 1), 1.0)])
    with pytest.raises(ValueError, match="positive"):
        fit(base, [(StepShape(1, i + 1, 1), -1.0) for i in range(len(TERMS))])


def test_online_correction_tracks_a_slower_machine_and_refits():
    truth = preset(TINY_MOE, "cpu", ep=2)
    slow = CostModel(TINY_MOE, 2, {k: 1.5 * v for k, v in truth.coef.items()})
    online = OnlineCorrection(truth, halflife_steps=10)
    samples = grid_samples(slow, 0.0, 0)
    for shape, seconds in samples * 3:
        online.observe(shape, seconds)
    assert online.scale == pytest.approx(1.5, rel=1e-3)
    s = StepShape(8, 40, 8 * 300)
    assert online.predict(s) == pytest.approx(slow.predict(s), rel=1e-3)
    assert online.verify_curve(8, 2400).seconds(np.array([40]))[0] == pytest.approx(slow.predict(s), rel=1e-3)
    online.refit(("fixed", "dense", "attention", "kv_read", "experts", "expert_flops"))
    assert online.scale == 1.0
    assert online.predict(s) == pytest.approx(slow.predict(s), rel=0.05)


def test_json_round_trip_and_validation():
    cm = preset(MODELS["moe-35b-a3b"], "h100", ep=8, pad_tokens=(8, 16))
    back = CostModel.from_json(cm.to_json())
    assert back == CostModel(cm.model, cm.ep, cm.coef, cm.pad_tokens, cm.source)
    with pytest.raises(ValueError, match="version"):
        CostModel.from_json('{"version": 7}')
    with pytest.raises(ValueError, match="non-negative"):
        CostModel(TINY_MOE, 1, {"fixed": -1.0})
    with pytest.raises(ValueError, match="divide"):
        CostModel(TINY_MOE, 3, {})


def test_the_closed_form_curve_equals_the_feature_sum():
    concave = preset(TINY_MOE, "cpu", ep=2, pad_tokens=(4, 16, 64))
    concave = CostModel(concave.model, 2, {**concave.coef, "batching": 3e-4}, concave.pad_tokens)
    for cm in (preset(TINY_MOE, "cpu", ep=2, pad_tokens=(4, 16, 64)), preset("moe-35b-a3b", "h20", ep=16),
               preset("dense-8b", "h100"), concave):
        tokens = np.arange(1, 300)
        f = cm.features(np.full(len(tokens), 7), tokens, np.full(len(tokens), 7 * 333))
        np.testing.assert_allclose(cm.verify_curve(7, 7 * 333).seconds(tokens), f @ cm.coef_vector(), rtol=1e-12)
        one = [cm.predict(StepShape(7, int(n), 7 * 333)) for n in tokens]  # the same closed form, in floats
        np.testing.assert_allclose(one, f @ cm.coef_vector(), rtol=1e-12)


def test_the_curve_adds_a_saturated_experts_term_as_a_constant_to_the_last_bit():
    """Counts past the experts term's saturation skip its exponentials (the scan asks thousands
    of them): every count, saturated or not, a whole array or a mix, gives the bits of the term
    written out."""
    concave = preset(TINY_MOE, "cpu", ep=2)
    concave = CostModel(concave.model, 2, {**concave.coef, "batching": 3e-4})
    for cm in (concave, preset("moe-35b-a3b", "h20", ep=16), preset(TINY_MOE, "cpu", ep=2, pad_tokens=(4, 16, 64))):
        a, b, per_rank, d, log_miss, g = cm._closed_form(64, 64 * 300)
        assert d and log_miss < 0
        windows = [np.arange(lo, lo + 40) for lo in range(1, 3000, 23)]  # saturated from the least count on, or not
        for tokens in (np.arange(4096, 9000), np.array([5000, 3, 7000]), np.array([], dtype=np.int64), *windows):
            n = cm.padded(tokens).astype(np.float64)
            want = a + b * n + per_rank * np.ceil(n / cm.ep)
            want += d * -np.expm1(n * log_miss)
            want += g * np.sqrt(n)
            got = cm.verify_curve(64, 64 * 300).verify_seconds(tokens)
            assert got.tobytes() == want.tobytes()


def test_online_correction_trusts_its_first_measurements_fully():
    # A deployment 1.4× slower than its profile: the first step already corrects the whole
    # gap (a running mean until the half-life takes over), instead of 1/72 of it per step.
    truth = preset(TINY_MOE, "cpu", ep=2)
    online = OnlineCorrection(truth, halflife_steps=50)
    s = StepShape(8, 40, 8 * 300)
    online.observe(s, 1.4 * truth.predict(s))
    assert online.scale == pytest.approx(1.4)
    online.observe(s, 1.0 * truth.predict(s))  # the mean of two log-ratios
    assert online.scale == pytest.approx(np.sqrt(1.4))
    for _ in range(500):
        online.observe(s, 2.0 * truth.predict(s))
    assert online.scale == pytest.approx(2.0, rel=1e-3)


def test_online_observe_returns_the_prediction_it_made_before_learning():
    online = OnlineCorrection(preset(TINY_MOE, "cpu", ep=2))
    shape = StepShape(4, 8, 256)
    before = online.predict(shape)
    assert online.observe(shape, 3 * before) == before
    assert online.predict(shape) > before  # it learned


def _split_truth(model: CostModel, sb: float, se: float):
    """A machine on which a step's base (its requests' one token each) takes sb × the model's
    and each extra token se × what the model says it adds."""
    def seconds(s: StepShape) -> float:
        base = model.predict(StepShape(s.requests, s.requests, s.context))
        return sb * base + se * (model.predict(s) - base)
    return seconds


MIXED_STEPS = [StepShape(r, r * per, r * ctx) for r in (1, 4, 16) for per in (1, 1, 2, 5, 8) for ctx in (64, 512)]


@settings(max_examples=40, deadline=None)
@given(st.floats(0.5, 2.0), st.floats(0.5, 2.0))
def test_the_split_recovers_a_base_and_a_token_cost_that_differ(sb, se):
    model = preset(TINY_MOE, "cpu")
    truth = _split_truth(model, sb, se)
    online = OnlineCorrection(model)
    for s in MIXED_STEPS * 20:
        online.observe(s, truth(s))
    got_b, got_e = online.split
    assert got_b == pytest.approx(sb, rel=0.02) and got_e == pytest.approx(se, rel=0.02)
    for s in (StepShape(1, 1, 100), StepShape(1, 8, 100), StepShape(32, 96, 32 * 300)):
        assert online.predict(s) == pytest.approx(truth(s), rel=0.02)
        curve = online.verify_curve(s.requests, s.context)
        assert curve.seconds(np.array([s.tokens]))[0] == pytest.approx(online.predict(s), rel=1e-9)


def test_plain_steps_alone_leave_the_token_cost_at_the_level():
    # Nothing tells what an extra token costs: it is priced at the level the plain steps show,
    # not at a guess from them.
    model = preset(TINY_MOE, "cpu")
    online = OnlineCorrection(model)
    for r in (1, 4, 16, 64):
        for _ in range(30):
            s = StepShape(r, r, r * 200)
            online.observe(s, 1.3 * model.predict(s))
    sb, se = online.split
    assert sb == pytest.approx(1.3, rel=0.01) and se == pytest.approx(1.3, rel=0.05)
    drafting = StepShape(4, 20, 800)
    assert online.predict(drafting) == pytest.approx(1.3 * model.predict(drafting), rel=0.03)


def test_a_profile_that_underprices_tokens_makes_drafting_steps_dearer():
    # The engine's case: plain steps over-predicted, drafting steps under-predicted by a
    # level-only correction; with the split, a drafting step's predicted extra cost is the
    # measured one, so the plan does not take drafting for cheaper than it is.
    model = preset(TINY_MOE, "cpu")
    truth = _split_truth(model, 0.9, 1.6)
    online = OnlineCorrection(model)
    for s in MIXED_STEPS * 10:
        online.observe(s, truth(s))
    plain, drafting = StepShape(1, 1, 100), StepShape(1, 8, 100)
    level_only = online.scale
    extra = online.predict(drafting) - online.predict(plain)
    assert extra == pytest.approx(truth(drafting) - truth(plain), rel=0.02)
    assert extra > 1.1 * level_only * (model.predict(drafting) - model.predict(plain))
    online.refit(TERMS[:6])
    assert online.split == (1.0, 1.0)
