"""Dense building blocks of the target: RMSNorm, rotary embedding, paged GQA attention, SwiGLU."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from actors.target.config import MoEConfig
from actors.target.host import upload
from actors.target.kv_cache import PagedKVCache, gather, scatter
from actors.target.rope import Rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32, cast back, then scaled, as transformers does; `F.rms_norm` is one
        # op (a fused kernel on a GPU) where pow, mean, add, rsqrt and mul were five launches.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


_rotary = functools.lru_cache(maxsize=16)(Rotary)  # one table per (dims, theta): drafters ask every pass


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] for the (non-interleaved, rotate-half) rotary embedding."""
    return _rotary(head_dim, theta).cos_sin(positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, d], d ≤ D: the first d dims rotate, the rest pass through
    (partial rotary, GLM-4-MoE)."""
    if cos.shape[-1] < x.shape[-1]:
        d = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


# Requests appending at most this many tokens (decoding, verifying drafts) attend as one padded
# batch; longer chunks (prefill) attend in groups of like length. One padded batch pads every
# request to the longest chunk's queries: a step of 46 decoding requests beside a 120-token
# prompt chunk cost 226 ms on the bundled model, against 86 + 74 ms for its two parts.
QUERY_SPAN = 32
# Within a span, a step's requests attend in groups that pad fewer (query, key) pairs: one padded
# batch reads every request's keys to the longest one's and its queries to the longest chunk's (on
# the bundled model at 16-64 requests of 20-300 context tokens a step took what one of uniform
# 300-token contexts takes, 1.1-1.45 x one of uniform 160; at 64 requests of which a quarter verify
# 8 tokens and the rest 1, a cut by queries took 0.86-0.90 x: docs/benchmarks.md, session 39). A
# group is cut off where that saves at least `GROUP_SAVING` of the padded pairs and
# `GROUP_PAIRS_SAVED` of them, and keeps `GROUP_LEAST` requests; a span of fewer than
# `GROUP_FROM` requests is not cut: each group is one more attention call, gather and mask a layer,
# and at 16 decoding requests the cuts cost what they saved (0.94-1.03 x end to end).
GROUP_SAVING = 0.15
GROUP_PAIRS_SAVED = 4096
GROUP_LEAST = 4
GROUP_FROM = 32
GROUP_DEVICES = ("cpu",)  # where the trade was measured (tests/gpu/test_cuda.py checks CUDA's exactness)


@dataclass
class AttentionGroup:
    """Requests that attend together: their queries and keys padded to the group's longest."""

    key_slots: torch.Tensor  # [R_g, T] cache slots of every key of each request (padded with 0)
    mask: torch.Tensor  # [R_g, 1, Q, T] bool: query j of request i may attend to key t
    q_index: torch.Tensor  # [R_g, Q] flat token index of each padded query (0 for padding)
    valid: torch.Tensor  # [N_g] where each valid query sits in the padded [R_g · Q], in flat order
    rows: torch.Tensor | None  # [N_g] flat token index of each valid query in order (None: all N, in order)


@dataclass
class AttentionPlan:
    """Where one forward's tokens go in the paged cache and who attends to what (all layers).
    Built on the host once a forward and uploaded; a layer only gathers by its indices (no index
    by a boolean mask: on a GPU that reads the mask to the host, once a layer)."""

    write_slots: torch.Tensor  # [N] cache slot of each new token
    groups: list[AttentionGroup]  # one unless chunks of very different lengths share the forward
    cos: torch.Tensor  # [N, D]
    sin: torch.Tensor  # [N, D]

    def attend(self, q: torch.Tensor, keys_of, **sdpa) -> torch.Tensor:
        """Scaled-dot-product attention of the flat queries q [N, H, D], group by group, over
        keys_of(key_slots) -> (keys, values) [R_g, H_kv, T, ·]; [N, H, D_v] in flat order."""
        out = None
        for g in self.groups:
            keys, values = keys_of(g.key_slots)
            o = F.scaled_dot_product_attention(q[g.q_index].transpose(1, 2), keys, values, attn_mask=g.mask,
                                               **sdpa).transpose(1, 2)
            o = o.reshape(-1, *o.shape[2:])[g.valid]
            if g.rows is None:
                return o
            if out is None:
                out = o.new_empty((q.shape[0], *o.shape[1:]))
            out[g.rows] = o
        return out


@dataclass(frozen=True)
class Padding:
    """Fixed shapes for a forward replayed as a CUDA graph (actors/target/graphs.py): the
    requests, the queries of each and the keys of each padded to these. The padding's tokens sit
    after the real ones in flat order and write their keys at `scratch`, a cache slot no request
    owns; padded requests attend to one key, padded queries of a request to none of its own."""

    requests: int
    queries: int
    keys: int
    scratch: int

    @property
    def tokens(self) -> int:
        return self.requests * self.queries


