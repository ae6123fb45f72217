"""An engine that starts warm: what one engine learnt is saved at shutdown and a restarted engine of
the same deployment starts from it — its first decisions are the saved state's; a fresh
deployment starts from the bundle's prior; a corrupt file is skipped, never fatal."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.engine.warm import PRIOR, snapshot
from dcut_core.drafting import DraftCost
from dcut_core.gate import DraftingCosts, GateInput, KindReach
from dcut_core.pruning import StepCost

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4], [20, 21, 22, 23, 20, 21]]

pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py


def engine(bundle: str, cache, kinds: str = "block,ngram") -> Engine:
    return Engine(EngineConfig(target_dir=f"{bundle}/target", drafter=kinds, block=5, policy="dcut",
                               cost_model_cache=str(cache), max_running=8,
                               drafter_dirs=(("block", f"{bundle}/drafter"),)))


def decisions(eng: Engine) -> tuple[np.ndarray, np.ndarray]:
    """The gate's plan for a fixed batch of new requests (ids no request ever had)."""
    rids = [10_000 + i for i in range(4)]
    curve = StepCost(lambda n: 0.004 + 0.0004 * np.asarray(n, dtype=np.float64), 0.0)
    costs = eng.draft_cost.costs
    plan = eng.gate.decide(GateInput.capture(rids, np.full(4, 4), np.full(4, 20),
                                             KindReach(np.zeros((4, len(eng.kinds)))), curve,
                                             DraftingCosts(costs, eng.draft_cost.shared)))
    return plan.kinds, plan.lengths


def test_a_restarted_engine_starts_from_what_the_last_one_learnt(tiny_bundle, tmp_path):
    first = engine(tiny_bundle, tmp_path)
    assert first.started_from == "none"
    first.generate(PROMPTS * 3, [SamplingParams(max_tokens=16)] * 12)
    saved = snapshot(first)
    assert sum(k.observations for k in saved.kinds.values()) > 0  # it learnt something
    first.shutdown()  # saves
    plan = decisions(first)  # what the saved state decides (the gate lives on after shutdown)
    again = engine(tiny_bundle, tmp_path)
    try:
        assert again.started_from == "saved"
        assert snapshot(again).kinds == snapshot(first).kinds  # calibration, rates, drafting costs
        assert again.draft_cost.shared == first.draft_cost.shared
        assert again.payoff.as_dict() == first.payoff.as_dict() != {}  # the payoff check's outcomes by band
        got = decisions(again)
        assert all((a == b).all() for a, b in zip(got, plan, strict=True))
    finally:
        again.shutdown()


def test_a_new_deployment_starts_from_the_bundles_prior_and_a_bad_file_is_skipped(tiny_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    donor = engine(str(bundle), tmp_path / "donor")
    # Enough verifications to be past the gate's warm-up (these looping prompts are drafted the
    # whole block at once by the n-gram kind, so a step verifies many tokens: few steps).
    donor.generate(PROMPTS * 6, [SamplingParams(max_tokens=16)] * 24)
    assert sum(t.observations for t in donor.gate.trackers) >= donor.gate.exploration.warmup
    state = snapshot(donor)
    donor.shutdown()
    prior = {**state.as_dict(), "kinds": {n: {k: v for k, v in d.items() if k != "draft"}
                                         for n, d in state.as_dict()["kinds"].items()}}
    (bundle / PRIOR).write_text(json.dumps(prior))
    fresh = engine(str(bundle), tmp_path / "fresh")  # another machine's cache: nothing saved there
    try:
        assert fresh.started_from == "prior"
        for name, k in snapshot(fresh).kinds.items():
            assert k.accepted == state.kinds[name].accepted and k.weights == state.kinds[name].weights
            # costs are this machine's own profile, not the prior's (n-gram: none yet, it drafts in the coordinator)
            assert (k.draft == DraftCost()) == (name == "ngram")
        warming = sum(t.observations for t in fresh.gate.trackers) < fresh.gate.exploration.warmup
        assert not warming  # no exploring every step while it would learn what the prior knows
    finally:
        fresh.shutdown()
    (bundle / PRIOR).write_text("{not json")
    cold = engine(str(bundle), tmp_path / "cold")
    try:
        assert cold.started_from == "none"
        assert cold.generate(PROMPTS[:1], [SamplingParams(max_tokens=4)])[0].finish_reason == "length"
    finally:
        cold.shutdown()
