"""A target checkpoint's own next-n layer as the MTP drafter's module.

DeepSeek-V3 and GLM-4-MoE checkpoints carry `num_nextn_predict_layers` extra layers, stored as
layer `num_hidden_layers` (`model.layers.{N}.*`): `enorm`, `hnorm`, `eh_proj`, one decoder layer
of the target's own kind (latent attention for DeepSeek-V3, grouped-query for GLM, and a MoE
block with every expert), `shared_head.norm`, and copies of the embedding and LM head. The target
does not read them (nor does transformers); `NextNModule` builds that layer from the target's
own decoder code (`actors/target/model.py` `DecoderLayer`, so its attention and routing are the
ones tested against transformers) and gives it `MTPModule`'s interface, so `MTPDrafter` chains it
exactly as it chains our trained MTP module:

    x_j = eh_proj([enorm(embed(t_j)) ; hnorm(h_{j-1})]),  g_j = layer(x_j),  logits = head(norm(g_j))

Its weights are read through the target's checkpoint reader: the family's names, sharded or
not, FP8 block-scaled weights dequantized. Only the first next-n layer is used (DeepSeek and GLM
ship one).
"""

from __future__ import annotations

import pathlib
from contextlib import ExitStack

import torch
from torch import nn

from actors.drafter.mtp import check_shared_copies
from actors.target.checkpoint import _load_experts, _Tensors
from actors.target.config import MoEConfig
from actors.target.layers import RMSNorm
from actors.target.model import DecoderLayer


class NextNModule(nn.Module):
    def __init__(self, cfg: MoEConfig, embed: nn.Embedding, head: nn.Linear) -> None:
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_hidden_layers
        self.cfg, self.index, self.vocab_size = cfg, n, head.out_features
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        layer = DecoderLayer(cfg, n, 0, None)  # the target's own layer code, every expert local
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.is_moe = layer.is_moe
        self._shared = (embed, head)
        self.heads = cfg.num_attention_heads
        if cfg.latent:  # one latent row per pair: [c ; k_rot] as the key, c as the value
            self.kv_heads, self.head_dim, self.value_dim = 1, cfg.kv_lora_rank + cfg.head_dim, cfg.kv_lora_rank
            self.scale = cfg.attention_scale
        else:
            self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim

    def combine(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(self._shared[0](tokens)), self.hnorm(hidden)], dim=-1))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        y = self.input_layernorm(x)
        cos, sin = self.cfg.rotary.cos_sin(positions)
        if self.cfg.latent:
            queries, rows = self.self_attn._latent(y, cos, sin)
            return queries, rows[:, None], rows[:, None, :self.cfg.kv_lora_rank]
        q, k, v = self.self_attn.qkv(y)
        q, k = self.self_attn.rope(q, k, cos, sin)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if self.cfg.latent:
            out = self.self_attn._out(attn.view(attn.shape[0], self.heads, self.cfg.kv_lora_rank))
        else:
            out = self.self_attn.o_proj(attn)
        h = x + out
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self._shared[1](self.shared_head.norm(g))

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head (borrowed, frozen)."""
        return self._shared[1]

    @classmethod
    def load(cls, target_dir: str | pathlib.Path, embed: nn.Embedding, head: nn.Linear) -> NextNModule:
        """The next-n layer of a target checkpoint; its copies of the embedding and LM head must
        be the target's (they are, in DeepSeek's and GLM's checkpoints)."""
        target_dir = pathlib.Path(target_dir)
        cfg = MoEConfig.load(target_dir)
        with torch.device("meta"):
            module = cls(cfg, embed, head)
        prefix = f"model.layers.{module.index}."
        state: dict[str, torch.Tensor] = {}
        with ExitStack() as stack:
            tensors = _Tensors(target_dir, stack)
            check_shared_copies(prefix, lambda name: tensors.get(prefix + name) if prefix + name in tensors else None,
                                embed, head)
            for name, _ in module.named_parameters():
                if ".experts." not in name:
                    state[name] = tensors.get(prefix + name)
            if module.is_moe:
                state["mlp.experts.gate_up"], state["mlp.experts.down"] = _load_experts(
                    tensors, module.index, 0, cfg.num_experts)
        module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
        module._shared = (embed, head)
        return module.eval()
