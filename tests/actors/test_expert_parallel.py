"""Expert parallelism: exactness against one process, failures, profiling — for both ways of
driving the ranks: every rank a Ray actor called per step (`EPGroup`), and rank 0 in this
process driving the others over the unit's control group (`DriverGroup`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from actors.inprocess import resolve
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.driver import DriverGroup
from actors.target.group import EPConfig, EPGroup, EPGroupError, InProcessGroup
from actors.target.local import LocalTarget
from actors.target.profile import ProfileGrid, fit_profile, run_profile
from actors.target.worker import BatchRejected
from tests.actors.conftest import kill_and_wait

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12], [40, 41, 42, 43], [77, 5]]


pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py
KINDS = ["actors", "driver"]


def make_group(kind: str, cfg: EPConfig) -> EPGroup:
    if kind == "actors":
        return EPGroup(cfg)
    return InProcessGroup(cfg) if cfg.world == 1 else DriverGroup(cfg)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    target = LocalTarget(model)
    first = target.forward(list(range(5)), PROMPTS, with_logits=True)
    second = target.forward(list(range(5)), [[3, 4], [5], [6, 7, 8], [9], [10, 11]], with_logits=True)
    greedy = greedy_decode(LocalTarget(model), list(range(5)), PROMPTS, max_new_tokens=12)
    return first, second, greedy


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ep_logits_and_greedy_tokens_equal_one_process(tiny_checkpoint, reference, world, kind):
    first_ref, second_ref, greedy_ref = reference
    group = make_group(kind, EPConfig(tiny_checkpoint, world=world, cpus_per_rank=1))
    try:
        first = group.forward(list(range(5)), PROMPTS, with_logits=True)
        second = group.forward(list(range(5)), [[3, 4], [5], [6, 7, 8], [9], [10, 11]], with_logits=True)
        for got, ref in ((first, first_ref), (second, second_ref)):  # the same rows, in the same order
            assert got.rows_cu.tolist() == ref.rows_cu.tolist()
            np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        assert {r["experts"] for r in group.ranks} == {(r * 8 // world, 8 // world) for r in range(world)}
        group.release(list(range(5)))
        greedy = greedy_decode(group, [100 + i for i in range(5)], PROMPTS, max_new_tokens=12)
        assert greedy == greedy_ref
        if world > 1:
            stats = second.rank_stats
            assert all(s.dispatch_s > 0 and s.combine_s > 0 for s in stats)
            assert sum(s.bytes_sent for s in stats) > 0
            assert all(s.moe_layers == 2 for s in stats)  # layer 1 of 3 is dense
    finally:
        group.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_rank_with_no_requests_still_takes_part(tiny_checkpoint, reference, kind):
    group = make_group(kind, EPConfig(tiny_checkpoint, world=4))
    try:
        out = group.forward([0], [PROMPTS[0]], with_logits=True)  # three ranks idle
        np.testing.assert_allclose(out.logits, reference[0].split(reference[0].logits)[0], rtol=1e-5, atol=1e-5)
    finally:
        group.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_rejected_batch_leaves_the_group_serving(tiny_checkpoint, kind):
    group = make_group(kind, EPConfig(tiny_checkpoint, world=2, kv_capacity_tokens=64, kv_block_size=16))
    try:
        group.forward([1, 2], [[1] * 40, [2] * 40])  # one request per rank, 3 of 4 blocks each
        with pytest.raises(BatchRejected, match="KV cache full"):
            group.forward([1, 2], [[1] * 30, [2]])
        with pytest.raises(BatchRejected, match="token ids"):
            group.forward([3], [[1000]])
        info = group.cache_info()
        assert sorted(len(i["lengths"]) for i in info) == [1, 1]  # request 3 was never placed
        assert all(list(i["lengths"].values()) == [40] for i in info)
        out = group.forward([1, 2], [[5], [6]])
        assert group.healthy and len(out.argmax) == 2
    finally:
        group.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_roll_backs_ride_on_the_next_forward_and_equal_one_process(tiny_checkpoint, reference, kind):
    """`truncate` sends nothing by itself: each rank applies it first thing in its next call
    (a forward, or `flush` before reading cache state). Logits after a roll-back equal a
    process that never saw the rolled-back tokens."""
    group = make_group(kind, EPConfig(tiny_checkpoint, world=2))
    try:
        group.forward(list(range(5)), PROMPTS)
        group.forward(list(range(5)), [[50, 51, 52]] * 5)  # drafts, all rejected
        group.truncate({i: len(p) for i, p in enumerate(PROMPTS)})
        lengths = {rid: n for i in group.cache_info() for rid, n in i["lengths"].items()}
        assert lengths == {i: len(p) for i, p in enumerate(PROMPTS)}
        group.forward(list(range(5)), [[50, 51, 52]] * 5)
        group.truncate({i: len(p) for i, p in enumerate(PROMPTS)})  # queued, then applied by the forward
        out = group.forward(list(range(5)), [[3, 4], [5], [6, 7, 8], [9], [10, 11]], with_logits=True)
        np.testing.assert_allclose(out.logits, reference[1].logits, rtol=1e-5, atol=1e-5)
        group.truncate({0: 3})
        group.release([0])  # a freed request's pending roll-back is dropped, not sent
        assert all(0 not in i["lengths"] for i in group.cache_info())
    finally:
        group.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_keep_features_at_kv_positions_until_taken(tiny_checkpoint, kind):
    """With keep_features, captured states stay on each request's rank, rolled back with its
    KV; a span taken later equals what one process captures for the committed tokens."""
    layers = (1, 3)
    second = [[3, 4], [5], [6, 7, 8], [9], [10, 11]]
    local = LocalTarget(load_model(tiny_checkpoint))
    want = [local.forward([i], [p + c], capture_layers=layers).features[0] for i, (p, c) in
            enumerate(zip(PROMPTS, second, strict=True))]
    group = make_group(kind, EPConfig(tiny_checkpoint, world=2))
    try:
        keep = [True, True, True, True, False]
        out = group.forward(list(range(5)), PROMPTS, capture_layers=layers, keep_features=keep)
        assert all(c == {} for c in out.features[:4])  # kept on the ranks, not shipped
        for k in layers:  # request 4's rows come back with the result
            np.testing.assert_allclose(out.features[4][k], want[4][k][:len(PROMPTS[4])].astype(np.float16),
                                       rtol=1e-2, atol=1e-2)
        group.forward(list(range(5)), [[50, 51, 52]] * 5, capture_layers=layers, keep_features=keep)  # rejected
        group.truncate({i: len(p) for i, p in enumerate(PROMPTS)})
        group.forward(list(range(5)), second, capture_layers=layers, keep_features=keep)
        first = {i: (0, 2) for i in range(4)}
        rest = {i: (2, len(PROMPTS[i]) + len(second[i])) for i in range(4)}
        got = [{}, {}, {}, {}]
        for spans in (first, rest):  # in two takes, as a drafter catching up twice would
            for part in resolve(group.features(spans)):
                for rid, rows in part.items():
                    for k, v in rows.items():
                        got[rid][k] = np.concatenate([got[rid].get(k, v[:0]), v])
        for i in range(4):
            for k in layers:
                assert got[i][k].dtype == np.float16
                np.testing.assert_allclose(got[i][k], want[i][k].astype(np.float16), rtol=1e-2, atol=1e-2)
        assert sum(i["feature_rows"] for i in group.cache_info()) == 0  # taken rows are dropped
        with pytest.raises(LookupError):  # request 4 kept nothing on its rank
            resolve(group.features({4: (0, 1)}))
        group.release(list(range(5)))
    finally:
        group.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_dead_rank_fails_the_step_quickly_and_the_group_stays_down(tiny_checkpoint, kind):
    group = make_group(kind, EPConfig(tiny_checkpoint, world=2, step_timeout_s=60, group_timeout_s=20))
    group.forward([1, 2], [[1, 2], [3, 4]])
    kill_and_wait(group.workers[1])
    with pytest.raises(EPGroupError, match="rank failed") as failed:
        group.forward([1, 2], [[5], [6]])
    # Found dead, not waited out: the survivor is stuck in a collective, and a wait would end in
    # the step timeout's own message ("no answer within 60 s", "step exceeded 60 s").
    assert "no answer within" not in str(failed.value) and "exceeded" not in str(failed.value)
    assert not group.healthy
    with pytest.raises(EPGroupError, match="down"):
        group.forward([1], [[7]])


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_stopped_before_it_answers_fails_the_call_after_the_group_timeout(tiny_checkpoint, kind):
    """A rank stopped (SIGSTOP: a hung process) after its last collective, before it answers: the
    others answered, so it is waited for `group_timeout_s`, not the step timeout (a CI run spent
    its test's two minutes in such a wait). A call with no collective stands in for that moment."""
    group = make_group(kind, EPConfig(tiny_checkpoint, world=2, step_timeout_s=300, group_timeout_s=2))
    pid = group.ranks[1]["pid"]
    try:
        group.forward([1], [[1, 2]])
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EPGroupError, match="rank"):
            group.cache_info()
        assert time.monotonic() - start < 30 and not group.healthy
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        group.shutdown()


