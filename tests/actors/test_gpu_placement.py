"""Rank 0 gets its own GPU in every layout (#29 item 4), checked on a Ray cluster whose head
declares two (fake) GPUs: Ray hands out GPU ids and CUDA_VISIBLE_DEVICES exactly as on a GPU
node, though nothing here touches CUDA."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.target.driver import DriverGroup
from actors.target.gpu import local_rank_device, release_gpu, torch_index
from actors.target.group import EPConfig


def test_a_gpu_id_is_named_as_this_process_sees_it():
    assert torch_index("3", None) == 3 and torch_index("3", "") == 3
    assert torch_index("3", "2,3") == 1
    with pytest.raises(RuntimeError, match="cannot see"):
        torch_index("0", "2,3")


@pytest.fixture(scope="module")
def two_gpus():
    ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False})
    ray.init(address=c.address, log_to_driver=False)
    yield
    ray.shutdown()
    c.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]

    def rank_device(self) -> tuple[str, object]:
        return local_rank_device(1.0)


@pytest.mark.usefixtures("two_gpus")
def test_rank_0_in_a_driver_holds_its_own_gpu_and_no_other_rank_gets_it(monkeypatch):
    """Outside Serve rank 0 runs in the driver, to whom Ray assigned no GPU: its bundle reserves
    one, a holder takes it, and rank 0 serves on that GPU; rank 1's bundle gets the other one.
    Released with the group, the GPU is Ray's again."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = EPConfig("unused", world=2, gpus_per_rank=1.0, cpus_per_rank=1.0)
    bundles = DriverGroup._bundles(cfg)
    assert bundles[0]["GPU"] == 1.0 and bundles[1]["GPU"] == 1.0
    pg = placement_group(bundles, strategy="PACK", bundle_label_selector=DriverGroup._selectors(cfg))
    ray.get(pg.ready(), timeout=60)
    try:
        device, holder = local_rank_device(1.0, pg, 0)
        rank1 = Probe.options(num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=1)).remote()
        (other,) = ray.get(rank1.gpus.remote())
        assert device == f"cuda:{ray.get(holder.gpu.remote())}" and device != f"cuda:{other}"
        assert {device, f"cuda:{other}"} == {"cuda:0", "cuda:1"}
        release_gpu(holder)
        ray.kill(rank1)
    finally:
        remove_placement_group(pg)
    device, holder = local_rank_device(1.0)  # on this node, without a group (EP 1 in process)
    assert device in ("cuda:0", "cuda:1")
    release_gpu(holder)
    assert local_rank_device(0.0) == ("cpu", None)


@pytest.mark.usefixtures("two_gpus")
def test_a_process_ray_gave_a_gpu_serves_on_it_without_a_holder():
    """A Serve replica sits in its unit's GPU bundle: Ray assigned it a GPU (and made it the only
    one it sees), so rank 0 serves on `cuda:0` and holds nothing more."""
    probe = Probe.options(num_gpus=1).remote()
    assert ray.get(probe.rank_device.remote()) == ("cuda:0", None)
    ray.kill(probe)
