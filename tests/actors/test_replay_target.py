"""The zero-cost target (`ReplayEngine`): the whole engine over a target that looks its rows up
in known greedy outputs. Its outputs equal the real target's, speculation happens (the real
n-gram drafter's drafts are accepted), a batch far larger than the prompts runs, and a prompt
it has no output for is a clear error."""

from __future__ import annotations

import dataclasses

import pytest

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.replay import ReplayEngine
from actors.engine.sequence import SamplingParams

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4, 3, 4], [20, 21, 22, 23, 20, 21]]
MAX_TOKENS = 20

pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py


def config(bundle: str, tmp_path, policy: str) -> EngineConfig:
    return EngineConfig(target_dir=f"{bundle}/target", drafter="ngram", block=6, policy=policy,
                        cost_model_cache=str(tmp_path), max_running=128)


@pytest.fixture(scope="module")
def greedy(tiny_bundle, tmp_path_factory):
    """The real target's greedy outputs (plain decoding)."""
    eng = Engine(config(tiny_bundle, tmp_path_factory.mktemp("cache"), "ar"))
    try:
        seqs = eng.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS) for _ in PROMPTS])
    finally:
        eng.shutdown()
    return {tuple(p): s.output for p, s in zip(PROMPTS, seqs, strict=True)}


@pytest.mark.parametrize("policy", ["dcut", "full"])
def test_outputs_equal_the_real_targets_at_a_batch_larger_than_the_prompts(greedy, tiny_bundle, tmp_path,
                                                                             policy):
    eng = ReplayEngine(config(tiny_bundle, tmp_path, policy), greedy)
    prompts = PROMPTS * 25  # 100 requests in flight at once
    try:
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS) for _ in prompts])
        records = list(eng.history.recent)
    finally:
        eng.shutdown()
    assert [s.output for s in seqs] == [greedy[tuple(p)] for p in prompts]
    assert max(r.requests for r in records) == len(prompts)
    assert sum(r.accepted for r in records) > 0  # the n-gram drafter's drafts were accepted
    assert all(r.target_compute_s < 0.05 for r in records)  # no model ran
    assert not list(tmp_path.glob("learned_*.json"))  # a replay never warms a real engine of the deployment


def test_a_shorter_block_under_load_caps_every_request_above_that_load_and_decodes_exactly(greedy, tiny_bundle,
                                                                                          tmp_path):
    """`load_block` (1, 3) over block 6: a step decoding two or more requests drafts at most 2 for
    each, one decoding alone up to 5 — and outputs equal plain greedy decoding either way."""
    cfg = dataclasses.replace(config(tiny_bundle, tmp_path, "full"), load_block=(1, 3))
    eng = ReplayEngine(cfg, greedy)
    try:
        together = eng.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS) for _ in PROMPTS])
        batched = [r for r in eng.history.recent if not r.prefill_tokens]
        alone = eng.generate(PROMPTS[2:3], [SamplingParams(max_tokens=MAX_TOKENS)])
        single = [r for r in eng.history.recent if not r.prefill_tokens and r.requests == 1]
    finally:
        eng.shutdown()
    assert [s.output for s in together] == [greedy[tuple(p)] for p in PROMPTS]
    assert alone[0].output == greedy[tuple(PROMPTS[2])]
    loaded = [r for r in batched if r.requests > 1]
    assert loaded and all(r.drafted <= 2 * r.requests for r in loaded)
    assert max(r.drafted for r in single) > 2  # deeper alone: the full block
    assert sum(r.accepted for r in single) > 0


def test_a_prompt_without_a_recorded_output_is_a_clear_error(greedy, tiny_bundle, tmp_path):
    eng = ReplayEngine(config(tiny_bundle, tmp_path, "ar"), greedy)
    try:
        with pytest.raises(ValueError, match="no recorded greedy output"):
            eng.generate([[1, 2, 3]], [SamplingParams(max_tokens=4)])
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def long_greedy(tiny_bundle, tmp_path_factory):
    """The real target's greedy outputs of 64 tokens (plain decoding)."""
    eng = Engine(config(tiny_bundle, tmp_path_factory.mktemp("cache"), "ar"))
    try:
        seqs = eng.generate(PROMPTS, [SamplingParams(max_tokens=64) for _ in PROMPTS])
    finally:
        eng.shutdown()
    return {tuple(p): s.output for p, s in zip(PROMPTS, seqs, strict=True)}


@pytest.mark.parametrize("per_draft_s, drafting_pays", [(0.0, True), (0.02, False)])
def test_the_payoff_check_plays_the_arm_that_delivers_more(long_greedy, tiny_bundle, tmp_path, per_draft_s,
                                                           drafting_pays):
    """The engine is not told what its target's drafted tokens cost (its profile is the real
    target's): a forward of 10 ms where they cost nothing, and one where each costs 20 ms more.
    The payoff check measures both arms and then plays the one that delivered more — drafting in
    the first, plain decoding in the second — and outputs equal plain greedy decoding either way."""
    from dcut_core.payoff import PayoffCheck

    def forward(shape):
        return 0.0 if shape.tokens > 8 * shape.requests else 0.010 + per_draft_s * (shape.tokens - shape.requests)

    eng = ReplayEngine(config(tiny_bundle, tmp_path, "dcut"), long_greedy, forward_s=forward)
    eng.payoff = check = PayoffCheck(least=2, warm=2, probe=8, sure=8)  # decided after four steps
    arms, arm = [], check.arm
    check.arm = lambda r, measured=True: arms.append((r, measured, arm(r, measured))) or arms[-1][2]
    prompts = PROMPTS * 4
    try:
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=64) for _ in prompts])
        records = list(eng.history.recent)
    finally:
        eng.shutdown()
    assert [s.output for s in seqs] == [long_greedy[tuple(p)] for p in prompts]
    assert sum(r.accepted for r in records) > 0  # speculation happened
    band = check.bands[check.band_of(len(prompts))]
    assert (check.lead(band) > 1) == drafting_pays
    decided = [a for r, m, a in arms if r == len(prompts) and m][4:]  # the full batch's band, both arms known
    assert sum(a == drafting_pays for a in decided) >= 0.8 * len(decided) >= 0.8 * 8


def test_a_forward_takes_the_time_it_is_given(greedy, tiny_bundle, tmp_path):
    eng = ReplayEngine(config(tiny_bundle, tmp_path, "dcut"), greedy, forward_s=lambda shape: 0.004)
    try:
        eng.generate(PROMPTS, [SamplingParams(max_tokens=8) for _ in PROMPTS])
        records = list(eng.history.recent)
    finally:
        eng.shutdown()
    assert all(r.target_compute_s >= 0.004 for r in records)


def test_the_real_targets_cached_profile_is_what_it_decides_by(greedy, tiny_bundle, tmp_path):
    """Its forwards take nothing here: checked against them, the real target's profile would look
    832 x too slow and be replaced by a profile of the lookup (actors/engine/costs.py's check is
    for real targets only)."""
    import json

    real = Engine(config(tiny_bundle, tmp_path, "dcut"))  # profiles the real target and caches it
    real.shutdown()
    (cache,) = tmp_path.glob("cost_model_*.json")
    profiled = json.loads(cache.read_text())["coef"]
    eng = ReplayEngine(config(tiny_bundle, tmp_path, "dcut"), greedy)
    try:
        assert eng.cost.model.coef == profiled
        assert json.loads(cache.read_text())["coef"] == profiled
    finally:
        eng.shutdown()
