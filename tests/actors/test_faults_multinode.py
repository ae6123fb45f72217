"""Losing whole nodes of a real multi-node Ray cluster (`ray.cluster_utils.Cluster.remove_node`)
under a running engine: nothing in flight is lost and greedy outputs stay those of plain decoding."""

from __future__ import annotations

import pytest
from ray.cluster_utils import Cluster

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.inprocess import resolve
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41, 42], [3], [11, 12, 13, 11], [60, 61, 62, 63]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(multinode):
    # The head holds no CPUs, so every actor lands on a worker node that a test can remove (three
    # tests remove one each, and each needs three nodes after that).
    yield from multinode(head_cpus=0, worker_cpus=[1] * 6)


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    return greedy_decode(LocalTarget(load_model(f"{tiny_bundle}/target")), list(range(len(PROMPTS))), PROMPTS,
                         MAX_TOKENS)


def node_of(replica) -> str:
    return resolve(replica.whereabouts.remote())["node"]


def remove(cluster: Cluster, node_id: str) -> None:
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    cluster.remove_node(node)


def engine(bundle: str, tmp_path, **kw) -> Engine:
    cfg = dict(target_dir=f"{bundle}/target", drafter="block", drafter_dir=f"{bundle}/drafter", policy="full",
               block=6, cpus_per_rank=1.0,
               cpus_per_drafter=0.5, threads_per_rank=1, cost_model_cache=str(tmp_path))
    return Engine(EngineConfig(**(cfg | kw)))


@pytest.mark.parametrize("in_process", [True, False])
def test_losing_an_ep_ranks_node_rebuilds_the_group_elsewhere_and_requests_resume(cluster, tiny_bundle, reference,
                                                                               tmp_path, with_fault, in_process):
    """Driven (in_process): rank 0 is this process (on the head), rank 1 and the drafter it hosts
    on a worker node. Actors: both ranks and the drafter replica on worker nodes of their own."""
    eng = engine(tiny_bundle, tmp_path, ep=2, ep_placement="STRICT_SPREAD", in_process=in_process)
    try:
        before = [r["node"] for r in eng.target.ranks]
        victim = before[1]
        assert len(set(before)) == 2
        if in_process:
            assert [node_of(r) for r in eng.replicas] == before  # each rank hosts its drafter
        else:
            assert node_of(eng.replicas[0]) not in before
        out = with_fault(eng, PROMPTS, MAX_TOKENS, lambda: remove(cluster, victim))
        assert out == reference
        assert eng.degraded["ep_group_rebuilt"] == 1 and eng.target.healthy
        after = {r["node"] for r in eng.target.ranks}
        assert len(after) == 2 and victim not in after
    finally:
        eng.shutdown()


def test_losing_a_drafter_replicas_node_loses_no_request(cluster, tiny_bundle, reference, tmp_path, with_fault):
    cluster.add_node(num_cpus=1)  # room for the replacement replica
    cluster.wait_for_nodes()
    eng = engine(tiny_bundle, tmp_path, ep=1, in_process=False)  # a drafter of its own, on its own node
    try:
        victim = node_of(eng.replicas[0])
        assert victim not in {r["node"] for r in eng.target.ranks}
        out = with_fault(eng, PROMPTS, MAX_TOKENS, lambda: remove(cluster, victim))
        assert out == reference
        assert eng.degraded["drafter_replica_lost"] == 1
        assert node_of(eng.replicas[0]) != victim  # the replacement runs elsewhere
        again = eng.generate(PROMPTS[:2], [SamplingParams(max_tokens=MAX_TOKENS)] * 2)
        assert [s.output for s in again] == reference[:2] and sum(sum(s.drafted) for s in again) > 0
    finally:
        eng.shutdown()