def plan_attention(cache: PagedKVCache, request_ids: list[int], cu: torch.Tensor, starts: list[int],
                   rotary: Rotary, lengths: list[int] | None = None, padding: Padding | None = None) -> AttentionPlan:
    """Build the per-forward attention plan. Cache blocks must already be reserved. `lengths`:
    each request's new tokens, when the caller has them on the host already. The integer
    arithmetic is numpy (host); only the finished indices and masks are tensors on the device.
    `padding`: every tensor in those fixed shapes (the requests must fit, and attend as one group)."""
    lengths = (cu[1:] - cu[:-1]).tolist() if lengths is None else lengths
    by_span: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_span.setdefault(0 if n <= QUERY_SPAN else n.bit_length(), []).append(i)
    dev = cache.k.device  # built on the host (small integer arithmetic), used where the cache lives
    starts_a, lens_a = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lens_a) + 1, dtype=np.int64)
    np.cumsum(lens_a, out=offsets[1:])
    # Groups of like shape on CPU ranks, where the trade was measured; on a GPU (kernel launches
    # against padded FLOPs) one padded batch until it is measured there.
    if padding is None and dev.type in GROUP_DEVICES:
        ends = starts_a + lens_a
        by_span = {(span, j): part for span, idx in by_span.items()
                   for j, part in enumerate(split_padded(np.asarray(idx), ends, lens_a)
                                            if len(idx) >= GROUP_FROM else [np.asarray(idx)])}
    whole = len(by_span) <= 1
    if padding is not None and (not whole or 0 not in by_span or len(lengths) > padding.requests
                                or max(lengths) > padding.queries or max(starts_a + lens_a) > padding.keys):
        raise ValueError(f"a forward of {len(lengths)} requests does not fit {padding}")
    table = cache.block_table(request_ids)  # once for the step: every group's keys and the writes
    ragged = _Ragged(cache, table, starts_a, lens_a, offsets)
    groups = [_group(np.asarray(idx), ragged, whole, dev, padding) for idx in by_span.values()]
    total = int(offsets[-1])
    positions = np.arange(total) + np.repeat(starts_a - offsets[:-1], lens_a)  # [N] in flat order
    write_slots = torch.from_numpy(cache.between_of(table, starts_a, starts_a + lens_a))
    if padding is not None:  # the padding's tokens: position 0, keys written to the scratch slot
        positions = np.concatenate([positions, np.zeros(padding.tokens - total, dtype=np.int64)])
        write_slots = torch.cat([write_slots, torch.full((padding.tokens - total,), padding.scratch)])
    cos, sin = rotary.cos_sin(torch.from_numpy(positions))
    return AttentionPlan(upload(write_slots, dev), groups, upload(cos, dev), upload(sin, dev))


def split_padded(idx: np.ndarray, ends: np.ndarray, lengths: np.ndarray, depth: int = 2) -> list[np.ndarray]:
    """Requests `idx` in groups that pad fewer (query, key) pairs (`ends`, `lengths`: each
    request's keys after the step and its new tokens, by request of the forward). A group attends
    as one batch padded to its longest chunk and its longest keys: R_g · max queries · max keys
    pairs. Of the cuts of the requests sorted by key length and of those sorted by queries, the
    one that pads the fewest pairs is taken if it saves `GROUP_SAVING` of them and
    `GROUP_PAIRS_SAVED` of them and leaves `GROUP_LEAST` requests a side, then each side again
    (`depth` times: at most 2 ** depth groups). One group: `[idx]`."""
    n = len(idx)
    if depth == 0 or n < 2 * GROUP_LEAST:
        return [idx]
    whole = n * int(lengths[idx].max()) * int(ends[idx].max())
    k = np.arange(GROUP_LEAST, n - GROUP_LEAST + 1)
    best = None  # (padded pairs, order, cut)
    for key in (ends, lengths):
        order = idx[np.argsort(key[idx], kind="stable")]
        q, t = lengths[order], ends[order]
        left = np.maximum.accumulate(q) * np.maximum.accumulate(t)  # the padded area of the first i + 1, per request
        right = (np.maximum.accumulate(q[::-1]) * np.maximum.accumulate(t[::-1]))[::-1]
        padded = k * left[k - 1] + (n - k) * right[k]
        i = int(np.argmin(padded))
        if best is None or padded[i] < best[0]:
            best = (int(padded[i]), order, int(k[i]))
    pairs, order, cut = best
    if whole - pairs < max(GROUP_SAVING * whole, GROUP_PAIRS_SAVED):
        return [idx]
    return split_padded(order[:cut], ends, lengths, depth - 1) + split_padded(order[cut:], ends, lengths, depth - 1)


