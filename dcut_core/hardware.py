"""Hardware and model presets for the cost model and the simulator.

Plain data. Accelerator figures are vendor peak numbers (dense bf16 FLOP/s, HBM bandwidth);
all-to-all figures are DeepEP's published measurements (../shared/PUBLISHED.md): a fixed
per-layer latency that grows with the EP size, and a bandwidth that drops once EP leaves one
NVLink domain (8 GPUs) for RDMA. Which preset a running machine matches is decided in `actors/`
(it owns devices); this module only holds the numbers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

# DeepEP low-latency kernels, 128 tokens: EP size -> (dispatch µs, combine µs).
_A2A_LATENCY_US: dict[int, tuple[float, float]] = {
    8: (77.0, 114.0),
    16: (118.0, 195.0),
    32: (155.0, 273.0),
    64: (173.0, 314.0),
    128: (192.0, 369.0),
}
NVLINK_DOMAIN = 8  # GPUs per node sharing NVLink


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its interconnects."""

    name: str
    peak_flops: float  # dense FLOP/s at the serving precision
    mem_bw: float  # bytes/s
    launch_s: float  # fixed per-step overhead (kernel launches, scheduling)
    nvlink_bw: float  # bytes/s, all-to-all inside a node
    rdma_bw: float  # bytes/s, all-to-all across nodes

    def a2a_latency_s(self, ep: int) -> float:
        """Fixed latency of one dispatch + combine pair per MoE layer at EP size `ep`."""
        if ep <= 1:
            return 0.0
        sizes = sorted(_A2A_LATENCY_US)
        if ep <= sizes[0]:
            # Inside one node, scale the EP8 figure down with log2(ep) (EP2 ≈ a third of EP8).
            d, c = _A2A_LATENCY_US[sizes[0]]
            return (d + c) * 1e-6 * math.log2(ep) / math.log2(sizes[0])
        for lo, hi in itertools.pairwise(sizes):
            if ep <= hi:
                t = (math.log2(ep) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
                return 1e-6 * ((1 - t) * sum(_A2A_LATENCY_US[lo]) + t * sum(_A2A_LATENCY_US[hi]))
        return 1e-6 * sum(_A2A_LATENCY_US[sizes[-1]])

    def a2a_bw(self, ep: int) -> float:
        return self.nvlink_bw if ep <= NVLINK_DOMAIN else self.rdma_bw


HARDWARE: dict[str, Hardware] = {
    # This project's CI machine: 2 cores; gloo over loopback stands in for the interconnect.
    "cpu": Hardware("cpu", 1.0e11, 2.0e10, 2.0e-3, 1.0e9, 1.0e9),
    "a100": Hardware("a100", 312e12, 2.0e12, 1.0e-3, 150e9, 45e9),
    "h20": Hardware("h20", 148e12, 4.0e12, 1.0e-3, 153e9, 50e9),
    "h100": Hardware("h100", 989e12, 3.35e12, 1.0e-3, 153e9, 50e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 1.0e-3, 153e9, 50e9),
}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a transformer. experts == 0 means dense."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (dense layers) or 0
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layers: int = 0
    param_bytes: int = 2
    act_bytes: int = 2
    # Multi-head latent attention (DeepSeek-V3) when kv_lora_rank > 0: head_dim is then the RoPE
    # part of a query/key head, and each token caches one latent of kv_lora_rank + head_dim
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate  # SwiGLU: gate, up, down

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention."""
        if not self.latent:
            return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        qk = self.qk_nope_head_dim + self.head_dim
        q = (self.hidden * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank
             else self.hidden * self.heads * qk)
        kv = self.hidden * (self.kv_lora_rank + self.head_dim)
        kv += self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + self.heads * self.v_head_dim * self.hidden

    @property
    def kv_per_token(self) -> int:
        """Values one token keeps in one layer's cache: K and V of every KV head, or MLA's latent."""
        return self.kv_lora_rank + self.head_dim if self.latent else 2 * self.kv_heads * self.head_dim

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs of one query against one cached key in one layer (scores and weighted values);
        MLA attends in the latent space (the up-projection absorbed into query and output)."""
        if self.latent:
            return 2 * self.heads * (2 * self.kv_lora_rank + self.head_dim)
        return 4 * self.heads * self.head_dim

    @property
    def dense_params(self) -> int:
        """Parameters every token passes through: attention, dense/shared MLP, LM head."""
        dense_layers = self.layers - self.moe_layers
        mlp = 3 * self.hidden * (self.intermediate * dense_layers + self.shared_intermediate * self.moe_layers)
        return self.layers * self.attention_params + mlp + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Every weight: embedding and LM head (untied), attention, dense MLPs, all experts."""
        return self.dense_params + self.vocab * self.hidden + self.moe_layers * self.experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Weights one token passes through (the top-k experts of each MoE layer), LM head included."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params


MODELS: dict[str, ModelShape] = {
    "dense-8b": ModelShape("dense-8b", 36, 4096, 32, 8, 128, 151936, 12288),
    "moe-35b-a3b": ModelShape(
        "moe-35b-a3b", 40, 2048, 16, 2, 128, 151936, 0,
        experts=256, top_k=8, expert_intermediate=512, shared_intermediate=512, moe_layers=40,
    ),
    "moe-295b-a21b": ModelShape(
        "moe-295b-a21b", 64, 4096, 64, 8, 128, 128000, 0,
        experts=192, top_k=8, expert_intermediate=1536, shared_intermediate=1536, moe_layers=64,
    ),
}
