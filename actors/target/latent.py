"""Multi-head latent attention (DeepSeek-V3) over a paged cache of the compressed latent.

Each token's keys and values are one shared latent: c = RMSNorm(kv_a(x)[:L]) of rank L plus a
single RoPE key k_rot of r dims. The cache stores [c ; k_rot] per token and layer (L + r values,
against 2 · heads · head_dim for grouped-query attention): `CacheSpec(kv_heads=1,
head_dim=L + r, value_dim=0)`.

The up-projection kv_b [heads · (nope + v), L] is absorbed rather than applied to every cached
key: a head's no-RoPE query q_nope is mapped into the latent space (q_lat = W_uk^T q_nope), scores
are q_lat · c + q_rot · k_rot, the weighted sum of the latents is taken and mapped out by W_uv.
That is the same arithmetic as expanding keys and values (transformers' form), reassociated:
logits agree within float rounding (tested at 1e-5 against `DeepseekV3ForCausalLM`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.target.config import MoEConfig
from actors.target.kv_cache import PagedKVCache, gather, scatter
from actors.target.layers import AttentionPlan, RMSNorm, apply_rope


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on dims laid out in pairs (x0, x1), (x2, x3), …, returned de-interleaved (evens, then
    odds), as DeepSeek's weights expect (`rope_interleave`); q and k both go through it, so their
    dot product is the pairwise rotation's."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


class LatentAttention(nn.Module):
    """MLA with DeepSeek-V3's checkpoint names (q_a_proj/q_a_layernorm/q_b_proj or q_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    # Layers whose weight this module multiplies itself (kv_b_proj's, absorbed into the queries
    # and the output) rather than calling them: they must stay plain linears (actors/target/fp8.py).
    reads_weights_of = ("kv_b_proj",)

    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads = layer, cfg.num_attention_heads
        self.nope, self.rot, self.v_dim = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        h, qk = cfg.hidden_size, cfg.qk_nope_head_dim + cfg.head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rot, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, h, bias=cfg.attention_bias)
        self.interleaved = cfg.rope_interleave
        self.scale = cfg.attention_scale

    def _latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries in the latent space [N, H, L + r] and the cache rows [N, L + r] of x [N, hidden]."""
        n = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(n, self.heads, -1).split([self.nope, self.rot], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rot], dim=-1)
        rope = apply_rope_interleaved if self.interleaved else apply_rope
        q_rot, k_rot = rope(q_rot, cos, sin), rope(k_rot[:, None], cos, sin)[:, 0]
        w_uk = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)[:, :self.nope]
        q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        return torch.cat([q_lat, q_rot], dim=-1), torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)

    def _out(self, attended: torch.Tensor) -> torch.Tensor:
        """o_proj of the per-head latent sums [N, H, L] mapped out through W_uv."""
        w_uv = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)[:, self.nope:]
        out = torch.einsum("nhl,hvl->nhv", attended, w_uv)
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.v_dim))

    def forward(self, x: torch.Tensor, plan: AttentionPlan, cache: PagedKVCache) -> torch.Tensor:
        if x.shape[0] == 0:  # an EP rank with no requests this step still runs the MoE collectives
            return torch.zeros_like(x)
        queries, rows = self._latent(x, plan.cos, plan.sin)
        scatter(cache.k[self.layer], plan.write_slots, rows[:, None])
        def keys_of(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys = gather(cache.k[self.layer], slots).transpose(1, 2).to(x.dtype)  # [R, 1, T, L + r]
            return keys, keys[..., :self.rank]

        return self._out(plan.attend(queries, keys_of, scale=self.scale, enable_gqa=True))  # [N, H, L] in flat order

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over whole sequences, no cache (training). x: [B, T, H]."""
        b, t, _ = x.shape
        queries, rows = self._latent(x.reshape(b * t, -1), cos.repeat(b, 1), sin.repeat(b, 1))
        queries = queries.view(b, t, self.heads, -1).transpose(1, 2)
        keys = rows.view(b, 1, t, -1)
        out = F.scaled_dot_product_attention(queries, keys, keys[..., :self.rank], is_causal=True, scale=self.scale,
                                             enable_gqa=True)
        return self._out(out.transpose(1, 2).reshape(b * t, self.heads, self.rank)).view(b, t, -1)
