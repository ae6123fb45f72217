"""EAGLE-3 drafters as published: the `speculators` layout and the SpecForge layout.

One decoder layer drafts from the target's own hidden states. A committed position i gives the
feature f_i = fc([h_a ; h_b ; h_c]) of three target layers' outputs (optionally RMS-normed
first), and the pair (token i + 1, f_i) enters the layer as

    x = [input_layernorm(embed(t)) ; hidden_norm(f)]     (2H wide: q, k and v read both halves)
    g = f + o_proj(attention(x));  g = g + mlp(post_attention_layernorm(g))
    logits over the draft vocabulary = lm_head(norm(g)); draft id d is target id d + d2t[d]

A further draft chains on g itself (not through fc), at the next position, attending to every
committed pair and the chain so far: the same pass as DeepSeek's next-n module, so drafting is
`MTPDrafter`'s (`Eagle3Drafter` only supplies the features). Options of either layout:
`norm_before_residual` (the residual is the normed f), `norm_output` (speculators' Eagle 3.1: g
is normed before it is chained and before lm_head), `fc_norm` / `norm_before_fc`, and a Qwen3
layer (per-head q/k RMSNorm). Checked against each reference library's own forward
(`tests/actors/test_eagle3.py`, fixtures from `tests/fixtures/eagle3/make_reference.py`).

Layouts, by config.json:
- speculators: `speculators_model_type: "eagle3"`, the layer's config under
  `transformer_layer_config`, weights `layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`,
  `embed_tokens` (the target's is used when absent);
- SpecForge: `architectures: ["LlamaForCausalLMEagle3"]`, a flat Llama config with
  `draft_vocab_size`, weights `midlayer.*`, same others.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from actors.drafter.base import on
from actors.drafter.mtp import MTPDrafter
from actors.target.layers import RMSNorm, SwiGLU, apply_rope
from actors.target.rope import Rotary

CONFIG = "config.json"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_layers: tuple[int, ...]  # 1-based target layers whose outputs make the feature
    prefix: str  # "layers.0." (speculators) or "midlayer." (SpecForge)
    rotary: Rotary
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm: bool = False  # a Qwen3 layer
    norm_before_residual: bool = False
    norm_output: bool = False
    fc_norm: bool = False
    norm_before_fc: bool = False

    @classmethod
    def load(cls, folder: str | pathlib.Path, target_layers: int) -> Eagle3Config:
        """From an EAGLE-3 folder's config.json; `target_layers` is the target's layer count (for
        the default feature layers 2, N/2 and N - 3, as vLLM and SpecForge take them)."""
        d = json.loads((pathlib.Path(folder) / CONFIG).read_text())
        if d.get("speculators_model_type") not in (None, "eagle3"):
            raise ValueError(f"speculators model {d['speculators_model_type']!r} is not EAGLE-3")
        speculators = "speculators_model_type" in d
        if not speculators and "LlamaForCausalLMEagle3" not in (d.get("architectures") or ()):
            raise ValueError("not an EAGLE-3 folder: config.json has neither speculators_model_type "
                             "nor architectures LlamaForCausalLMEagle3")
        layer = d["transformer_layer_config"] if speculators else d
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError("EAGLE-3 drafters of more than one layer are not supported")
        if layer.get("model_type", "llama") not in ("llama", "qwen3"):
            raise ValueError(f"EAGLE-3 layer type {layer['model_type']!r} is not supported (llama, qwen3)")
        rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"EAGLE-3 rope scaling {kind!r} is not supported (default and yarn are)")
        heads = int(layer["num_attention_heads"])
        head_dim = int(layer.get("head_dim") or layer["hidden_size"] // heads)
        theta = float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
        yarn = tuple(sorted((k, v) for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")))
        ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        if ids is None:  # vLLM's and SpecForge's default, kept inside a small target
            ids = tuple(min(max(i, 1), target_layers) for i in (2, target_layers // 2, target_layers - 3))
        ids = tuple(int(i) for i in ids)
        if min(ids) < 1 or max(ids) > target_layers:
            raise ValueError(f"EAGLE-3 feature layers {list(ids)} must be in 1..{target_layers} (layer 0, the "
                             "embeddings, is not captured)")
        if len(ids) != 3 or d.get("target_hidden_size") not in (None, layer["hidden_size"]):
            raise ValueError("EAGLE-3 features must be three target layers as wide as the drafter")
        return cls(
            hidden_size=int(layer["hidden_size"]), num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads", heads)), head_dim=head_dim,
            intermediate_size=int(layer["intermediate_size"]), vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or layer["vocab_size"]), target_layers=ids,
            prefix="layers.0." if speculators else "midlayer.",
            rotary=Rotary(head_dim, theta, yarn if kind == "yarn" else ()),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(layer.get("attention_bias", False)), qk_norm=layer.get("model_type") == "qwen3",
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            norm_output=bool(d.get("norm_output", False)) if speculators else False,
            fc_norm=bool(d.get("fc_norm", False)), norm_before_fc=bool(d.get("norm_before_fc", False)),
        )


class Eagle3Module(nn.Module):
    """The drafter layer with its fc, norms and head: `features`, then the `MTPModule`
    interface (`combine`, `qkv`, `finish`, `logits`) that `MTPDrafter` chains."""

    def __init__(self, cfg: Eagle3Config, embed: nn.Embedding) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg, self.vocab_size = cfg, cfg.vocab_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.fc_norms = nn.ModuleList([RMSNorm(h, cfg.rms_norm_eps) for _ in range(3)]) if cfg.fc_norm else None
        self.input_norm = RMSNorm(3 * h, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, self.heads * d, bias=cfg.attention_bias)
        self.self_attn.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=cfg.attention_bias)
        self.self_attn.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=cfg.attention_bias)
        self.self_attn.o_proj = nn.Linear(self.heads * d, h, bias=False)
        if cfg.qk_norm:
            self.self_attn.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.self_attn.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self._embed = (embed,)  # the target's (or the folder's own), not this module's parameter

    def features(self, by_layer: dict) -> torch.Tensor:
        """f [N, H] from the target's outputs of the three feature layers ({layer: [N, H]})."""
        dev = self.fc.weight.device
        parts = [on(by_layer[layer], dev) for layer in self.cfg.target_layers]
        if self.fc_norms is not None:
            parts = [norm(p) for norm, p in zip(self.fc_norms, parts, strict=True)]
        x = torch.cat(parts, dim=-1)
        return self.fc(self.input_norm(x) if self.input_norm is not None else x)

    def combine(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[attention input (2H) ; residual (H)] of the pairs (tokens [N], hidden [N, H])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(self._embed[0](tokens)), normed, residual], dim=-1)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        n, a, y = x.shape[0], self.self_attn, x[..., :2 * self.cfg.hidden_size]
        q = a.q_proj(y).view(n, self.heads, self.head_dim)
        k = a.k_proj(y).view(n, self.kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        cos, sin = self.cfg.rotary.cos_sin(positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), a.v_proj(y).view(n, self.kv_heads, self.head_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """g from the pairs x and their attention output [N, heads · D] (normed under norm_output)."""
        g = x[..., 2 * self.cfg.hidden_size:] + self.self_attn.o_proj(attn)
        g = g + self.mlp(self.post_attention_layernorm(g))
        return self.norm(g) if self.cfg.norm_output else g

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., draft_vocab_size]."""
        return self.lm_head(g if self.cfg.norm_output else self.norm(g))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary: draft id d at target id d + d2t[d], −inf elsewhere
        (so a draft and its confidence are the draft vocabulary's)."""
        small = self.draft_logits(g)
        out = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        out[..., torch.arange(self.cfg.draft_vocab_size, device=small.device) + self.d2t] = small
        return out

    def save(self, folder: str | pathlib.Path) -> None:
        """Write the module in the speculators layout (config.json + model.safetensors, float32)."""
        c = self.cfg
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        rope = {"rope_type": "yarn" if c.rotary.yarn else "default", "rope_theta": c.rotary.theta,
                **dict(c.rotary.yarn)}
        layer = {"model_type": "qwen3" if c.qk_norm else "llama", "hidden_size": c.hidden_size,
                 "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
                 "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                 "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
                 "attention_bias": c.attention_bias, "rope_parameters": rope}
        config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
                  "eagle_aux_hidden_state_layer_ids": list(c.target_layers), "norm_before_residual":
                  c.norm_before_residual, "norm_output": c.norm_output, "fc_norm": c.fc_norm,
                  "norm_before_fc": c.norm_before_fc}
        (folder / CONFIG).write_text(json.dumps(config, indent=2))
        shared = ("fc", "fc_norms", "input_norm", "norm", "lm_head", "d2t")
        tensors = {(k if k.split(".")[0] in shared else "layers.0." + k).replace("fc_norms.", "fc_norm."):
                   v.detach().contiguous().clone() for k, v in self.state_dict().items()}
        tensors["embed_tokens.weight"] = self._embed[0].weight.detach().float().contiguous().clone()
        save_file(tensors, str(folder / "model.safetensors"))

    @classmethod
    def load(cls, folder: str | pathlib.Path, embed: nn.Embedding, target_layers: int) -> Eagle3Module:
        """From an EAGLE-3 folder (either layout). The folder's own `embed_tokens`, when present,
        must be the target's (EAGLE-3 drafters are trained with the target's embedding frozen)."""
        folder = pathlib.Path(folder)
        cfg = Eagle3Config.load(folder, target_layers)
        if cfg.vocab_size != embed.num_embeddings or cfg.hidden_size != embed.embedding_dim:
            raise ValueError(f"EAGLE-3 drafter of vocabulary {cfg.vocab_size} × {cfg.hidden_size} does not fit a "
                             f"target of {embed.num_embeddings} × {embed.embedding_dim}")
        index = folder / "model.safetensors.index.json"
        files = ([folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
                 if index.exists() else [folder / "model.safetensors"])
        if not files[0].exists():
            raise FileNotFoundError(f"no safetensors files in {folder}")
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
        module = cls(cfg, embed)
        own = tensors.pop("embed_tokens.weight", None)
        if own is not None and not torch.allclose(own.float(), embed.weight.float(), atol=1e-2):
            module._embed = (nn.Embedding.from_pretrained(own.float()),)  # its own, as trained
        for unused in ("t2d", "verifier_norm.weight", "verifier_lm_head.weight"):  # t2d: implied by d2t
            tensors.pop(unused, None)
        state = {key.removeprefix(cfg.prefix).replace("fc_norm.", "fc_norms."): value.long() if key == "d2t"
                 else value.float() for key, value in tensors.items()}
        missing, unexpected = module.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "d2t" or cfg.draft_vocab_size != cfg.vocab_size]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 weights in {folder}: missing {missing}, unexpected {unexpected}")
        targets = torch.arange(cfg.draft_vocab_size) + module.d2t
        if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size or len(set(targets.tolist())) != len(targets):
            raise ValueError("EAGLE-3 d2t maps draft ids outside the target vocabulary or onto one id twice")
        return module.eval()


class Eagle3Drafter(MTPDrafter):
    """`MTPDrafter`'s chain over an EAGLE-3 module, conditioned on its three feature layers."""

    def __init__(self, module: Eagle3Module, capacity_tokens: int = 65536, block: int = 16) -> None:
        super().__init__(module, None, 0, capacity_tokens, block)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.module.cfg.target_layers)))

    def _features(self, features: dict) -> torch.Tensor:
        return self.module.features(features)
