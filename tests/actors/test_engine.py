"""The engine end to end on a real local Ray: lossless for every policy, EP size and replica count,
and a sampled output distribution equal to the target's."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from scipy.stats import chisquare

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.errors import ErrorKind
from actors.engine.sequence import SamplingParams
from actors.engine.steplog import read_steps
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from actors.target.model import ForwardBatch
from dcut_core.drafting import AcceptanceTracker, Exploration
from dcut_core.gate import DraftingGate, replay
from dcut_core.pruning import POLICY_NAMES
from tests.actors.conftest import holding_drafts, kill_and_wait

POLICIES = [p for p in POLICY_NAMES if p != "fixed-K"] + ["fixed-2"]
MAX_TOKENS = 12


def make_prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        motif = rng.integers(1, 96, rng.integers(2, 5)).tolist()
        out.append((motif * 4)[: 3 + i % 9])  # repetitive: the n-gram drafter finds matches
    return out


PROMPTS = make_prompts(64)


pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    target = load_model(f"{tiny_bundle}/target")
    return greedy_decode(LocalTarget(target), list(range(64)), PROMPTS, MAX_TOKENS)


def engine(bundle: str, tmp_path, **kw) -> Engine:
    cfg = dict(target_dir=f"{bundle}/target", drafter_dir=f"{bundle}/drafter", block=6, policy="dcut",
               cost_model_cache=str(tmp_path), max_running=64, cpus_per_drafter=0.5)
    return Engine(EngineConfig(**(cfg | kw)))


# in_process: rank 0 drives (EP 1: one process), each rank hosts a drafter; otherwise every rank
# and `replicas` drafters are Ray actors.
@pytest.mark.parametrize(("ep", "replicas", "drafter", "in_process"), [
    (1, 1, "block", True), (1, 2, "ngram", False), (2, 1, "block", True), (2, 2, "ngram", False)])
def test_every_policy_is_lossless(tiny_bundle, reference, tmp_path, ep, replicas, drafter, in_process):
    eng = engine(tiny_bundle, tmp_path, ep=ep, drafters=replicas, drafter=drafter, in_process=in_process)
    try:
        for policy in POLICIES:
            eng.set_policy(policy)
            for concurrency in (1, 7, 64):
                out = eng.generate(PROMPTS[:concurrency], [SamplingParams(max_tokens=MAX_TOKENS)] * concurrency)
                assert [s.output for s in out] == reference[:concurrency], (policy, concurrency)
                if policy == "full" and concurrency == 64:
                    assert sum(sum(s.accepted) for s in out) > 0  # speculation really happened
                if policy == "ar":
                    assert all(sum(s.kept) == 0 for s in out)
        assert eng.history.recent and all(r.measured_verify_s > 0 for r in eng.history.recent)
    finally:
        eng.shutdown()


def test_steps_padded_as_cuda_graphs_replay_them_are_lossless(tiny_bundle, reference, tmp_path):
    """Every decode and verify step through `actors/target/graphs.py`'s padded shapes (uncaptured
    here: what a CUDA graph replays on a GPU): greedy outputs equal the target's alone."""
    eng = engine(tiny_bundle, tmp_path, cuda_graphs="padded", drafter="ngram")
    graphs = eng.target.local.graphs
    started = set(graphs._graphs)  # the start-up profile's first graphed step warmed the usual buckets
    try:
        for policy in ("ar", "dcut", "full"):
            eng.set_policy(policy)
            out = eng.generate(PROMPTS[:16], [SamplingParams(max_tokens=MAX_TOKENS)] * 16)
            assert [s.output for s in out] == reference[:16], policy
        assert sum(sum(s.accepted) for s in out) > 0  # `full`: speculation really happened
        eng.generate([(p * 8)[:24] for p in PROMPTS[:4]], [SamplingParams(max_tokens=4)] * 4)  # 17-32 tokens
        assert len(started) > 1
        # Serving met no bucket the start-up had not made: on a GPU, no capture (70-100 ms) mid-run.
        assert set(graphs._graphs) == started, sorted(set(graphs._graphs) - started)
    finally:
        eng.shutdown()


