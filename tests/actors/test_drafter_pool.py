"""A heterogeneous drafter pool: every replica hosts block, MTP and n-gram drafters, each request
drafts with the kind the gate chose for it, and D-Cut prunes all of them in one decision.
Lossless whatever mix drafted: greedy outputs equal plain decoding for every policy, sampled
outputs depend on the seed alone."""

from __future__ import annotations

import numpy as np
import pytest

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.engine.steplog import read_steps
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from dcut_core.drafting import AcceptanceTracker, Exploration
from dcut_core.gate import DraftingGate, replay
from tests.actors.test_engine import POLICIES, PROMPTS

pytestmark = pytest.mark.usefixtures("local_ray")
KINDS = "block,mtp,eagle3,ngram"
MAX_TOKENS = 12


def engine(bundle: str, tmp_path, **kw) -> Engine:
    cfg = dict(target_dir=f"{bundle}/target", drafter=KINDS, block=6, policy="dcut", cost_model_cache=str(tmp_path),
               drafter_dirs=(("block", f"{bundle}/drafter"), ("mtp", f"{bundle}/mtp"), ("eagle3", f"{bundle}/eagle3")),
               max_running=64)
    return Engine(EngineConfig(**(cfg | kw)))


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    return greedy_decode(LocalTarget(load_model(f"{tiny_bundle}/target")), list(range(64)), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("ep", [1, 2])
def test_mixed_drafters_in_one_batch_are_lossless_for_every_policy(tiny_bundle, reference, tmp_path, ep):
    eng = engine(tiny_bundle, tmp_path, ep=ep)
    try:
        assert eng.kinds == ("block", "mtp", "eagle3", "ngram") and len(eng.draft_cost.costs) == 4
        for policy in POLICIES:
            eng.set_policy(policy)
            for concurrency in (1, 7, 64):
                before = {k: dict(c) for k, c in eng.drafted_by_kind.items()}
                out = eng.generate(PROMPTS[:concurrency], [SamplingParams(max_tokens=MAX_TOKENS)] * concurrency)
                assert [s.output for s in out] == reference[:concurrency], (policy, concurrency)
                if policy == "full" and concurrency == 64:
                    used = [k for k, c in eng.drafted_by_kind.items() if c["chosen"] > before[k]["chosen"]]
                    assert len(used) >= 2, eng.drafted_by_kind  # one batch, several kinds drafting
                    assert sum(sum(s.accepted) for s in out) > 0
        counts = eng.drafted_by_kind
        assert all(counts[k]["drafted"] > 0 for k in eng.kinds), counts
        assert all(c["accepted"] <= c["kept"] <= c["drafted"] for c in counts.values())
        # What each owner holds of requests in flight, and nothing once they are done (the n-gram
        # corpus emptied: these prompts' earlier outputs would draft them to the end in three steps).
        eng.set_policy("full")
        eng.forget_outputs()
        rids = [eng.add(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS[:7]]
        for _ in range(3):
            eng.step()
        mid = eng.held()
        assert all(mid[k] > 0 for k in ("scheduler", "trackers", "drafter_owner", "drafter_ledger", "drafter_replicas",
                                         "target_owner", "rank_requests", "lookahead")), mid
        while eng.pending:
            eng.step()
        for rid in rids:
            eng.claim(rid)
        assert eng.held() == dict.fromkeys(mid, 0)
    finally:
        eng.shutdown()


def test_sampled_outputs_depend_on_the_seed_alone(tiny_bundle, tmp_path):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i) for i in range(16)]
    eng = engine(tiny_bundle, tmp_path, policy="full")
    try:
        eng.set_policy("ar")
        plain = [s.output for s in eng.generate(PROMPTS[:16], params)]
        for policy in ("full", "dcut"):
            eng.set_policy(policy)
            assert [s.output for s in eng.generate(PROMPTS[:16], params)] == plain, policy
        assert sum(c["kept"] for c in eng.drafted_by_kind.values()) > 0
        assert len({tuple(o) for o in plain}) > 1  # really sampled
    finally:
        eng.shutdown()


def test_a_request_drafts_only_with_the_kinds_it_names(tiny_bundle, reference, tmp_path):
    eng = engine(tiny_bundle, tmp_path, policy="full")
    try:
        out = eng.generate(PROMPTS[:8], [SamplingParams(max_tokens=MAX_TOKENS, drafters=("ngram",))] * 8)
        assert [s.output for s in out] == reference[:8]
        counts = eng.drafted_by_kind
        assert counts["ngram"]["drafted"] > 0
        assert counts["block"]["drafted"] == counts["mtp"]["drafted"] == counts["eagle3"]["drafted"] == 0
        with pytest.raises(ValueError, match="not served here"):
            eng.add(PROMPTS[0], SamplingParams(drafters=("eagle",)))
    finally:
        eng.shutdown()


