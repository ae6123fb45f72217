"""The block-parallel drafter (DFlash/DFly family): one forward pass drafts a whole block.

Input block for a request whose last committed token t sits at position p:
`[t, MASK, ..., MASK]` (K positions p .. p+K−1). The drafter's attention sees
- the request's context: target hidden states taken after a few target layers at every
  committed position < p, concatenated and projected once per committed token, then turned into
  each drafter layer's keys and values and cached (`DraftCache`), never recomputed;
- the block itself, bidirectionally.
Block output j (1 ≤ j < K) predicts the token at position p + j: K − 1 drafts per pass. The
token embedding and the LM head are the target's own (shared, frozen).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from actors.target.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from actors.target.layout import cpu_linear


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    target_layers: tuple[int, ...]  # 1-based target layers whose outputs condition the drafter
    num_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 16  # K: K − 1 drafts per pass
    head_tokens: int | None = None  # LM head over only the N most frequent tokens (None: all)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (DFlash's Qwen3 layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> DraftConfig:
        d = json.loads(pathlib.Path(path).read_text())
        d["target_layers"] = tuple(d["target_layers"])
        return cls(**d)


class BlockContext(NamedTuple):
    """What a block attends to besides itself: its request's context keys and values
    [B, T, Hkv, D] (projected target features) and which of the T exist [B, T]."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor


class DraftLayer(nn.Module):
    """Pre-norm layer: attention of block queries over [context ++ block], then SwiGLU."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.norm_in = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_ctx = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.norm_mlp = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def _heads(self, proj: nn.Linear, norm: RMSNorm | None, x: torch.Tensor, heads: int) -> torch.Tensor:
        """x projected and split into heads [n, heads, D], normed per head where the layer does."""
        out = proj(x).view(-1, heads, self.head_dim)
        return out if norm is None else norm(out)

    def context_kv(self, feats: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, Hkv, D] of projected context features [n, H] at their positions."""
        n = feats.shape[0]
        x = self.norm_ctx(feats)
        k = apply_rope(self._heads(self.k_proj, self.k_norm, x, self.kv_heads), cos, sin)
        return k, self.v_proj(x).view(n, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: BlockContext,
                live: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, K, H] blocks; cos/sin: [B·K, D]; ctx: each block's context keys and values
        [B, T, Hkv, D] and mask [B, T]. live: [B, K] bool, the positions of each block that
        exist (a prefix per block; None: all). Projections and MLP run on those rows only, and
        attention sees only those keys, so a block of n positions costs and yields what it would
        alone; other rows stay as they are."""
        b, k, _ = x.shape
        ctx_k, ctx_v, ctx_mask = ctx
        rows = None if live is None else live.reshape(-1).nonzero().squeeze(1)
        flat = x.reshape(b * k, -1)
        h = self.norm_in(flat if rows is None else flat[rows])
        c, s = (cos, sin) if rows is None else (cos[rows], sin[rows])
        q = apply_rope(self._heads(self.q_proj, self.q_norm, h, self.heads), c, s)
        bk = apply_rope(self._heads(self.k_proj, self.k_norm, h, self.kv_heads), c, s)
        bv = self.v_proj(h).view(-1, self.kv_heads, self.head_dim)
        if rows is not None:  # back to [B·K, ...] with zeros at absent positions (masked out below)
            q, bk, bv = (_scatter(t, rows, b * k) for t in (q, bk, bv))
        keys = torch.cat([ctx_k, bk.view(b, k, self.kv_heads, self.head_dim)], 1).transpose(1, 2)
        values = torch.cat([ctx_v, bv.view(b, k, self.kv_heads, self.head_dim)], 1).transpose(1, 2)
        own = ctx_mask.new_ones(b, k) if live is None else live
        mask = torch.cat([ctx_mask, own], 1)[:, None, None, :]  # [B, 1, 1, T + K]
        q = q.view(b, k, self.heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b * k, -1)
        if rows is None:
            y = flat + self.o_proj(out)
            return (y + self.mlp(self.norm_mlp(y))).view(b, k, -1)
        y = flat[rows] + self.o_proj(out[rows])
        flat = flat.clone()
        flat[rows] = y + self.mlp(self.norm_mlp(y))
        return flat.view(b, k, -1)


def _scatter(t: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    out = t.new_zeros((n, *t.shape[1:]))
    out[rows] = t
    return out


class DraftModel(nn.Module):
    """The drafter's own weights; embedding and LM head are borrowed from the target."""

    def __init__(self, cfg: DraftConfig, embed: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.cfg = cfg
        self.ctx_proj = nn.Linear(len(cfg.target_layers) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._shared = (embed, lm_head)  # a tuple: not registered, not saved, not trained
        # Frequency-ranked head (as in FR-Spec): drafting only ever proposes these tokens, and the
        # head costs N/V of the full one. Which tokens is part of the drafter's weights.
        n = cfg.head_tokens or lm_head.weight.shape[0]
        self.register_buffer("head_ids", torch.arange(n, dtype=torch.long))
        self._head_w: torch.Tensor | None = None

    @property
    def embed(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target hidden states [n, L·H] -> context features [n, H]."""
        return self.ctx_proj(hidden)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions.reshape(-1), self.cfg.head_dim, self.cfg.rope_theta)

    def block_hidden(self, last_tokens: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor,
                     torch.Tensor]], ctx_mask: torch.Tensor, block: int,
                     sizes: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, K, H] of B blocks starting at `positions` [B] with `last_tokens` [B].
        sizes [B] (≤ block): block i has only its first sizes[i] positions (rows past them are
        not computed: whatever they hold is not a result)."""
        b = last_tokens.shape[0]
        x = self.mask_embedding.expand(b, block, -1).clone()
        x[:, 0] = self.embed(last_tokens)
        offsets = torch.arange(block, device=x.device)[None, :]
        cos, sin = self.rope(positions[:, None] + offsets)
        live = None if sizes is None else offsets < sizes[:, None]
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, BlockContext(k, v, ctx_mask), live)
        return self.norm(x)

    def set_head_tokens(self, ids: torch.Tensor) -> None:
        """Choose the head's vocabulary (the N most frequent tokens of the training data)."""
        self.head_ids = ids.to(torch.long).clone()
        self._head_w = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary: [.., N]; column c is token head_ids[c]."""
        if self._head_w is None or self._head_w.shape[0] != len(self.head_ids):
            self._head_w = self.lm_head.weight.detach()[self.head_ids]  # the shared head is frozen
        return cpu_linear(hidden, self._head_w)

    def save(self, path: str | pathlib.Path, dtype: torch.dtype = torch.float16) -> None:
        from safetensors.torch import save_file

        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "drafter_config.json").write_text(self.cfg.to_json())
        state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, str(path / "drafter.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str | pathlib.Path, embed: nn.Embedding, lm_head: nn.Linear) -> DraftModel:
        from safetensors.torch import load_file

        path = pathlib.Path(path)
        model = cls(DraftConfig.load(path / "drafter_config.json"), embed, lm_head)
        state = load_file(str(path / "drafter.safetensors"))
        result = model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                                       strict=False)
        if set(result.missing_keys) - {"head_ids"} or result.unexpected_keys:  # no head_ids: full vocabulary
            raise ValueError(f"drafter weights in {path} do not fit the config: {result}")
        return model.eval()
