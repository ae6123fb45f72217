"""Which GPU a rank that runs in the caller's process serves on (#29: rank 0 gets its own GPU in
every layout, set from Ray's assignment).

A rank that is a Ray actor asked for `num_gpus` and sees only its GPUs (Ray sets
CUDA_VISIBLE_DEVICES): its `cuda` is its own. Rank 0 runs in the caller's process instead (EP 1 in
process; rank 0 of a driver group). Under Serve that process is the engine replica, placed in the
unit's bundle with its GPU, so Ray assigned it one as well. Outside Serve (`dcut generate`,
`dcut bench`, a script) it is a plain driver: Ray assigned it nothing, and `cuda` would be
physical GPU 0 — which Ray may also hand to rank 1, and NCCL refuses two ranks on one GPU. There
a `GpuHolder` actor takes a GPU from Ray in rank 0's bundle (or on this node) and keeps it while
the rank lives; rank 0 serves on that GPU, named as this process's torch sees it.
"""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy


@ray.remote(num_cpus=0)
class GpuHolder:
    """Holds a GPU of Ray's for a rank in another process (its driver's) while it lives."""

    def gpu(self) -> str:
        return str(ray.get_gpu_ids()[0])


def torch_index(gpu_id: str, visible: str | None) -> int:
    """The torch device index, in a process whose CUDA_VISIBLE_DEVICES is `visible` (None or
    empty: every GPU, in physical order), of the GPU Ray calls `gpu_id`."""
    if not visible:
        return int(gpu_id)
    names = [v.strip() for v in visible.split(",")]
    if gpu_id not in names:
        raise RuntimeError(f"Ray gave rank 0 GPU {gpu_id}, which this process cannot see "
                           f"(CUDA_VISIBLE_DEVICES={visible}); unset it or include that GPU")
    return names.index(gpu_id)


def local_rank_device(gpus: float, pg=None, bundle: int = 0, timeout_s: float = 120.0) -> tuple[str, object]:
    """(device, holder) for a rank in this process: "cpu" without GPUs; "cuda:0" when Ray
    assigned this process its GPU (a Serve replica); else the GPU a `GpuHolder` was given, in
    `bundle` of `pg` (or on this node), and the holder, to be killed with the rank."""
    if not gpus:
        return "cpu", None
    if ray.get_gpu_ids():
        return "cuda:0", None
    strategy = (PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle) if pg is not None else
                NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False))
    holder = GpuHolder.options(num_gpus=gpus, scheduling_strategy=strategy).remote()
    try:
        gpu_id = ray.get(holder.gpu.remote(), timeout=timeout_s)
    except Exception:
        ray.kill(holder)
        raise
    return f"cuda:{torch_index(gpu_id, os.environ.get('CUDA_VISIBLE_DEVICES'))}", holder


def memory_in_use(device) -> tuple[int, int]:
    """(bytes in use, total bytes) of the GPU `device`, as a new allocation there sees it: what the
    device reports used, less what this process's caching allocator keeps for no tensor. torch
    keeps freed blocks, and the device counts them as used: after a rank in this process closed
    (a rebuilt unit, a second engine), its whole KV cache would otherwise look taken (found on
    the first GPU run: "room for only 0 KV tokens, 123.8 of 139.8 GiB in use")."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return total - free - idle, total


def release_gpu(holder) -> None:
    """Give a `GpuHolder`'s GPU back to Ray (None: nothing held)."""
    if holder is not None:
        ray.kill(holder, no_restart=True)