def test_a_call_without_a_straggler_bound_times_out_with_its_reason(tiny_checkpoint):
    """The start's wait (no bound after a first answer) names the timeout it ran out of."""
    import ray

    @ray.remote
    def hang():
        time.sleep(30)

    group = EPGroup.__new__(EPGroup)
    group.cfg, group._broken = EPConfig(tiny_checkpoint), None
    group.shutdown = lambda: None
    ref = hang.remote()
    try:
        with pytest.raises(EPGroupError, match=r"step exceeded 0 s \(a rank hung\)"):
            group._gather([ref], 0.2)
    finally:
        ray.cancel(ref, force=True)


@pytest.mark.parametrize("kind", KINDS)
def test_profile_samples_fit_the_cost_model(tiny_checkpoint, kind):
    group = make_group(kind, EPConfig(tiny_checkpoint, world=2))
    try:
        grid = ProfileGrid(requests=(1, 4), tokens_per_request=(1, 4, 8), contexts=(16, 48), repeats=1)
        samples = run_profile(group, grid, vocab_size=96)
        assert len(samples) == 12 and all(s.seconds > 0 for s in samples)
        parts = samples[-1].breakdown()
        assert parts["dispatch_s"] > 0 and parts["bytes_sent_max"] > 0
        assert 0 < parts["distinct_experts_per_layer"] <= 4
        model = fit_profile(samples, load_model(tiny_checkpoint).cfg.shape(), ep=2)
        assert all(model.predict(s.shape) > 0 for s in samples)
        assert group.cache_info()[0]["requests"] == 0  # profiling cleans up after itself
    finally:
        group.shutdown()


def test_a_rank_drops_what_is_not_a_call_and_keeps_serving(tiny_checkpoint, reference, tmp_path):
    """Frames a driver never sends — a pickle payload that would write a file when loaded,
    garbage, a call of a method outside the link's table — reach rank 1 over the control group:
    it runs none of them and answers the next real step exactly."""
    import pickle

    from actors.target import wire
    from tests.actors.test_wire import Trap

    trap = tmp_path / "ran"
    group = DriverGroup(EPConfig(tiny_checkpoint, world=2))
    try:
        for frame in (pickle.dumps(Trap(trap)), b"\x00" * 20_000, wire.call("target", "setup", (("h", 1),), True)):
            group.link.send(1, frame)
        first, _, _ = reference
        out = group.forward(list(range(5)), PROMPTS, with_logits=True)
        np.testing.assert_allclose(out.logits, first.logits, atol=1e-5)
        assert group.healthy and not trap.exists()
    finally:
        group.shutdown()