def test_step_log_records_every_step(tiny_bundle, reference, tmp_path):
    log = tmp_path / "steps.msgpack"
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="dcut", step_log=str(log))
    try:
        out = eng.generate(PROMPTS[:5], [SamplingParams(max_tokens=MAX_TOKENS)] * 5)
    finally:
        eng.shutdown()
    steps = list(read_steps(log))
    assert len(steps) == eng.history.steps > 0
    assert not any(s["late"] for s in steps)  # CPU ranks: each step learnt before the next (no overlap)
    assert sum(sum(s["accepted"]) for s in steps) == sum(sum(s.accepted) for s in out)
    assert [s.accepted_tokens for s in out] == [sum(s.accepted) for s in out]  # the streamed running total
    for s in steps:
        assert all(0 <= a <= k <= d for a, k, d in zip(s["accepted"], s["kept"], s["drafted"], strict=True))
        assert len(s["survival"]) in (0, sum(s["drafted"]))
    # The drafting gate replays from the log: a fresh gate with the engine's settings asks for
    # exactly what the engine's asked for, at every step — drafting steps and plain ones.
    cfg = eng.cfg
    fresh = DraftingGate([AcceptanceTracker(block=cfg.block)], Exploration(cfg.explore_every, cfg.explore_requests,
                                                                           cfg.explore_warmup),
                         cfg.planner(), teach_empty=False)
    plans = replay(fresh, steps)
    assert len(plans) == sum(s["gate"] is not None for s in steps) > 0
    assert {bool(p[1].sum()) for p, _ in plans} == {True, False}
    assert all(np.array_equal(logged, got) for logged, got in plans)


def test_stop_conditions(tiny_bundle, reference, tmp_path):
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="full")
    try:
        ref = reference[0]
        eos = ref[4]
        eng.eos = eos
        out = eng.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=MAX_TOKENS),
                                              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)])
        first = ref.index(eos)
        assert out[0].output == ref[: first + 1] and out[0].finish_reason == "stop"
        assert out[1].output == ref and out[1].finish_reason == "length"
        eng.eos = None
        stop = " ".join(map(str, ref[2:4]))  # the default detokenizer prints ids
        out = eng.generate([PROMPTS[0]], [SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,))])
        assert out[0].output == ref[:4] and out[0].finish_reason == "stop"
        assert stop not in out[0].text
    finally:
        eng.shutdown()


def test_sampled_tokens_follow_the_target_distribution(tiny_bundle, tmp_path):
    """Second generated token (the first one speculation decides) against the exact marginal."""
    target = load_model(f"{tiny_bundle}/target")
    prompt = PROMPTS[9]
    temp = 0.8
    with torch.no_grad():
        logits, _ = target(ForwardBatch.from_lists([0], [prompt], "last"), target.new_cache(256))
        p1 = torch.softmax(logits[0] / temp, -1)
        rows = [[*prompt, t] for t in range(96)]
        l2, _ = target(ForwardBatch.from_lists(list(range(96)), rows, "last"), target.new_cache(96 * 32))
        p2 = (p1[:, None] * torch.softmax(l2 / temp, -1)).sum(0).double().numpy()
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="full", max_running=64)
    try:
        n = 640
        out = eng.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=temp, seed=s) for s in range(n)])
    finally:
        eng.shutdown()
    assert sum(sum(s.kept) for s in out) > 0
    second = np.array([s.output[1] for s in out])
    order = np.argsort(-p2)
    big = order[np.cumsum(p2[order]) <= 0.9]  # well-populated cells; the rest pooled
    counts = np.array([(second == t).sum() for t in big] + [(~np.isin(second, big)).sum()])
    expected = np.append(p2[big], 1 - p2[big].sum()) * n
    assert chisquare(counts, expected).pvalue > 1e-3


