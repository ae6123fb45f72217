"""Sparse MoE block: top-k softmax router, SwiGLU experts, and the expert dispatch.

The block computes routing and delegates "send every (token, expert) pair to the rank that
holds the expert, run it there, bring the result back" to a `Dispatch`. With one rank that is a
local regroup; with N ranks (`actors/target/parallel.py`) it is two `all_to_all_single` calls
with uneven splits. Both share this module's code, so the single-process model *is* the EP model
with N = 1.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from actors.target.config import MoEConfig
from actors.target.layers import SwiGLU
from actors.target.layout import cpu_linear


@dataclass
class StepStats:
    """Where one forward's time went on this rank, and what it sent."""

    total_s: float = 0.0
    attention_s: float = 0.0
    experts_s: float = 0.0
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    bytes_sent: int = 0  # expert rows sent to other ranks, dispatch + combine
    distinct_experts: int = 0  # Σ over MoE layers of this rank's experts that got at least one token
    moe_layers: int = 0
    tokens: int = 0
    requests: int = 0
    context: int = 0  # Σ over requests of cached tokens before this forward
    graph_captures: int = 0  # CUDA graphs captured in this forward (70–100 ms each: not a step's cost)
    per_layer: list[int] = field(default_factory=list, repr=False)
    # [E] pairs per expert of each MoE layer that counted on the device only (one rank, grouped
    # experts: nothing on the host needs the counts), read back with the step's results (`settle`)
    unread: list[torch.Tensor] = field(default_factory=list, repr=False, init=False, compare=False)

    def unread_counts(self) -> torch.Tensor | None:
        """The layers' unread counts as one [layers, E] tensor to download with the step's results."""
        return torch.stack(self.unread) if self.unread else None

    def settle(self, counts=None) -> StepStats:
        """Fold the unread counts in (`counts`: their host copy, else read here); returns self."""
        if self.unread:
            rows = (self.unread_counts() if counts is None else counts).tolist()
            self.unread = []
            for row in rows:
                self.count_layer(row)
        return self

    def count_layer(self, counts: list[int]) -> None:
        touched = sum(c > 0 for c in counts)
        self.distinct_experts += touched
        self.per_layer.append(touched)
        self.moe_layers += 1

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.attention_s - self.experts_s - self.dispatch_s - self.combine_s)


