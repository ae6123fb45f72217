"""`dcut trace` on the tiny bundle: the recorded outputs are the target's greedy ones, and what the
trace says each drafter kind would draft and have accepted is what the engine really drafts and
accepts, step by step, when it verifies every draft (`full`); the trace file round-trips."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from actors.drafter.ngram import NgramDrafter
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.engine.trace_record import CORPUS_LAGS, _walk, _walk_in_turn, record_trace
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from dcut_core.trace_sim import SimSettings, simulate_trace
from deployments.trace_command import is_trace, read_trace, write_trace

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4, 3, 4], [20, 21, 22, 23, 20, 21]]
MAX_TOKENS, BLOCK = 14, 5
KINDS = ("block", "mtp", "ngram")

pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py


def config(bundle: str, tmp_path, kinds: str, policy: str = "dcut", max_running: int = 8) -> EngineConfig:
    return EngineConfig(target_dir=f"{bundle}/target", drafter=kinds, block=BLOCK, policy=policy,
                        cost_model_cache=str(tmp_path), max_running=max_running,
                        drafter_dirs=(("block", f"{bundle}/drafter"), ("mtp", f"{bundle}/mtp")))


@pytest.fixture(scope="module")
def trace(tiny_bundle, tmp_path_factory):
    return record_trace(config(tiny_bundle, tmp_path_factory.mktemp("cache"), ",".join(KINDS)), PROMPTS, MAX_TOKENS)


def test_outputs_are_the_targets_greedy_ones_and_the_file_round_trips(trace, tiny_bundle, tmp_path):
    greedy = greedy_decode(LocalTarget(load_model(f"{tiny_bundle}/target")), list(range(len(PROMPTS))), PROMPTS,
                           MAX_TOKENS)
    assert [r.output.tolist() for r in trace.requests] == greedy
    assert trace.kinds == KINDS and trace.block == BLOCK
    for r in trace.requests:
        for k in range(len(KINDS)):
            for t in range(1, r.length):  # accepted = the drafts' agreement with the output
                d = r.tokens[k, t, :r.count[k, t]]
                truth = r.output[t:t + len(d)]
                assert r.accepted[k, t] == next((j for j in range(len(truth)) if d[j] != truth[j]), len(truth))
    assert sum(int(r.accepted[2].sum()) for r in trace.requests) > 0  # n-gram drafts on repetitive prompts pass
    path = tmp_path / "t.trace"
    write_trace(trace, path)
    assert is_trace(str(path))
    again = read_trace(path)
    assert all((a.confidence == b.confidence).all() for a, b in zip(again.requests, trace.requests, strict=True))
    assert all((a.target_confidence == b.target_confidence).all()
               for a, b in zip(again.requests, trace.requests, strict=True))
    c = trace.costs
    assert c.verify_scale > 0 and c.own_seconds(1, False, False) > 0
    for name, d in zip(KINDS, c.draft, strict=True):  # n-gram: the coordinator's own microseconds
        assert d.fixed + d.per_request + 7 * d.per_position < 1e-3 if name == "ngram" else \
            d.per_position + d.per_pass > 0 or d.fixed > 0
    assert trace.corpus_kind == "ngram" and trace.corpus_lags == CORPUS_LAGS == again.corpus_lags
    alone = _walk_in_turn(NgramDrafter(block_size=BLOCK, corpus_tokens=0), PROMPTS,
                          [r.output.tolist() for r in trace.requests], [{}] * len(PROMPTS), BLOCK - 1)
    for i, r in enumerate(again.requests):  # every lag here spans the 4 prompts: no earlier output in
        assert all(np.array_equal(r.corpus[lag].accepted, alone["accepted"][i]) for lag in CORPUS_LAGS)
    assert c.own_one is not None and again.costs.own_one == c.own_one  # a one-kind engine measured beside the unit
    assert c.choose is not None and c.choose_seconds(1) > 0 and again.costs.choose == c.choose  # priced apart
    one = c.for_kinds(1)
    assert (one.own_policy, one.own_drafting) == c.own_one and one.own == c.own and c.for_kinds(len(KINDS)) is c


def test_the_ngram_kinds_rows_by_corpus_lag_see_the_outputs_lag_places_before():
    """`_walk_in_turn` at lag L: request i drafts as a fresh n-gram drafter that has served
    requests 0 .. i − L in turn (and nothing else) would; lag 1 is the trace's own walk. Outputs
    that repeat earlier ones make the corpus matter."""
    rng = np.random.default_rng(7)
    base = rng.integers(30, 60, 12).tolist()  # every output opens alike: from request L on, lag L finds it
    prompts = [rng.integers(1, 30, 6).tolist() for _ in range(7)]
    outputs = [base + rng.integers(30, 60, 4).tolist() for _ in range(7)]
    width = BLOCK - 1

    def fresh():
        return NgramDrafter(block_size=BLOCK, corpus_tokens=1 << 16)

    rows = {lag: _walk_in_turn(fresh(), prompts, outputs, [{}] * 7, width, lag) for lag in (1, 2, 3, 7)}
    for lag, walked in rows.items():
        for i in range(7):
            d = fresh()
            for j in range(i - lag + 1):  # the requests served before i whose outputs are in
                _walk(d, [prompts[j]], [outputs[j]], [{}], width)
                d.absorb()
            want = _walk(d, [prompts[i]], [outputs[i]], [{}], width)
            for name in ("count", "accepted", "confidence", "margin", "tokens"):
                assert np.array_equal(walked[name][i], want[name][0]), (lag, i, name)
    accepted = {lag: sum(int(a.sum()) for a in w["accepted"]) for lag, w in rows.items()}
    assert accepted[1] > accepted[2] > accepted[3] > accepted[7]  # a thinner corpus drafts less that passes


def test_the_target_confidence_is_its_top_probability_where_it_emitted_the_last_token(trace, tiny_bundle):
    """Row t: the target's softmax top where output[t − 1] was emitted, asked here of a fresh
    target one prefix at a time (the trace asks once per request)."""
    import torch

    target = LocalTarget(load_model(f"{tiny_bundle}/target"))
    for i, (p, r) in enumerate(zip(PROMPTS, trace.requests, strict=True)):
        sure = r.target_confidence
        assert sure.shape == (r.length,) and sure.dtype == np.float32 and sure[0] == 0.0
        assert ((sure[1:] > 0) & (sure[1:] <= 1)).all() and len(set(sure[1:].tolist())) > 1
        for t in (1, r.length // 2, r.length - 1):
            out = target.forward([100 + i], [[*p, *r.output[:t - 1].tolist()]], logits="last", with_logits=True)
            target.release([100 + i])
            assert int(out.argmax[0]) == r.output[t - 1]
            top = float(torch.softmax(torch.from_numpy(out.logits[0]).double(), dim=-1).max())
            assert sure[t] == pytest.approx(top, rel=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_drafts_and_accepts_what_the_trace_says(trace, tiny_bundle, tmp_path, kind):
    """The engine under `full` (every draft verified) with one kind, one request at a time (the
    order the trace walks the n-gram kind's corpus in): at every step of every request, the
    drafts it made and accepted are the trace's at that position."""
    k = KINDS.index(kind)
    eng = Engine(config(tiny_bundle, tmp_path, kind, policy="full", max_running=1))
    try:
        seqs = eng.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS))
    finally:
        eng.shutdown()
    for s, r in zip(seqs, trace.requests, strict=True):
        assert s.output == r.output.tolist()
        t, drafted, accepted = 1, [], []
        while t < r.length:
            cap = min(BLOCK - 1, MAX_TOKENS - t - 1)
            n = min(cap, int(r.count[k, t]))
            drafted.append(n)
            accepted.append(min(n, int(r.accepted[k, t])))
            t += accepted[-1] + 1
        assert (s.drafted, s.accepted) == (drafted, accepted)
    sim = simulate_trace(trace, SimSettings(policy="full", kinds=(kind,)), len(PROMPTS))
    assert sim.accepted == sum(sum(s.accepted) for s in seqs)
    assert sim.decode_steps == sum(s.steps for s in seqs)
    assert np.isfinite(sim.tok_s) and sim.tok_s > 0


