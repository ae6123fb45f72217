"""Expert parallelism as a transform applied to a loaded model.

Each rank's model already holds only its experts (`checkpoint.load_model(first, count)`); this
swaps every MoE block's local `Dispatch` for one that sends (token, expert) pairs to their owner
with `all_to_all_single` (uneven splits) and brings the results back. The model code does not
change: the same `Dispatch.__call__` runs, only the two exchanges become collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from actors.target.model import MoETransformer
from actors.target.moe import Dispatch


class AllToAllDispatch(Dispatch):
    """Dispatch and combine over a torch.distributed group (gloo on CPU, nccl on GPU)."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world, self.group = rank, world, group

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        # counts: [E] pairs for each global expert; equal splits of E / world per rank.
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts, group=self.group)
        return out

    def exchange_rows(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        return out


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of the experts rank holds: contiguous, equal shares."""
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} EP ranks")
    per = num_experts // world
    return rank * per, per


def apply_expert_parallel(model: MoETransformer, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Make every MoE block of `model` exchange tokens with the other ranks."""
    first, count = expert_range(model.cfg.num_experts, rank, world)
    for block in model.moe_blocks():
        if (block.experts.first, block.experts.count) != (first, count):
            raise ValueError(f"rank {rank} holds experts {block.experts.first}+{block.experts.count}, "
                             f"expected {first}+{count}")
        block.dispatch = AllToAllDispatch(rank, world, group)