@functools.cache
def grouped_mm_runs(device: str, dtype: torch.dtype, without_host: bool = False) -> bool:
    """Whether torch's grouped matmul (`F.grouped_mm`) runs on this device in this dtype —
    probed once on a tiny problem; `without_host`: and without waiting for the host. Torch runs
    it on the CPU in any float dtype; on CUDA its one kernel takes bfloat16 on SM 9.x/10.x, and
    every other dtype goes through a fallback that copies the groups' ends to the host and
    loops over them. The fallback still beats one matmul per expert from Python (H200,
    2026-12-04, float16: 10.1 ms a decode forward with 12 host waits against 16.9 ms with 6), so
    the experts take it; only a CUDA graph needs the kernel itself (`actors/target/graphs.py`)."""
    if not hasattr(F, "grouped_mm"):
        return False
    cuda = torch.device(device).type == "cuda"
    try:
        a = torch.zeros(16, 16, device=device, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
        if cuda and without_host:
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")  # the host fallback's copy raises here
        try:
            F.grouped_mm(a, b, offs=offs)
        finally:
            if cuda and without_host:
                torch.cuda.set_sync_debug_mode("default")
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class LocalExperts(nn.Module):
    """The experts this rank holds: global ids first .. first + count - 1, fused weights.

    On a GPU they run as two grouped matmuls over every expert's rows at once (one kernel each,
    the groups' ends read on the device); elsewhere as one matmul per expert that has rows — on
    the CPU as fast, posed by `cpu_linear` (actors/target/layout.py), and with `F.linear` the
    exactness reference. `grouped`: None decides by the device (GPU:
    grouped where torch runs it), True or False forces a path (tests compare them)."""

    def __init__(self, hidden: int, intermediate: int, first: int, count: int) -> None:
        super().__init__()
        self.first, self.count = first, count
        self.gate_up = nn.Parameter(torch.empty(count, 2 * intermediate, hidden))  # [E_r, 2I, H]
        self.down = nn.Parameter(torch.empty(count, hidden, intermediate))  # [E_r, H, I]
        self.grouped: bool | None = None

    def uses_grouped(self, rows: torch.Tensor) -> bool:
        if self.grouped is not None:
            return self.grouped
        return rows.device.type == "cuda" and grouped_mm_runs(str(rows.device), rows.dtype)

    def forward(self, rows: torch.Tensor, counts: list[int] | None, on_device: torch.Tensor | None = None
                ) -> torch.Tensor:
        """rows [M, H] grouped by local expert (counts[e] rows each; `on_device`: the same counts
        as a tensor on the rows' device, for the grouped path, which then needs no `counts`) ->
        outputs [M, H]."""
        if self.uses_grouped(rows):
            if on_device is None:
                on_device = torch.tensor(counts, device=rows.device)
            ends = on_device.cumsum(0).to(torch.int32)
            gate, up = F.grouped_mm(rows, self.gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=ends)
        out = torch.empty_like(rows)
        start = 0
        for e, c in enumerate(counts):
            if c:
                gate, up = cpu_linear(rows[start:start + c], self.gate_up[e]).chunk(2, dim=-1)
                out[start:start + c] = cpu_linear(F.silu(gate) * up, self.down[e])
                start += c
        return out


class Dispatch:
    """Runs (token, expert) pairs on the experts' owners. This base class is one rank, no comms."""

    world = 1
    rank = 0

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts

    def exchange_rows(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        return rows

    @staticmethod
    def _combine(back: torch.Tensor, order: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """[n, H]: each token's k expert outputs (`back`, in `order`) weighted and summed in a
        fixed order."""
        y = torch.empty_like(back)
        y[order] = back
        n, k = topk_w.shape
        return (y.view(n, k, back.shape[1]) * topk_w[..., None].to(y.dtype)).sum(1)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 experts: LocalExperts, num_experts: int, stats: StepStats | None) -> torch.Tensor:
        k = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)  # [n·k] global expert of each pair
        order = torch.argsort(flat, stable=True)  # sorted by expert, hence by owning rank
        t0 = time.perf_counter()
        # [E] pairs per global expert (not `bincount`: on a GPU it reads the largest id to the host)
        send_e = flat.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat))
        if self.world == 1 and experts.uses_grouped(x):
            # One rank, grouped experts: the pairs sorted by expert are the experts' rows in order,
            # and the grouped matmul reads the groups' ends on the device: no host synchronisation.
            out = self._combine(experts(x[order // k], None, send_e), order, topk_w)
            if stats is not None:
                stats.experts_s += time.perf_counter() - t0
                stats.unread.append(send_e)
            return out
        if self.world == 1:
            # One rank: the pairs sorted by expert are the experts' rows in order already (the
            # regrouping below would be the identity), and one copy of the counts reads them.
            counts = send_e.tolist()
            t1 = time.perf_counter()
            done = experts(x[order // k], counts)
            t2 = time.perf_counter()
            out = self._combine(done, order, topk_w)
            if stats is not None:
                stats.dispatch_s += t1 - t0
                stats.experts_s += t2 - t1
                stats.combine_s += time.perf_counter() - t2
                stats.count_layer(counts)
            return out
        recv_e = self.exchange_counts(send_e)  # [E]: from rank s to my expert j at s·E_r + j
        per_rank = num_experts // self.world
        # The layer's one host synchronisation: both count vectors in one copy. The all-to-all's
        # split sizes and the expert loop's row counts are host integers; all follow from these.
        both = torch.cat([send_e, recv_e]).tolist()
        send_l, recv_l = both[:num_experts], both[num_experts:]
        send = [sum(send_l[r * per_rank:(r + 1) * per_rank]) for r in range(self.world)]
        recv = [sum(recv_l[r * per_rank:(r + 1) * per_rank]) for r in range(self.world)]
        counts = [sum(recv_l[r * per_rank + j] for r in range(self.world)) for j in range(per_rank)]
        rows = self.exchange_rows(x[order // k], recv, send)  # [Σ recv, H] by (source, expert)
        t1 = time.perf_counter()
        # Regroup the received rows by local expert, run them, restore the arrival order.
        local_e = torch.repeat_interleave(torch.arange(per_rank, device=recv_e.device).repeat(self.world), recv_e,
                                          output_size=sum(recv))  # sized on the host: no second sync
        by_expert = torch.argsort(local_e, stable=True)
        done = torch.empty_like(rows)
        on_device = recv_e.view(self.world, per_rank).sum(0) if experts.uses_grouped(rows) else None
        done[by_expert] = experts(rows[by_expert], counts, on_device)
        t2 = time.perf_counter()
        back = self.exchange_rows(done, send, recv)  # [n·k, H] in `order`
        t3 = time.perf_counter()
        out = self._combine(back, order, topk_w)
        if stats is not None:
            stats.dispatch_s += t1 - t0
            stats.experts_s += t2 - t1
            stats.combine_s += t3 - t2
            stats.bytes_sent += 2 * (sum(send) - send[self.rank]) * x.shape[1] * x.element_size()
            stats.count_layer(counts)
        return out


class MoEBlock(nn.Module):
    """Router + experts (+ optional gated shared expert), Qwen3-MoE / Qwen2-MoE semantics."""

    def __init__(self, cfg: MoEConfig, first_expert: int = 0, local_experts: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        count = cfg.num_experts if local_experts is None else local_experts
        self.experts = LocalExperts(cfg.hidden_size, cfg.moe_intermediate_size, first_expert, count)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.grouped = cfg.router == "sigmoid_grouped"
        if self.grouped:  # DeepSeek-V3 / GLM-4-MoE routing (`_route_grouped`)
            self.n_group, self.topk_group, self.scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.dispatch = Dispatch()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts [n, k] and their weights [n, k] for each token."""
        if self.grouped:
            return self._route_grouped(x)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights.to(x.dtype)

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores; experts are chosen by score + correction bias, only within the
        `topk_group` groups whose two best biased scores sum highest; their weights are the
        unbiased scores, renormalised (norm_topk_prob) and times routed_scaling_factor."""
        n = x.shape[0]
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # [n, E]
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(n, self.n_group, -1).topk(2, dim=-1).values.sum(-1)  # [n, G]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1).indices, 1.0)
        keep = keep.repeat_interleave(self.num_experts // self.n_group, dim=1).bool()
        idx = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, (weights * self.scale).to(x.dtype)

    def load_balance_loss(self, x: torch.Tensor) -> torch.Tensor:
        """Switch-style auxiliary loss E · Σ_e (fraction routed to e) · (mean router prob of e);
        1.0 when routing is uniform. Training only."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, E]
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        fraction = torch.zeros(self.num_experts).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        fraction = fraction / chosen.numel()
        return self.num_experts * (fraction * probs.mean(0)).sum()

    def forward(self, x: torch.Tensor, stats: StepStats | None = None) -> torch.Tensor:
        idx, weights = self.route(x)
        out = self.dispatch(x, idx, weights, self.experts, self.num_experts, stats)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # Qwen2-MoE gates it; GLM-4-MoE does not
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