def test_a_dead_drafter_replica_loses_no_request(tiny_bundle, reference, tmp_path, with_fault):
    # Drafters as actors (at EP 1 they live in the coordinator's process and cannot die alone).
    eng = engine(tiny_bundle, tmp_path, drafter="block", policy="full", drafters=2, in_process=False)
    try:
        out = with_fault(eng, PROMPTS[:8], MAX_TOKENS, lambda: ray.kill(eng.replicas[0]))
        assert out == reference[:8]
        assert eng.degraded["drafter_replica_lost"] == 1
        later = eng.generate(PROMPTS[:4], [SamplingParams(max_tokens=MAX_TOKENS)] * 4)  # the replacement drafts
        assert [s.output for s in later] == reference[:4]
        assert sum(sum(s.drafted) for s in later) > 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("in_process", [True, False])
def test_a_dead_ep_rank_is_rebuilt_and_requests_resume_exactly(tiny_bundle, reference, tmp_path, in_process):
    eng = engine(tiny_bundle, tmp_path, drafter="block", policy="full", ep=2, in_process=in_process)
    try:
        eng.plan = holding_drafts(eng, 3)  # the features of those steps wait on the ranks
        rids = [eng.add(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS[:6]]
        for _ in range(3):
            eng.step()
        on_dead = {s.rid: s.steps for s in eng.scheduler.running if eng.target.rank_of(s.rid) == 1}
        kill_and_wait(eng.target.workers[1])
        while eng.pending:
            eng.step()
        out = [eng.claim(r) for r in rids]
        assert [s.output for s in out] == reference[:6]
        assert eng.degraded["ep_group_rebuilt"] == 1 and eng.target.healthy
        # Drafter actors: the next step's drafter could not fetch those features from the dead
        # rank: its requests went on without drafts until the rebuilt group refed them, and then
        # drafted again. Hosted drafters die with their rank: the group is rebuilt at once.
        assert eng.degraded["drafter_context_lost"] == (0 if in_process else 1)
        later = [s.drafted[on_dead[s.rid] + 2:] for s in out if s.rid in on_dead]
        assert any(later) and all(sum(d) > 0 for d in later if d)
    finally:
        eng.shutdown()


def test_resumed_request_continues_exactly(tiny_bundle, reference, tmp_path):
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="dcut")
    try:
        rids = [eng.add(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS), resume=reference[i][:5]) for i in range(3)]
        while eng.pending:
            eng.step()
        assert [eng.claim(r).output for r in rids] == reference[:3]
    finally:
        eng.shutdown()


def test_kv_admission_queues_instead_of_overflowing(tiny_bundle, reference, tmp_path):
    # Room for about two requests at a time: the rest wait their turn, and all finish exactly.
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="full", kv_capacity_tokens=64)
    try:
        out = eng.generate(PROMPTS[:6], [SamplingParams(max_tokens=MAX_TOKENS)] * 6)
        assert [s.output for s in out] == reference[:6]
        assert max(r.requests for r in eng.history.recent) <= 2
        big = eng.generate([PROMPTS[0] * 20], [SamplingParams(max_tokens=MAX_TOKENS)])[0]
        assert big.finish_reason == "error" and big.error.kind is ErrorKind.INVALID and not big.output
        assert "KV cache" in big.error.message and eng.pending == 0 and eng.claim(big.rid) is None
    finally:
        eng.shutdown()


def test_a_seed_fixes_sampled_output_whatever_the_policy(tiny_bundle, tmp_path):
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", policy="full")
    try:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s) for s in range(8)]
        runs = {}
        for policy in ("ar", "full", "dcut", "fixed-2"):
            eng.set_policy(policy)
            runs[policy] = [s.output for s in eng.generate(PROMPTS[:8], params)]
        assert runs["ar"] == runs["full"] == runs["dcut"] == runs["fixed-2"]
        alone = [eng.generate([PROMPTS[i]], [params[i]])[0].output for i in (0, 5)]
        assert alone == [runs["ar"][0], runs["ar"][5]]  # and whatever it was batched with
    finally:
        eng.shutdown()


def test_local_ray_caps_the_gcs_task_event_store():
    """Regression (soak, 2026-11-29): with Ray's default cap of 100 000 task events the GCS grew
    6 MB a minute under serving load; local Ray must run with the lower cap."""
    assert ray._config.task_events_max_num_task_in_gcs() == 10000


