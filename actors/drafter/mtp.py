"""The multi-token-prediction drafter: DeepSeek-V3's "next-n" module, chained one token a pass.

One module (`MTPModule`, weights named as in a DeepSeek-V3 checkpoint's layer `num_hidden_layers`:
`enorm`, `hnorm`, `eh_proj`, `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
`post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `shared_head.norm`, `shared_head.head`)
predicts token j + 1 from the embedding of token j and a hidden state of position j − 1:

    x_j = eh_proj([enorm(embed(t_j)) ; hnorm(h_{j-1})]),   g_j = layer(x_j),   logits = head(norm(g_j))

where h is the target's final hidden state (after its final norm, as DeepSeek's main model hands
it over) for committed positions, and the module's own output g for drafted ones. Its attention
runs over the cached keys and values of every committed pair (`MTPDrafter`), so a pass costs one
decoder layer over one token per request: the first draft comes from the last committed pair's
output (kept at commit), each further one from one more pass.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from actors.drafter.base import DraftOutput, on
from actors.drafter.block import sample_drafts
from actors.target.kv_cache import CacheSpec, PagedKVCache, gather, scatter
from actors.target.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from actors.target.layout import cpu_linear
from dcut_core.chains import ChainCut, ChainStop

CONFIG = "mtp_config.json"
WEIGHTS = "mtp.safetensors"
VOCAB = "draft_vocab.safetensors"  # optional: the draft vocabulary (`DraftVocabulary`)


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_index: int  # the checkpoint layer the module is stored as (DeepSeek: num_hidden_layers)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_index}."

    @classmethod
    def load(cls, path: str | pathlib.Path) -> MTPConfig:
        return cls(**json.loads(pathlib.Path(path).read_text()))


class MTPModule(nn.Module):
    def __init__(self, cfg: MTPConfig, embed: nn.Embedding, head: nn.Linear) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.self_attn.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.self_attn.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.self_attn.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        self._shared = (embed, head)  # the target's, frozen; not this module's parameters
        self.vocab_size = head.out_features

    def combine(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x [N, H] from tokens [N] and the hidden states [N, H] of the positions before them."""
        embed = self._shared[0]
        return self.eh_proj(torch.cat([self.enorm(embed(tokens)), self.hnorm(hidden)], dim=-1))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        n, a = x.shape[0], self.self_attn
        y = self.input_layernorm(x)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.cfg.rope_theta)
        q = apply_rope(a.q_proj(y).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rope(a.k_proj(y).view(n, self.kv_heads, self.head_dim), cos, sin)
        return q, k, a.v_proj(y).view(n, self.kv_heads, self.head_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input x [N, H] and attention output [N, heads · D]."""
        h = x + self.self_attn.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self._shared[1](self.shared_head.norm(g))

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head (borrowed, frozen)."""
        return self._shared[1]

    def save(self, path: str | pathlib.Path, dtype: torch.dtype = torch.float16) -> None:
        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG).write_text(json.dumps(asdict(self.cfg), indent=2))
        tensors = {self.cfg.prefix + k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        tensors[self.cfg.prefix + "shared_head.head.weight"] = self._shared[1].weight.detach().to(dtype).contiguous()
        save_file(tensors, str(path / WEIGHTS))

    @classmethod
    def from_tensors(cls, cfg: MTPConfig, tensors: dict[str, torch.Tensor], embed: nn.Embedding,
                     head: nn.Linear) -> MTPModule:
        """The module from checkpoint tensors named as in DeepSeek-V3 (under `cfg.prefix`). The
        layer's own LM head copy (`shared_head.head`) is checked against the target's, not kept;
        a layer-specific `embed_tokens` likewise (DeepSeek stores both; they equal the target's)."""
        module = cls(cfg, embed, head)
        own = {k.removeprefix(cfg.prefix): v.float() for k, v in tensors.items() if k.startswith(cfg.prefix)}
        check_shared_copies(cfg.prefix, lambda name: own.pop(name, None), embed, head)
        missing, unexpected = module.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(f"MTP weights under {cfg.prefix}: missing {missing}, unexpected {unexpected}")
        return module.eval()

    @classmethod
    def load(cls, path: str | pathlib.Path, embed: nn.Embedding, head: nn.Linear) -> MTPModule:
        path = pathlib.Path(path)
        return cls.from_tensors(MTPConfig.load(path / CONFIG), load_file(str(path / WEIGHTS)), embed, head)


def check_shared_copies(prefix: str, copy_of, embed: nn.Embedding, head: nn.Linear) -> None:
    """A next-n layer's own copies of the LM head (`shared_head.head`) and the embedding, where
    the checkpoint stores them (`copy_of(name)`, None if not), must be the target's."""
    for shared, weight in (("shared_head.head.weight", head.weight), ("embed_tokens.weight", embed.weight)):
        copy = copy_of(shared)
        if copy is not None and not torch.allclose(copy.float(), weight.float(), atol=1e-2):
            raise ValueError(f"{prefix}{shared} differs from the target's: not a module of this target")


class DraftVocabulary:
    """The tokens a chained drafter may propose, most frequent first (FR-Spec): its head is the
    target's LM head's rows for these tokens only. On this CPU a pass of the bundled module reads
    the 4,096-token head (4 MiB) and 3.4 MiB of its own weights, so the head is half a pass; a
    draft outside the vocabulary is one the drafter cannot make, which costs acceptance, never
    correctness (the target verifies every draft).

    Stored as `draft_vocab.safetensors` (`token_ids`, int64 [N]) beside the module's weights;
    absent, the drafter drafts over the whole vocabulary."""

    def __init__(self, token_ids: torch.Tensor) -> None:
        ids = token_ids.to(torch.long).flatten()
        if not len(ids) or len(torch.unique(ids)) != len(ids) or int(ids.min()) < 0:
            raise ValueError("a draft vocabulary is a non-empty list of distinct token ids")
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_counts(cls, counts: np.ndarray, size: int) -> DraftVocabulary:
        """The `size` most frequent tokens of `counts` [V] (ties by token id)."""
        order = np.argsort(-np.asarray(counts), kind="stable")[:size]
        return cls(torch.from_numpy(order.astype(np.int64)))

    @classmethod
    def load(cls, folder: str | pathlib.Path) -> DraftVocabulary | None:
        path = pathlib.Path(folder) / VOCAB
        return cls(load_file(str(path))["token_ids"]) if path.exists() else None

    def save(self, folder: str | pathlib.Path) -> None:
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"token_ids": self.ids.cpu().contiguous()}, str(folder / VOCAB))