class _Ragged(NamedTuple):
    """A forward's requests: the cache holding them, their block table, each one's first new
    position, new tokens, and offset of its first new token in the flat batch ([R + 1])."""

    cache: PagedKVCache
    table: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray


def _group(idx: np.ndarray, ragged: _Ragged, whole: bool, dev, padding: Padding | None = None) -> AttentionGroup:
    """The padded attention of requests idx (of the forward's; `whole`: every one, in order);
    `padding`: in its fixed shapes, the padded requests appending nothing."""
    offsets = ragged.offsets
    starts, lengths = ragged.starts[idx], ragged.lengths[idx]
    q, t = int(lengths.max()), int((starts + lengths).max())
    key_slots = ragged.cache.rows_of(ragged.table[idx], starts + lengths, t)
    if padding is not None:
        extra = padding.requests - len(idx)
        starts, lengths = np.pad(starts, (0, extra)), np.pad(lengths, (0, extra))
        offsets = np.pad(offsets, (0, extra), mode="edge")
        idx = np.concatenate([idx, np.arange(len(idx), padding.requests)])
        q, t = padding.queries, padding.keys
        key_slots = np.pad(key_slots, ((0, extra), (0, t - key_slots.shape[1])))
    key_slots = torch.from_numpy(key_slots)
    j = np.arange(q)
    q_valid = j[None, :] < lengths[:, None]  # [R_g, Q]
    q_pos = torch.from_numpy(starts[:, None] + j[None, :])  # [R_g, Q]
    k_pos = torch.arange(t)
    ends = torch.from_numpy(starts + lengths)
    valid_t = torch.from_numpy(q_valid)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ends[:, None, None])
    mask |= (~valid_t[:, :, None]) & (k_pos[None, None, :] == 0)  # padded queries see one key: no NaN
    q_index = np.where(q_valid, offsets[idx][:, None] + j[None, :], 0)
    rows = None if whole else upload(torch.from_numpy(q_index[q_valid]), dev)
    valid = np.flatnonzero(q_valid)
    if padding is not None:  # the padding's tokens read any padded query's output
        valid = np.pad(valid, (0, padding.tokens - len(valid)))
    return AttentionGroup(upload(key_slots, dev), upload(mask[:, None], dev), upload(torch.from_numpy(q_index), dev),
                          upload(torch.from_numpy(valid), dev), rows)


class Attention(nn.Module):
    """Grouped-query attention over a paged KV cache, ragged batches of appended tokens."""

    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.full_norm = cfg.qk_norm_full  # over the whole projection (OLMoE), else per head (Qwen3)
        self.norm_after_rope = cfg.qk_norm_after_rope  # Hunyuan-MoE: per head, after RoPE
        width_q, width_k = (self.heads * d, self.kv_heads * d) if self.full_norm else (d, d)
        self.q_norm = RMSNorm(width_q, cfg.rms_norm_eps) if cfg.qk_norm or self.full_norm else None
        self.k_norm = RMSNorm(width_k, cfg.rms_norm_eps) if cfg.qk_norm or self.full_norm else None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, H, D], k and v [N, Hkv, D] of x [N, hidden], q and k normed (before RoPE)."""
        n = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(n, self.heads, self.head_dim), k.view(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_norm and not self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.v_proj(x).view(n, self.kv_heads, self.head_dim)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k with RoPE applied (and then the per-head norm, where it comes after): both in one
        pass over their heads side by side (five kernels a layer fewer on a GPU; elementwise, so
        bit-equal to rotating each)."""
        q, k = apply_rope(torch.cat([q, k], dim=1), cos, sin).split([q.shape[1], k.shape[1]], dim=1)
        if self.norm_after_rope and self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def forward(self, x: torch.Tensor, plan: AttentionPlan, cache: PagedKVCache) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:  # an EP rank with no requests this step still runs the MoE collectives
            return torch.zeros_like(x)
        q, k, v = self.qkv(x)
        q, k = self.rope(q, k, plan.cos, plan.sin)
        scatter(cache.k[self.layer], plan.write_slots, k)
        scatter(cache.v[self.layer], plan.write_slots, v)
        def keys_of(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, Hkv, T, D] each
            return (gather(cache.k[self.layer], slots).transpose(1, 2).to(q.dtype),
                    gather(cache.v[self.layer], slots).transpose(1, 2).to(q.dtype))

        out = plan.attend(q, keys_of, enable_gqa=self.heads != self.kv_heads)  # [N, H, D] in flat order
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))


    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over whole sequences, no cache (training). x: [B, T, H]."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x.reshape(b * t, -1))
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)  # [B·T, D]
        q, k = self.rope(q, k, cos, sin)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