def test_requests_naming_different_kinds_in_one_gated_batch_are_served_and_the_engine_serves_on(
        tiny_bundle, reference, tmp_path):
    """Under the gate (`dcut`), one batch mixing requests that name one kind, two kinds and none:
    the kind chooser weighs each request's allowed kinds (its −inf bars); every output is the
    target's, no request drafts with a kind it did not name, and afterwards a plain request
    completes and nothing is held."""
    eng = engine(tiny_bundle, tmp_path)
    named = [("ngram",), ("block", "mtp"), None, ("mtp",)] * 4
    try:
        plans = []
        decide = eng.gate.decide

        def recorded(g):
            plan = decide(g)
            plans.append(plan)
            return plan

        eng.gate.decide = recorded
        out = eng.generate(PROMPTS[:16], [SamplingParams(max_tokens=MAX_TOKENS, drafters=d) for d in named])
        assert [s.output for s in out] == reference[:16]
        kinds, by_rid = eng.kinds, {s.rid: named[i] for i, s in enumerate(out)}
        drafted = [(by_rid[rid], kinds[k]) for p in plans for rid, k, n in zip(p.seen.rids, p.kinds, p.lengths,
                                                                               strict=True) if n]
        assert drafted and all(want is None or kind in want for want, kind in drafted)
        assert any(p.chosen for p in plans)  # the chooser ran, not only kinds kept from before
        assert eng.generate(PROMPTS[16:17], [SamplingParams(max_tokens=MAX_TOKENS)])[0].output == reference[16]
        assert set(eng.held().values()) == {0}
    finally:
        eng.shutdown()


def test_a_mixed_pool_step_log_replays_every_plan(tiny_bundle, tmp_path):
    log = tmp_path / "steps.msgpack"
    eng = engine(tiny_bundle, tmp_path, step_log=str(log), overlap=True)  # as on GPU ranks: learnt a step late
    try:
        eng.generate(PROMPTS[:12], [SamplingParams(max_tokens=MAX_TOKENS)] * 12)
    finally:
        eng.shutdown()
    cfg = eng.cfg
    fresh = DraftingGate([AcceptanceTracker(block=cfg.block) for _ in eng.kinds],
                         Exploration(cfg.explore_every, cfg.explore_requests, cfg.explore_warmup),
                         cfg.planner())
    steps = list(read_steps(log))
    assert any(rec["late"] for rec in steps) and not all(rec["late"] for rec in steps)  # learnt behind a forward
    plans = replay(fresh, steps)
    assert plans and all(np.array_equal(logged, got) for logged, got in plans)
    assert len({int(k) for logged, _ in plans for k, n in zip(*logged, strict=True) if n}) >= 2
    # The n-gram kind is asked for no more than its look-ahead found, and learns from the steps
    # it did not draft (its look-ahead judged against what they emitted).
    # Every request whose look-ahead found drafts either drafted them or was judged in hindsight:
    # the n-gram kind's tracker learns of it once a step, either way.
    ng, looked = eng.kinds.index("ngram"), 0
    for rec in steps:
        gate, obs = rec.get("gate"), rec.get("observed")
        if gate and obs:
            available = np.asarray(gate["input"]["available"])
            taught = [(rid, n, a) for rid, k, n, a in zip(obs["rids"], obs["kinds"], obs["kept"], obs["accepted"],
                                                          strict=True) if k == ng]
            for i, (rid, k, n) in enumerate(zip(gate["input"]["rids"], gate["kinds"], gate["lengths"], strict=True)):
                assert k != ng or n <= available[i, ng]
                if available[i, ng] > 0:
                    looked += 1
                    assert [t[0] for t in taught].count(rid) == 1
            assert all(0 <= a <= n for _, n, a in taught)
    assert looked


def test_an_ngram_engine_drafts_in_the_coordinator_with_no_drafter_replica(tiny_bundle, reference, tmp_path):
    """n-gram alone (the serving default): no replica is started, no context is sent anywhere;
    the coordinator's look-ahead drafts, losslessly, and holds nothing once requests finish."""
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="full")
    try:
        assert eng.replicas == [] and eng.cfg.layout().drafters == 0 and eng.can_draft
        out = eng.generate(PROMPTS[:8], [SamplingParams(max_tokens=MAX_TOKENS)] * 8)
        assert [s.output for s in out] == reference[:8]
        assert eng.drafted_by_kind["ngram"]["drafted"] > 0 and sum(sum(s.accepted) for s in out) > 0
        cost = eng.draft_cost.costs[0]  # its own time here: microseconds, no call
        assert cost.fixed + cost.per_request + 7 * cost.per_position < 1e-3
        assert set(eng.held().values()) == {0}
    finally:
        eng.shutdown()


def test_learning_behind_the_next_forward_changes_no_output(tiny_bundle, tmp_path):
    """With `overlap` a step's outcome is learnt on the learner thread while the next step's
    forward runs; outputs equal the sequential engine's, greedy and seeded sampling alike, for
    every policy, and the learning did run there."""
    import threading

    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(7)]
    outputs = {}
    for overlap in (False, True):
        eng = engine(tiny_bundle, tmp_path, overlap=overlap)
        threads, inner = set(), eng.settle

        def settle(late=False, _inner=inner, _threads=threads):
            _threads.add(threading.current_thread().name)
            return _inner(late)

        eng.settle = settle
        try:
            for policy in POLICIES:
                eng.set_policy(policy)
                outputs[overlap, policy] = [s.output for s in eng.generate(PROMPTS[:7], params)]
            assert set(eng.held().values()) == {0}
        finally:
            eng.shutdown()
        assert any(n.startswith("dcut-learn") for n in threads) == overlap, threads
    assert all(outputs[True, p] == outputs[False, p] for p in POLICIES)