class MTPDrafter:
    """Drafts by chaining the module; owns each request's cache of committed pairs.

    Per request: the committed tokens and target hidden states not paired yet, the keys and
    values of every pair (paged, one layer), and the output g of the newest pair, which yields
    the first draft."""

    def __init__(self, module: MTPModule, final_norm: RMSNorm, target_layer: int, capacity_tokens: int = 65536,
                 block: int = 16, vocab: DraftVocabulary | None = None) -> None:
        self.module, self.final_norm, self.layer, self.block = module, final_norm, target_layer, block
        if vocab is not None and int(vocab.ids.max()) >= module.vocab_size:
            raise ValueError(f"the draft vocabulary names token {int(vocab.ids.max())}; the target has "
                             f"{module.vocab_size}")
        self.vocab = vocab
        self._head: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, head rows) on the device
        # keys and values per pair; a latent-attention module (a DeepSeek-V3 next-n layer) keeps one
        # latent row as the key and its first `value_dim` values as the value
        self.spec = CacheSpec(1, module.kv_heads, module.head_dim, capacity_tokens,
                              value_dim=getattr(module, "value_dim", None))
        self.cache = PagedKVCache(self.spec)
        self.scale = getattr(module, "scale", None)  # softmax scale (None: 1/sqrt(head_dim))
        self._tokens: dict[int, list[int]] = {}  # committed tokens from pair index + 1 on
        self._hidden: dict[int, list[torch.Tensor]] = {}  # target states from pair index on
        self._last: dict[int, torch.Tensor] = {}  # g of the newest pair

    @property
    def target_layers(self) -> tuple[int, ...]:
        return (self.layer,)

    @property
    def device(self) -> torch.device:
        return self.cache.k.device

    def to(self, device: str | torch.device) -> MTPDrafter:
        """Move the module (with the target's embedding and head it borrows), the final norm and the
        (empty) cache to `device` (a GPU rank's own)."""
        if torch.device(device) == self.device:
            return self
        if self.held_requests():
            raise RuntimeError("a drafter moves before it holds any request's context")
        for part in (self.module, self.final_norm, *getattr(self.module, "_shared", ()),
                     *getattr(self.module, "_embed", ())):
            if part is not None:
                part.to(device)
        self.cache = PagedKVCache(self.spec, device=str(device))
        self._head = None
        return self

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits [R, N] over the draft vocabulary (column c is token `_head[0][c]`), or over the
        whole vocabulary where there is none."""
        if self.vocab is None:
            return self.module.logits(g).float()
        if self._head is None:  # the shared head is frozen: its rows are copied once
            ids = self.vocab.ids.to(self.device)
            self._head = ids, self.module.lm_head.weight.detach()[ids]
        return cpu_linear(self.module.shared_head.norm(g), self._head[1]).float()

    def _features(self, features: dict) -> torch.Tensor:
        """What the module conditions on, per position, from the target's captured states."""
        return self.final_norm(on(features[self.layer], self.device))

    @torch.inference_mode()
    def commit(self, request_ids: list[int], tokens: list[list[int]], features: list[dict]) -> None:
        new = []  # (request, tokens, states) of the pairs complete now
        for rid, toks, h in zip(request_ids, tokens, features, strict=True):
            first = rid not in self._tokens
            buf_t, buf_h = self._tokens.setdefault(rid, []), self._hidden.setdefault(rid, [])
            buf_t.extend(toks[1:] if first else toks)  # pair j takes token j: the first token never is one
            if h:
                buf_h.extend(self._features(h))
            m = min(len(buf_t), len(buf_h))
            if m:
                new.append((rid, torch.tensor(buf_t[:m], device=self.device), torch.stack(buf_h[:m])))
                del buf_t[:m], buf_h[:m]
        if new:
            self._pairs(new)

    def _pairs(self, new: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Run the module over new committed pairs of several requests in one pass: every pair's
        keys and values are cached; only each request's newest pair attends and goes through the
        rest of the layer (its output yields the first draft; the others' outputs are never read)."""
        rids = [rid for rid, _, _ in new]
        counts = [len(t) for _, t, _ in new]
        starts = [self.cache.length(rid) if rid in self.cache else 0 for rid in rids]
        self.cache.reserve(dict(zip(rids, counts, strict=True)))
        x = self.module.combine(torch.cat([t for _, t, _ in new]), torch.cat([h for _, _, h in new]))
        dev = self.device  # the pass's small integers are built on the host, then sent in one copy each
        positions = torch.cat([torch.arange(s + 1, s + 1 + n, device="cpu") for s, n in zip(starts, counts,
                                                                                          strict=True)]).to(dev)
        q, k, v = self.module.qkv(x, positions)  # pair j sits at position j
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        table = self.cache.block_table(rids)  # once: the new pairs' slots, then every key
        slots = torch.from_numpy(self.cache.between_of(table, starts, ends)).to(dev)
        scatter(self.cache.k[0], slots, k)
        scatter(self.cache.v[0], slots, v)
        for rid, n in zip(rids, counts, strict=True):
            self.cache.commit(rid, n)
        newest = torch.cumsum(torch.tensor(counts, device=dev), 0) - 1
        ctx = ends
        keys = torch.from_numpy(self.cache.rows_of(table, np.asarray(ctx), max(ctx))).to(dev, non_blocking=True)
        mask = torch.arange(max(ctx), device=dev)[None, :] < torch.tensor(ctx, device=dev)[:, None]  # [R, T]
        attn = _attend(q[newest][:, None], gather(self.cache.k[0], keys), gather(self.cache.v[0], keys), mask[:, None],
                       self.scale)
        g = self.module.finish(x[newest], attn[:, 0])
        for rid, row in zip(rids, g, strict=True):
            self._last[rid] = row

    @torch.inference_mode()
    def draft(self, request_ids: list[int], last_tokens: list[int], lengths: list[int], temperature: float = 0.0,
              rng: np.random.Generator | None = None, stop: ChainStop | None = None) -> DraftOutput:
        """Up to lengths[i] drafts for request i: the first from its newest pair's output, each
        further one from one more pass over [cached pairs ; drafts so far]. `stop`: the chain is
        cut as it runs (`dcut_core.chains`), from each pass's greedy confidences — one copy of
        two numbers a request to the host per pass."""
        lengths = [min(n, self.block - 1) if rid in self._last else 0 for rid, n in zip(request_ids, lengths,
                                                                                         strict=True)]
        live = [i for i, n in enumerate(lengths) if n]
        steps: list[torch.Tensor] = []  # per chain step: logits [len(live), V]
        if live:
            g = torch.stack([self._last[request_ids[i]] for i in live])
            ctx = [self.cache.length(request_ids[i]) for i in live]
            t = max(ctx)
            dev = self.device
            keys = torch.from_numpy(self.cache.slot_rows([request_ids[i] for i in live], np.asarray(ctx), t))
            keys, ctx_t = keys.to(dev, non_blocking=True), torch.tensor(ctx, device=dev)
            n = max(lengths)
            # keys and values: the cached pairs, then room for the chain's own (written in place)
            k_all = self.cache.k.new_zeros((len(live), t + n, *self.cache.k.shape[2:]))
            v_all = self.cache.v.new_zeros((len(live), t + n, *self.cache.v.shape[2:]))
            k_all[:, :t], v_all[:, :t] = gather(self.cache.k[0], keys), gather(self.cache.v[0], keys)
            mask = torch.zeros(len(live), t + n, dtype=torch.bool, device=dev)
            mask[:, :t] = torch.arange(t, device=dev)[None, :] < ctx_t[:, None]
            cut = None if stop is None else ChainCut(stop, np.array([lengths[i] for i in live]))
            for s in range(n):
                logits = self._logits(g)
                steps.append(logits)
                if cut is not None and not cut.after_pass(*_confidence(logits)):
                    break
                if s + 1 == n:
                    break
                tok = logits.argmax(-1)  # the chain follows the greedy draft (sampling draws below)
                if self._head is not None:
                    tok = self._head[0][tok]
                x = self.module.combine(tok, g)
                q, k_all[:, t + s], v_all[:, t + s] = self.module.qkv(x, ctx_t + 1 + s)
                mask[:, t + s] = True
                g = self.module.finish(x, _attend(q[:, None], k_all[:, :t + s + 1], v_all[:, :t + s + 1],
                                                  mask[:, None, :t + s + 1], self.scale)[:, 0])
            if cut is not None:
                for j, i in enumerate(live):
                    lengths[i] = int(cut.lengths[j])
        rows = [steps[s][j] for j, i in enumerate(live) for s in range(lengths[i])]
        width = self.module.vocab_size if self.vocab is None else len(self.vocab)
        logits = torch.stack(rows) if rows else torch.zeros(0, width, device=self.device)
        return sample_drafts(logits, lengths, temperature, rng, None if self._head is None else self._head[0])

    def release(self, request_ids: list[int]) -> None:
        self.cache.release_all([r for r in request_ids if r in self.cache])
        for rid in request_ids:
            self._tokens.pop(rid, None)
            self._hidden.pop(rid, None)
            self._last.pop(rid, None)

    def held_requests(self) -> set[int]:
        return set(self.cache.requests) | set(self._tokens) | set(self._hidden) | set(self._last)


def _confidence(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """([L], [L]) on the host: each row's greedy draft's probability and its top-2 margin (as
    `sample_drafts` computes them), from the logits without a softmax over the vocabulary."""
    top2 = torch.topk(logits, 2, dim=-1).values
    p = torch.exp(top2 - torch.logsumexp(logits, dim=-1, keepdim=True))
    host = torch.stack([p[:, 0], p[:, 0] - p[:, 1]]).double().cpu().numpy()
    return host[0], host[1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float | None = None) -> torch.Tensor:
    """q [B, Q, H, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv], mask [B, Q, T] → [B, Q, H · Dv]
    (grouped-query: the key/value heads are shared, not copied)."""
    b, nq = q.shape[:2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, nq, -1)
