"""`actors/target/graphs.py`: decode and verify steps padded to a bucket's fixed shapes (what a
CUDA graph replays) compute what the eager step computes — checked here uncaptured
(`mode="padded"`), on the CPU; the capture itself runs in tests/gpu/run.sh."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.target.graphs import MAX_REQUESTS, StepGraphs
from actors.target.layers import QUERY_SPAN, Padding, plan_attention
from actors.target.model import ForwardBatch, Prepared
from actors.target.moe import StepStats
from tests.conftest import tiny_model


def prepare(model, cache, ids, chunks) -> Prepared:
    return model.prepare(ForwardBatch.from_lists(ids, chunks, "all"), cache)


def test_padded_steps_give_the_eager_steps_logits_features_and_cache():
    """Prefill (eager: too long to graph), then decoding and verifying steps of varying requests
    and lengths, through the padded path on one cache and the eager forward on another."""
    model = tiny_model(seed=1)
    eager_cache, padded_cache = model.new_cache(2048), model.new_cache(2048)
    graphs = StepGraphs(model, padded_cache, mode="padded")
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(0, 96, 40 + 3 * rid).tolist() for rid in range(5)}
    steps = [(list(prompts), list(prompts.values()))]  # prefill: 40+ tokens each
    shapes = [([0, 1, 2, 3, 4], [1] * 5), ([0, 2, 4], [3, 1, 7]), ([1, 3], [9, 2]), ([0, 1, 2, 3, 4], [1] * 5),
              ([4, 0], [5, 5]), ([2], [1])]
    for ids, lengths in shapes:
        steps.append((ids, [rng.integers(0, 96, n).tolist() for n in lengths]))
    graphed = 0
    for ids, chunks in steps:
        want, want_feats = model.forward(prepare(model, eager_cache, ids, chunks), eager_cache, StepStats(),
                                         capture_layers=(1, 3))
        stats = StepStats()
        prep = prepare(model, padded_cache, ids, chunks)
        out = graphs.forward(prep, stats, capture_layers=(1, 3))
        if out is None:
            assert max(len(c) for c in chunks) > QUERY_SPAN
            out = model.forward(prep, padded_cache, stats, capture_layers=(1, 3))
        else:
            graphed += 1
            assert stats.tokens == sum(map(len, chunks)) and stats.requests == len(ids)
        got, feats = out
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for layer in (1, 3):
            torch.testing.assert_close(feats[layer], want_feats[layer], rtol=1e-5, atol=1e-5)
        for rid in ids:  # the same lengths, and the same keys and values at each request's positions
            n = eager_cache.length(rid)
            assert padded_cache.length(rid) == n
            a, b = eager_cache.slots(rid, 0, n), padded_cache.slots(rid, 0, n)
            torch.testing.assert_close(padded_cache.k[:, b], eager_cache.k[:, a], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(padded_cache.v[:, b], eager_cache.v[:, a], rtol=1e-5, atol=1e-5)
    assert graphed == len(steps) - 1
    assert graphs.stats()["graphs"] == 4 and graphs.stats()["captures"] == 0  # 4 distinct buckets, none captured


def test_a_step_is_bucketed_to_powers_of_two_and_long_ones_run_eagerly():
    model = tiny_model()
    cache = model.new_cache(4096)
    graphs = StepGraphs(model, cache, mode="padded")
    assert graphs.scratch == cache.scratch_slot()  # one slot, taken once
    assert graphs.scratch // cache.spec.block_size == cache.num_blocks - 1
    free = cache.free_tokens
    prep = prepare(model, cache, [0, 1, 2], [[1] * 70, [2] * 10, [3] * 5])
    assert graphs.padding(prep) is None  # a 70-token chunk: prefill, eager
    assert cache.free_tokens < free
    cache.release_all([0, 1, 2])
    prep = prepare(model, cache, [0, 1, 2], [[1] * 30, [2] * 3, [3] * 5])
    assert graphs.padding(prep) == Padding(4, 32, 256, graphs.scratch)
    for rid, n in zip([0, 1, 2], [30, 3, 5], strict=True):
        cache.commit(rid, n)
    prep = prepare(model, cache, [0, 1, 2], [[1] * 2, [2], [3] * 3])
    assert graphs.padding(prep) == Padding(4, 4, 256, graphs.scratch)  # keys: 33 → 256
    too_many = Padding(2, 4, 256, graphs.scratch)
    with pytest.raises(ValueError, match="does not fit"):
        plan_attention(cache, prep.batch.request_ids, prep.batch.cu, prep.starts, model.cfg.rotary, prep.lengths,
                       too_many)
    assert MAX_REQUESTS >= 64


def test_graphs_are_wanted_only_where_a_step_can_be_captured():
    model = tiny_model()
    assert not StepGraphs.wanted("auto", model, 1, "cpu")  # no CUDA here
    assert not StepGraphs.wanted("off", model, 1, "cpu")
    assert StepGraphs.wanted("padded", model, 2, "cpu")
    with pytest.raises(ValueError, match="cuda_graphs"):
        StepGraphs(model, model.new_cache(256), mode="always")


def test_a_bucket_keeps_one_graph_whatever_layers_its_steps_ask_for():
    """A step asking for layers its bucket's graph does not output makes the graph again with
    every layer asked for so far; later steps asking for fewer reuse it."""
    model = tiny_model()
    cache = model.new_cache(2048)
    graphs = StepGraphs(model, cache, mode="padded")
    ids = [0, 1]
    model.forward(prepare(model, cache, ids, [[1] * 40, [2] * 40]), cache)
    for layers in [(), (1, 3), (), (3,)]:
        out = graphs.forward(prepare(model, cache, ids, [[3], [4]]), capture_layers=layers)
        assert out is not None and set(out[1]) == set(layers)
        assert all(v.shape == (2, model.cfg.hidden_size) for v in out[1].values())
    assert graphs.stats()["graphs"] == 1 and graphs._layers == (1, 3)


def test_a_step_that_captured_a_graph_does_not_teach_the_cost_correction():
    """A capture's 70–100 ms lands in one step's forward: the online correction (which would read
    it as the step's cost) skips that step and learns from the next."""
    from types import SimpleNamespace

    from actors.engine.learning import _learn_cost

    class Cost:  # records which of its calls the learning made
        def __init__(self):
            self.calls = []

        def observe(self, shape, seconds):
            self.calls.append("observe")
            return 0.01

        def predict(self, shape):
            self.calls.append("predict")
            return 0.01

    cost = Cost()
    for captures in (1, 0):
        st = SimpleNamespace(feeding=[], batch=[0, 1], verify_tokens=6, prefill_tokens=0, context=40,
                             out=SimpleNamespace(wall_s=0.09, rank_stats=[StepStats(graph_captures=captures)]))
        _learn_cost(st, cost, None)
    assert cost.calls == ["predict", "observe"]


def test_the_first_graphed_step_warms_up_the_usual_buckets():
    model = tiny_model()
    cache = model.new_cache(4096)
    graphs = StepGraphs(model, cache, mode="padded", warm_requests=5)
    model.forward(prepare(model, cache, [0], [[1] * 40]), cache)  # prefill: not graphed, nothing warmed
    assert graphs.stats()["graphs"] == 0
    free = cache.free_tokens
    assert graphs.forward(prepare(model, cache, [0], [[2]]), capture_layers=(2,)) is not None
    warm = {(r, q, 256) for r in (1, 2, 4, 8) for q in (1, 4, 16, QUERY_SPAN)}
    assert set(graphs._graphs) == warm  # the step's own bucket among them
    assert all(step.layers == (2,) for step in graphs._graphs.values())
    assert cache.free_tokens == free  # warming writes only the scratch slot: no request's blocks
    graphs.forward(prepare(model, cache, [0], [[3]]))
    assert len(graphs._graphs) == len(warm)  # warmed once


def test_the_profile_times_no_forward_that_captured_a_graph():
    """The start-up profile (and its check) runs once more a forward whose rank captured a CUDA
    graph: the capture's time is no step's. A real target, whose first forward of each shape
    reports a capture and a second more, as a capturing GPU rank's would."""
    from actors.target.local import LocalTarget
    from actors.target.profile import ProfileGrid, run_profile

    class Capturing:
        def __init__(self, target):
            self.target, self.seen = target, set()

        def forward(self, ids, chunks, logits="last", **kw):
            out = self.target.forward(ids, chunks, logits=logits, **kw)
            shape = (len(ids), len(chunks[0]))
            if logits == "all" and shape not in self.seen:
                self.seen.add(shape)
                out.wall_s += 1.0
                out.rank_stats[0].graph_captures = 3
            return out

        def truncate(self, lengths):
            self.target.truncate(lengths)

        def release(self, ids):
            self.target.release(ids)

    samples = run_profile(Capturing(LocalTarget(tiny_model())), ProfileGrid((1, 2), (1, 4), (8,), 1), 96)
    assert len(samples) == 4 and all(s.seconds < 0.5 for s in samples)
