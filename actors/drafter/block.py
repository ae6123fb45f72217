"""`BlockDrafter`: runs the block drafter for a batch of requests with cached context features.

Per request it keeps, in a paged cache like the target's, each drafter layer's keys and values
of every committed position whose target hidden states are known. `extend` adds them as tokens
commit (projection done once per token), `truncate` rolls back, `draft` runs one block pass.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.drafter.base import DraftOutput, on
from actors.drafter.model import DraftModel
from actors.target.kv_cache import CacheSpec, PagedKVCache, gather, scatter


class BlockDrafter:
    """Drafts K − 1 tokens per request per pass; owns the drafter's context caches."""

    def __init__(self, model: DraftModel, capacity_tokens: int = 65536, block_size: int | None = None,
                 cut: bool = True) -> None:
        cfg = model.cfg
        self.model = model
        self.block = block_size or cfg.block_size
        self.cut = cut  # run only the block positions each request's drafts need
        if not 2 <= self.block <= cfg.block_size:
            raise ValueError(f"block size must be in 2..{cfg.block_size}")
        self.spec = CacheSpec(cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim, capacity_tokens)
        self.cache = PagedKVCache(self.spec)

    @property
    def device(self) -> torch.device:
        return self.model.mask_embedding.device

    def to(self, device: str | torch.device) -> BlockDrafter:
        """Move the weights and the (empty) context cache to `device` (a GPU rank's own)."""
        if torch.device(device) == self.device:
            return self
        if self.cache.requests:
            raise RuntimeError("a drafter moves before it holds any request's context")
        self.model.to(device)
        self.model.embed.to(device), self.model.lm_head.to(device)  # borrowed from the target, not registered
        self.model._head_w = None  # the head's rows, gathered again where the head now is
        self.cache = PagedKVCache(self.spec, device=str(device))
        return self

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.model.cfg.target_layers

    def context_length(self, rid: int) -> int:
        return self.cache.length(rid) if rid in self.cache else 0

    @torch.inference_mode()
    def extend(self, request_ids: list[int], features: list[dict[int, np.ndarray | torch.Tensor]]) -> None:
        """Append committed positions: features[i][layer] is [n_i, H] target states after `layer`."""
        feats, rows = [], []
        for h in features:
            if not h:  # tokens the target has not processed yet carry no features
                rows.append(0)
                continue
            x = torch.cat([on(h[layer], self.device) for layer in self.target_layers], dim=-1)
            feats.append(x)
            rows.append(x.shape[0])
        growth = {rid: n for rid, n in zip(request_ids, rows, strict=True) if n}
        if not growth:
            return
        self.cache.reserve(growth)
        starts = [self.context_length(rid) for rid in request_ids]
        dev = self.device
        positions = torch.cat([torch.arange(s, s + n, device="cpu") for s, n in zip(starts, rows, strict=True)]).to(dev)
        ends = [s + n for s, n in zip(starts, rows, strict=True)]
        slots = torch.from_numpy(self.cache.slots_between(request_ids, starts, ends)).to(dev)
        proj = self.model.project(torch.cat(feats))  # [Σn, H]
        cos, sin = self.model.rope(positions)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.context_kv(proj, cos, sin)
            scatter(self.cache.k[i], slots, k)
            scatter(self.cache.v[i], slots, v)
        for rid, n in growth.items():
            self.cache.commit(rid, n)

    def commit(self, request_ids: list[int], tokens: list[list[int]], features: list[dict]) -> None:
        """Newly committed tokens; only their features matter here (`extend`)."""
        self.extend(request_ids, features)

    def truncate(self, lengths: dict[int, int]) -> None:
        self.cache.truncate_all(lengths)

    def release(self, request_ids: list[int]) -> None:
        self.cache.release_all(request_ids)

    def held_requests(self) -> set[int]:
        return set(self.cache.requests)

    @torch.inference_mode()
    def draft(self, request_ids: list[int], last_tokens: list[int], lengths: list[int], temperature: float = 0.0,
              rng: np.random.Generator | None = None) -> DraftOutput:
        """lengths[i] (≤ block − 1) drafts for request i; the LM head runs only on those rows.
        Each request's block is cut to its drafts + 1 positions (`cut`): a pass costs in
        proportion to the positions it runs, a request's drafts do not depend on what the others
        asked for, and the demo drafter accepts no less from a shorter block
        (benchmarks/drafter_block.py; docs/benchmarks.md)."""
        lengths = [min(n, self.block - 1) for n in lengths]
        block = max(lengths, default=0) + 1 if self.cut else self.block
        ctx = [self.context_length(rid) for rid in request_ids]
        t = max(ctx, default=0)
        # the batch's small integers are built on the host, then sent in one copy each
        dev = self.device
        key_slots = torch.from_numpy(self.cache.slot_rows(request_ids, np.asarray(ctx), t)).to(dev, non_blocking=True)
        ctx_t, lengths_t = torch.tensor(ctx, device=dev), torch.tensor(lengths, device=dev)
        mask = torch.arange(t, device=dev)[None, :] < ctx_t[:, None]  # [B, T]
        ctx_kv = [(gather(self.cache.k[i], key_slots), gather(self.cache.v[i], key_slots))
                  for i in range(len(self.model.layers))]
        ragged = self.cut and len(set(lengths)) > 1
        sizes = lengths_t + 1 if ragged else None
        hidden = self.model.block_hidden(torch.tensor(last_tokens, device=dev), ctx_t, ctx_kv, mask, block, sizes)
        pick = torch.arange(block, device=dev)[None, :]
        want = (pick >= 1) & (pick <= lengths_t[:, None])  # [B, K] rows that may be kept
        logits = self.model.logits(hidden[want]).float()  # [N, head vocabulary]
        return sample_drafts(logits, lengths, temperature, rng, self.model.head_ids)


def sample_drafts(logits: torch.Tensor, lengths: list[int], temperature: float,
                  rng: np.random.Generator | None, head_ids: torch.Tensor | None = None) -> DraftOutput:
    """Greedy (temperature 0) or sampled drafts with their confidence and top-2 margin, computed
    where the logits are; what crosses to the host is three numbers a draft (one copy), and the
    distributions only when sampling asks for them. head_ids: the token of each logit column
    (a frequency-ranked head), default the column itself."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1)
        u = torch.from_numpy((rng or np.random.default_rng()).random(len(logits))).to(logits.device)
        tokens = torch.searchsorted(probs.double().cumsum(-1), (u * probs.double().sum(-1))[:, None]).squeeze(-1)
        tokens = tokens.clamp_max(probs.shape[-1] - 1)
    else:
        probs = torch.softmax(logits, dim=-1)
        tokens = probs.argmax(-1)
    top2 = torch.topk(probs, min(2, probs.shape[-1]), dim=-1).values
    conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
    ids = tokens if head_ids is None else head_ids[tokens]
    host = torch.stack([ids.double(), conf.double(), (top2[:, 0] - top2[:, -1]).double()]).cpu().numpy()
    return DraftOutput(host[0].astype(np.int64), cu, host[1], host[2],
                       probs.cpu().numpy() if temperature > 0 else None)