def test_a_prompt_served_again_drafts_from_the_first_runs_output(tiny_bundle, tmp_path):
    """The n-gram kind's corpus: a prompt of tokens that never repeat has no match of its own at
    its first output positions, so only the corpus can draft there — from the first run's
    output, which a second run of the same prompt repeats (greedy), so its drafts pass. Without
    the corpus the second run drafts exactly as the first. Outputs equal throughout."""
    prompt, params = [40, 41, 42, 43, 44], [SamplingParams(max_tokens=MAX_TOKENS)]
    accepted = {}
    for tokens in (0, 1 << 12):
        eng = Engine(dataclasses.replace(config(tiny_bundle, tmp_path, "ngram", policy="full", max_running=1),
                                         ngram_corpus_tokens=tokens))
        try:
            first, again = eng.generate([prompt], params)[0], eng.generate([prompt], params)[0]
        finally:
            eng.shutdown()
        assert again.output == first.output
        accepted[tokens] = (sum(first.accepted), sum(again.accepted))
    assert accepted[0][1] == accepted[0][0] == accepted[1 << 12][0]
    assert accepted[1 << 12][1] > accepted[1 << 12][0]


def test_an_aborted_request_joins_the_corpus_and_the_engine_serves_on(tiny_bundle, tmp_path):
    """A request aborted mid-flight is released like a finished one: what it committed waits for
    the corpus and is taken in at the next step's learning; the next request completes with the
    target's own output, and nothing of either is held afterwards."""
    eng = Engine(config(tiny_bundle, tmp_path, "ngram", max_running=1))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS)
        alone = eng.generate([PROMPTS[1]], [params])[0].output
        eng.forget_outputs()
        rid = eng.add([40, 41, 42, 43, 44], params)
        for _ in range(3):
            eng.step()
        eng.abort(rid)
        assert len(eng.lookahead.drafter.corpus) == 0  # waiting: taken in where the next step learns
        again = eng.generate([PROMPTS[1]], [params])[0]
        assert again.output == alone and again.finish_reason == "length"
        assert eng.lookahead.drafter.corpus.follow([41, 42, 43, 44], 2)[0] == 4  # the aborted request's tokens
        assert set(eng.held().values()) == {0}
    finally:
        eng.shutdown()
