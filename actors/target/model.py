"""The target: a decoder-only MoE transformer (Qwen3-MoE family) over ragged batches.

One `forward` appends each request's new tokens to its own KV cache (causal inside the appended
chunk, full attention to what is cached) and returns logits only at the asked-for positions.
Verification, prefill chunks and plain decoding are all this one call.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from actors.target.config import MoEConfig
from actors.target.kv_cache import CacheSpec, PagedKVCache
from actors.target.latent import LatentAttention
from actors.target.layers import Attention, AttentionPlan, RMSNorm, SwiGLU, plan_attention
from actors.target.moe import MoEBlock, StepStats


@dataclass(frozen=True)
class ForwardBatch:
    """A ragged batch for one rank: request i appends tokens[cu[i]:cu[i+1]]."""

    request_ids: list[int]  # [R]
    tokens: torch.Tensor  # [N] int64
    cu: torch.Tensor  # [R + 1] int64
    logit_index: torch.Tensor  # [M] flat indices into tokens whose next-token logits are wanted

    @classmethod
    def from_lists(cls, request_ids: list[int], chunks: list[list[int]], logits: str = "all") -> ForwardBatch:
        """Build from per-request token lists; logits "all" or "last" of each request."""
        lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
        cu = torch.zeros(len(chunks) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lengths, 0)
        tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        index = torch.arange(int(cu[-1])) if logits == "all" else cu[1:] - 1
        return cls(list(request_ids), tokens, cu, index)


@dataclass(frozen=True)
class Prepared:
    """A validated batch whose KV blocks are reserved."""

    batch: ForwardBatch
    lengths: list[int]  # tokens appended per request
    starts: list[int]  # cached tokens per request before this forward
    fresh: list[int]  # requests new to the cache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer: int, first_expert: int, local_experts: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, layer) if cfg.latent else Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = (MoEBlock(cfg, first_expert, local_experts) if self.is_moe
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x, plan, cache, stats: StepStats | None) -> torch.Tensor:
        t0 = time.perf_counter()
        x = x + self.self_attn(self.input_layernorm(x), plan, cache)
        if stats is not None:
            stats.attention_s += time.perf_counter() - t0
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, stats) if self.is_moe else self.mlp(h))


class MoETransformer(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Holds experts [first, first + local)."""

    def __init__(self, cfg: MoEConfig, first_expert: int = 0, local_experts: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, first_expert, local_experts) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def cache_spec(self, capacity_tokens: int, block_size: int = 16) -> CacheSpec:
        c = self.cfg
        return (CacheSpec(c.num_hidden_layers, 1, c.kv_lora_rank + c.head_dim, capacity_tokens, block_size, 0)
                if c.latent else
                CacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity_tokens, block_size))

    def new_cache(self, capacity_tokens: int, block_size: int = 16) -> PagedKVCache:
        """The paged KV cache, in the model's dtype on the model's device."""
        return PagedKVCache(self.cache_spec(capacity_tokens, block_size), dtype=self.lm_head.weight.dtype,
                            device=str(self.lm_head.weight.device))

    def prepare(self, batch: ForwardBatch, cache: PagedKVCache, host_tokens: np.ndarray | None = None) -> Prepared:
        """Validate the batch and reserve its KV blocks; nothing is written yet. `host_tokens`:
        the batch's tokens as the host array they were uploaded from, where their bounds are
        checked without reading the device's copy back (a host synchronisation on a GPU).

        Raises ValueError or KVCacheFull with the cache unchanged. `undo` gives the blocks back.
        """
        cu = batch.cu.tolist()  # offsets live on the host (`ForwardBatch`)
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        if any(n <= 0 for n in lengths):
            raise ValueError("every request in a forward batch must append at least one token")
        if len(batch.tokens):
            if host_tokens is not None:
                lo, hi = int(host_tokens.min()), int(host_tokens.max())
            else:  # one copy of both bounds
                lo, hi = torch.stack([batch.tokens.min(), batch.tokens.max()]).tolist()
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        starts = [cache.length(rid) if rid in cache else 0 for rid in batch.request_ids]
        too_long = [rid for rid, s, n in zip(batch.request_ids, starts, lengths, strict=True)
                    if s + n > self.cfg.max_position_embeddings]
        if too_long:
            raise ValueError(f"requests {too_long} would exceed max_position_embeddings "
                             f"({self.cfg.max_position_embeddings})")
        fresh = [rid for rid in batch.request_ids if rid not in cache]
        cache.reserve(dict(zip(batch.request_ids, lengths, strict=True)))
        return Prepared(batch, lengths, starts, fresh)

    def undo(self, prepared: Prepared, cache: PagedKVCache) -> None:
        """Give back what `prepare` reserved (another rank rejected the batch)."""
        for rid, start in zip(prepared.batch.request_ids, prepared.starts, strict=True):
            if rid in prepared.fresh:
                cache.release(rid)
            else:
                cache.truncate(rid, start)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch | Prepared, cache: PagedKVCache, stats: StepStats | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Append the batch to the cache; logits [M, V] at batch.logit_index, and the hidden
        states [N, H] after each layer in `capture_layers` (1-based; the drafter's features)."""
        t0 = time.perf_counter()
        prep = batch if isinstance(batch, Prepared) else self.prepare(batch, cache)
        batch = prep.batch
        plan = plan_attention(cache, batch.request_ids, batch.cu, prep.starts, self.cfg.rotary, prep.lengths)
        logits, captured = self.compute(batch.tokens, plan, cache, batch.logit_index, stats, capture_layers)
        self.committed(prep, cache, stats, t0)
        return logits, captured

    @staticmethod
    def committed(prep: Prepared, cache: PagedKVCache, stats: StepStats | None, started: float) -> None:
        """After a forward's device work (eager, or a graph's replay): its tokens count as
        written in the cache, and the step's statistics take its time and size."""
        for rid, n in zip(prep.batch.request_ids, prep.lengths, strict=True):
            cache.commit(rid, n)
        if stats is not None:
            stats.total_s += time.perf_counter() - started
            stats.tokens += len(prep.batch.tokens)
            stats.requests += len(prep.lengths)
            stats.context += sum(prep.starts)

    def compute(self, tokens: torch.Tensor, plan: AttentionPlan, cache: PagedKVCache, logit_index: torch.Tensor,
                stats: StepStats | None = None, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward's device work once its plan is built: embedding, layers (writing the new
        tokens' keys and values at the plan's slots), norm and LM head. No cache bookkeeping and,
        at one rank with grouped experts, no host synchronisation: the part a CUDA graph can
        capture (`benchmarks/rank_step.py` measures it)."""
        x = self.embed_tokens(tokens)  # [N, H]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, plan, cache, stats)
            if i + 1 in capture_layers:
                captured[i + 1] = x
        return self.lm_head(self.norm(x[logit_index])), captured  # [M, V]

    def forward_train(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequences, causal, no cache (training): logits [B, T, V] and the mean
        load-balancing loss of the MoE layers."""
        b, t = tokens.shape
        cos, sin = self.cfg.rotary.cos_sin(torch.arange(t, device=tokens.device))
        x = self.embed_tokens(tokens)  # [B, T, H]
        aux = x.new_zeros(())
        for layer in self.layers:
            x = x + layer.self_attn.forward_dense(layer.input_layernorm(x), cos, sin)
            h = layer.post_attention_layernorm(x).reshape(b * t, -1)
            if layer.is_moe:
                aux = aux + layer.mlp.load_balance_loss(h)
            x = x + layer.mlp(h).view(b, t, -1)
        return self.lm_head(self.norm(x)), aux / max(1, len(self.moe_blocks()))

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """Deterministic random weights for tests and profiling (norms near 1, the rest small)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                scale, base = (0.1, 1.0) if "norm" in name else (std, 0.0)
                p.copy_(base + scale * torch.randn(p.shape, generator=g))