@pytest.mark.parametrize("ep", [1, 2])
def test_logprobs_are_the_targets_whatever_the_policy(tiny_bundle, tmp_path, ep):
    """Each committed token's log-probability and top alternatives, and the prompt's (echo), equal
    a direct forward of the target over prompt + output (log-softmax of its logits), under `ar`,
    `full` and `dcut`, greedy and sampled; and a scoring request (max_tokens 0) gets its prompt's
    alone."""
    model = load_model(f"{tiny_bundle}/target")

    def direct(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits, _ = model(ForwardBatch.from_lists([0], [tokens], "all"), model.new_cache(256))
        return torch.log_softmax(logits.float(), -1).numpy()

    eng = engine(tiny_bundle, tmp_path, drafter="ngram", ep=ep)
    try:
        prompts = PROMPTS[8:12]
        params = [SamplingParams(max_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=2),
                  SamplingParams(max_tokens=MAX_TOKENS, logprobs=0),
                  SamplingParams(max_tokens=MAX_TOKENS, logprobs=5, temperature=0.8, seed=7),
                  SamplingParams(max_tokens=0, prompt_logprobs=1)]
        by_policy = {}
        for policy in ("ar", "full", "dcut"):
            eng.set_policy(policy)
            out = eng.generate(prompts, params)
            by_policy[policy] = out
            for s, p in zip(out, params, strict=True):
                rows = direct([*s.prompt, *s.output])
                n = len(s.prompt)
                assert len(s.logprobs) == (len(s.output) if p.logprobs is not None else 0)
                for t, e in enumerate(s.logprobs):
                    want = rows[n - 1 + t]
                    assert e.token == s.output[t]
                    assert e.logprob == pytest.approx(float(want[e.token]), abs=1e-4)
                    assert [i for i, _ in e.top] == np.argsort(-want, kind="stable")[:p.logprobs].tolist()
                    assert all(lp == pytest.approx(float(want[i]), abs=1e-4) for i, lp in e.top)
                if p.prompt_logprobs is None:
                    assert s.prompt_logprobs == []
                    continue
                assert len(s.prompt_logprobs) == n and s.prompt_logprobs[0] is None
                for q, e in enumerate(s.prompt_logprobs[1:], start=1):
                    assert e.token == s.prompt[q] and len(e.top) == p.prompt_logprobs
                    assert e.logprob == pytest.approx(float(rows[q - 1][e.token]), abs=1e-4)
        scoring = by_policy["dcut"][3]
        assert scoring.output == [] and scoring.finish_reason == "length"
        assert sum(sum(s.drafted) for s in by_policy["full"]) > 0  # speculation took place
        for a, b in zip(by_policy["ar"], by_policy["dcut"], strict=True):
            assert a.output == b.output
            assert np.allclose([e.logprob for e in a.logprobs], [e.logprob for e in b.logprobs], atol=1e-5)
    finally:
        eng.shutdown()


def plain_with_controls(model, prompt: list[int], params: SamplingParams, eos: int | None) -> list[int]:
    """Plain greedy decoding with sampling controls, one token at a time, the controls applied
    naively (tests/actors/test_sampling_controls.py's reference): what speculation must equal."""
    from tests.actors.test_sampling_controls import naive

    c = params.controls(eos)
    out: list[int] = []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits, _ = model(ForwardBatch.from_lists([0], [[*prompt, *out]], "last"), model.new_cache(256))
        row = logits[0].numpy() if c is None else naive(logits[0].numpy(), [*prompt, *out], len(prompt), c)
        out.append(int(np.argmax(row)))
        if out[-1] == eos or out[-1] in params.stop_token_ids:
            break
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_sampling_controls_are_lossless_under_every_policy(tiny_bundle, reference, tmp_path, ep):
    """Penalties, logit bias, min_tokens and stop token ids change the target's distribution
    before verification: greedy output under `ar`, `full` and `dcut` equals plain decoding with
    the same controls (and differs from decoding without them)."""
    model = load_model(f"{tiny_bundle}/target")
    prompts = PROMPTS[16:20]
    eos = reference[19][3]
    params = [SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.8, top_k=3, min_p=0.1),
              SamplingParams(max_tokens=MAX_TOKENS, logit_bias=((5, 4.0), (int(reference[18][0]), -50.0))),
              SamplingParams(max_tokens=MAX_TOKENS, min_tokens=6, stop_token_ids=(int(reference[19][1]),))]
    want = [plain_with_controls(model, p, s, eos) for p, s in zip(prompts, params, strict=True)]
    assert all(w != r for w, r in zip(want[:3], reference[16:19], strict=True))  # the controls bite
    eng = engine(tiny_bundle, tmp_path, drafter="ngram", ep=ep)
    eng.eos = eos
    try:
        for policy in ("ar", "full", "dcut"):
            eng.set_policy(policy)
            out = eng.generate(prompts, params)
            assert [s.output for s in out] == want, policy
            if policy == "full":
                assert sum(sum(s.kept) for s in out) > 0  # speculation took place
    finally:
        eng.shutdown()


