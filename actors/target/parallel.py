"""Expert parallelism as a transform applied to a loaded model.

Each rank's model already holds only its experts (`checkpoint.load_model(first, count)`); this
swaps every MoE block's local `Dispatch` for one that sends (token, expert) pairs to their owner
with an all-to-all (uneven splits) and brings the results back. The model code does not change:
the same `Dispatch.__call__` runs, only the two exchanges become collectives.

The group is a standalone torch.distributed backend (`join_groups`), not the process's default
group: one process can hold several (the driver rank of an engine lives in the coordinator's
process, and a test process may run two engines), and a failed group is dropped, not destroyed.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from actors.target.model import MoETransformer
from actors.target.moe import Dispatch


class AllToAllDispatch(Dispatch):
    """Dispatch and combine over a torch.distributed group (gloo on CPU, nccl on GPU)."""

    def __init__(self, rank: int, world: int, group) -> None:
        self.rank, self.world, self.group = rank, world, group

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        # counts: [E] pairs for each global expert; equal splits of E / world per rank.
        out = torch.empty_like(counts)
        self.group.alltoall_base(out, counts, [], [], dist.AllToAllOptions()).wait()
        return out

    def exchange_rows(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), rows.shape[1]))
        self.group.alltoall_base(out, rows.contiguous(), recv, send, dist.AllToAllOptions()).wait()
        return out


def join_groups(master: tuple[str, int], rank: int, world: int, backend: str, timeout_s: float,
                rendezvous_s: float = 120.0):
    """(store, data group, control group) of one EP unit. The data group (gloo, or nccl on GPUs)
    carries the MoE exchanges and fails a collective after `timeout_s`; the control group (always
    gloo, on CPU tensors) carries the driver's step plans (`link.RankLink`) and has no practical
    timeout, since an idle rank waits on it for as long as no request comes. Rank 0 serves the
    rendezvous store at `master`, which waits `rendezvous_s` for the others: a rank replacing a lost
    one starts a process and imports torch first, which can take longer than a collective may."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master[0], master[1], world, rank == 0, timeout=datetime.timedelta(seconds=rendezvous_s))
    if backend == "nccl":
        # A failed or timed-out collective must raise in the step (the engine then rebuilds the
        # unit, as on gloo), not tear the process down, which is NCCL's default: abort only the
        # communicator (2) and make waits blocking, so the error reaches the calling thread.
        # Read when the group is made; an operator's own setting wins. Unverified until a GPU
        # run (tests/gpu/README.md).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world, opts)
    else:
        data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world, timeout)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, datetime.timedelta(days=365))
    return store, data, control


def all_agree(group, ok: bool, device: str = "cpu") -> bool:
    """True on every rank iff `ok` on every rank (one all-reduce of a flag)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)  # nccl: device tensors only
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of the experts rank holds: contiguous, equal shares."""
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} EP ranks")
    per = num_experts // world
    return rank * per, per


def apply_expert_parallel(model: MoETransformer, rank: int, world: int, group) -> None:
    """Make every MoE block of `model` exchange tokens with the other ranks."""
    first, count = expert_range(model.cfg.num_experts, rank, world)
    for block in model.moe_blocks():
        if (block.experts.first, block.experts.count) != (first, count):
            raise ValueError(f"rank {rank} holds experts {block.experts.first}+{block.experts.count}, "
                             f"expected {first}+{count}")
        block.dispatch = AllToAllDispatch(rank, world, group)
