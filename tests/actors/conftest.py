"""Shared set-up of the actor tests: a real multi-node Ray cluster on this machine, and a fault
injected into a running engine."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.engine.sequence import SamplingParams
from actors.ray_env import start_local_ray


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (modules opt in with `pytest.mark.usefixtures`); modules
    on a multi-node cluster use `multinode` instead."""
    start_local_ray(num_cpus=8)
    yield
    ray.shutdown()


def multinode_cluster(head_cpus: int, worker_cpus: list[int]) -> Iterator[Cluster]:
    """Head + one node per entry of worker_cpus, the driver connected; torn down afterwards.
    Module-scoped fixtures yield from it (a cluster takes seconds to start)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    for cpus in worker_cpus:
        c.add_node(num_cpus=cpus)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="session")
def multinode():
    """`multinode_cluster`, for module fixtures: `yield from multinode(head_cpus, worker_cpus)`."""
    return multinode_cluster


def run_with_fault(eng, prompts: list[list[int]], max_tokens: int, fault) -> list[list[int]]:
    """Start every prompt, take three steps, call `fault()` mid-stream, run to the end; the
    outputs in prompt order."""
    rids = [eng.add(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    for _ in range(3):
        eng.step()
    assert any(s.output for s in eng.scheduler.running)  # the fault lands mid-stream
    fault()
    while eng.pending:
        eng.step()
    return [eng.claim(rid).output for rid in rids]


@pytest.fixture(scope="session")
def with_fault():
    """`run_with_fault`, for tests."""
    return run_with_fault


def kill_and_wait(actor, timeout_s: float = 60.0) -> None:
    """ray.kill a target rank, and wait until its process is gone. ray.kill returns before the
    process dies, and Ray reports the actor dead (its `ping`, answered beside a driven rank's
    serve loop, fails) while the process may still run a moment and answer the unit's own link:
    so the wait is for the process id itself (every node of these tests is on this machine)."""
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=timeout_s)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.05)
    raise AssertionError("the actor's process outlived ray.kill")


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie awaiting its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def holding_drafts(eng, steps: int):
    """The engine's `plan`, asking for no drafts in its first `steps` steps."""
    plan = eng.plan

    def held(st):
        p = plan(st)
        return dataclasses.replace(p, lengths=p.lengths * (eng.history.steps >= steps))

    return held