def test_sampled_tokens_follow_the_adjusted_distribution(tiny_bundle, tmp_path):
    """With top-k, min-p and a frequency penalty, the second token (the first one speculation
    decides) follows the exact marginal of the adjusted distribution."""
    from actors.target.sampling import RequestControls, apply_controls, target_probs

    target = load_model(f"{tiny_bundle}/target")
    prompt = PROMPTS[9]
    temp = 0.9
    params = [SamplingParams(max_tokens=3, temperature=temp, seed=s, top_k=12, min_p=0.02, frequency_penalty=1.0)
              for s in range(640)]
    c = params[0].controls(None)
    one = torch.ones(1)

    def probs(logits, history):
        adj = apply_controls(logits[None], np.array(history[-1:]), np.array([0]),
                             RequestControls(c, np.array(history[:-1]), len(prompt)))
        return target_probs(adj, one * temp, one, torch.tensor([c.top_k]), torch.tensor([c.min_p]))[0]

    with torch.no_grad():
        logits, _ = target(ForwardBatch.from_lists([0], [prompt], "last"), target.new_cache(256))
        p1 = probs(logits[0], prompt)
        rows = [[*prompt, t] for t in range(96)]
        l2, _ = target(ForwardBatch.from_lists(list(range(96)), rows, "last"), target.new_cache(96 * 32))
        p2 = sum(p1[t] * probs(l2[t], rows[t]) for t in range(96) if p1[t] > 0).double().numpy()
    eng = engine(tiny_bundle, tmp_path, drafter="block", policy="full", max_running=64)  # drafts every step
    try:
        out = eng.generate([prompt] * len(params), params)
    finally:
        eng.shutdown()
    assert sum(sum(s.kept) for s in out) > 0
    second = np.array([s.output[1] for s in out])
    assert set(second) <= set(np.nonzero(p2)[0])  # nothing top-k or min-p removed
    order = np.argsort(-p2)
    big = order[np.cumsum(p2[order]) <= 0.9]
    counts = np.array([(second == t).sum() for t in big] + [(~np.isin(second, big)).sum()])
    expected = np.append(p2[big], 1 - p2[big].sum()) * len(params)
    assert chisquare(counts, expected).pvalue > 1e-3


def test_the_serving_default_drafts_past_block_8_for_a_request_decoding_alone(tiny_bundle, tmp_path):
    """An engine built from the settings as `dcut serve` leaves them (n-gram, block unset) decodes
    repeating prompts one at a time: every output equals plain greedy decoding, and some step
    accepted more drafts than block 8 allows (7) — the default's block 16 is what drafted."""
    from deployments.settings import ServeSettings

    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    eng = Engine(ServeSettings(model_root=tiny_bundle, cost_model_cache=str(tmp_path), max_running=1).engine_config())
    longest = 0
    try:
        for i, prompt in enumerate([[(5 * i + j) % 80 + 1 for j in range(3 + i)] * 3 for i in range(4)]):
            rid = eng.add(prompt, SamplingParams(max_tokens=32, ignore_eos=True))
            while eng.pending:
                eng.step()
            seq = eng.claim(rid)
            assert seq.output == greedy_decode(model, [100 + i], [prompt], 32)[0], i
            longest = max(longest, *seq.accepted, 0)  # drafts accepted in each step that drafted
    finally:
        eng.shutdown()
    assert longest > 7, longest
