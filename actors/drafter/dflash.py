"""DFlash drafters as published (z-lab's `DFlashDraftModel`: a Qwen3 config.json with
`dflash_config`, weights `layers.{i}.*`, `fc`, `hidden_norm`, `norm`) loaded into the block
drafter (`actors/drafter/model.py`), which is the same computation:

| DFlash | block drafter |
|---|---|
| target states of `target_layer_ids` (0-based layer outputs) | `target_layers` = those ids + 1 (1-based) |
| `hidden_norm(fc(features))`, once, for every layer | `ctx_proj`, then each layer's `norm_ctx` (= `hidden_norm`) |
| the block `[t, mask_token_id, …]` embedded by the target | `mask_embedding` = the target's row of `mask_token_id` |
| Qwen3 layers: per-head `q_norm`/`k_norm` before RoPE, on context and block keys alike | `qk_norm` |
| block attends to the whole context and the whole block | the same (`DraftLayer`) |
| `norm`, then the target's LM head on block positions 1.. | the same |

Checked against the library's forward on tiny random weights (`tests/actors/test_dflash.py`,
fixture from `tests/fixtures/dflash/make_reference.py`). Variants this mapping cannot express
are refused by name: DFlash-2 (convolution branches), causal or sliding-window layers, biases,
logit multipliers or soft-capping, RoPE scaling.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import load_file
from torch import nn

from actors.drafter import is_dflash
from actors.drafter.model import DraftConfig, DraftModel

CONFIG = "config.json"


def dflash_config(d: dict) -> tuple[DraftConfig, int]:
    """The block drafter's config for a DFlash config.json, and the mask token id."""
    extra = d.get("dflash_config") or {}

    def value(name, default=None):
        return extra.get(name, d.get(name, default))

    refusals = {
        "convolution branches (DFlash-2)": any("conv" in k for k in extra) or "DFlash2DraftModel" in (
            d.get("architectures") or ()),
        "causal attention": bool(d.get("is_causal")),
        "sliding-window layers": any(t != "full_attention" for t in d.get("layer_types") or ()),
        "attention biases": bool(d.get("attention_bias")),
        "a logit multiplier or soft-capping": float(value("output_multiplier", 1.0)) != 1.0
        or bool(value("final_logit_softcapping")),
        "RoPE scaling": (d.get("rope_parameters") or d.get("rope_scaling") or {}).get("rope_type", "default")
        != "default",
    }
    refused = [what for what, present in refusals.items() if present]
    if refused:
        raise ValueError(f"DFlash drafter with {', '.join(refused)} is not supported")
    layers = value("target_layer_ids")
    if layers is None or value("mask_token_id") is None:
        raise ValueError("DFlash config.json needs dflash_config.target_layer_ids and mask_token_id")
    heads = int(d["num_attention_heads"])
    rope = d.get("rope_parameters") or {}
    cfg = DraftConfig(
        hidden_size=int(d["hidden_size"]), target_layers=tuple(int(i) + 1 for i in layers),
        num_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads", heads)),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads), intermediate_size=int(d["intermediate_size"]),
        block_size=int(value("block_size", 16)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))), qk_norm=True,
    )
    return cfg, int(value("mask_token_id"))


_NAMES = {"input_layernorm": "norm_in", "post_attention_layernorm": "norm_mlp", "self_attn.q_proj": "q_proj",
          "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
          "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}


def load_dflash(folder: str | pathlib.Path, embed: nn.Embedding, lm_head: nn.Linear) -> DraftModel:
    """A DFlash folder as a block drafter over the target's embedding and LM head."""
    folder = pathlib.Path(folder)
    cfg, mask = dflash_config(json.loads((folder / CONFIG).read_text()))
    if mask >= embed.num_embeddings or cfg.hidden_size != embed.embedding_dim:
        raise ValueError(f"DFlash drafter (hidden {cfg.hidden_size}, mask token {mask}) does not fit a target of "
                         f"{embed.num_embeddings} × {embed.embedding_dim}")
    tensors = load_file(str(folder / "model.safetensors"))
    state: dict[str, torch.Tensor] = {"ctx_proj.weight": tensors.pop("fc.weight"),
                                      "mask_embedding": embed.weight.detach()[mask].clone()}
    hidden_norm = tensors.pop("hidden_norm.weight")
    for i in range(cfg.num_layers):
        state[f"layers.{i}.norm_ctx.weight"] = hidden_norm
    for key, t in tensors.items():
        parts = key.split(".")
        if parts[0] == "layers":
            rest = ".".join(parts[2:])
            for theirs, ours in _NAMES.items():
                if rest.startswith(theirs + "."):
                    rest = ours + rest[len(theirs):]
            key = f"layers.{parts[1]}.{rest}"
        state[key] = t
    model = DraftModel(cfg, embed, lm_head)
    result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if set(result.missing_keys) - {"head_ids"} or result.unexpected_keys:
        raise ValueError(f"DFlash weights in {folder} do not fit its config: {result}")
    return model.eval()


def load_block_model(folder: str | pathlib.Path, embed: nn.Embedding, lm_head: nn.Linear) -> DraftModel:
    """The block drafter in `folder`: our own format (drafter_config.json) or a DFlash one."""
    return load_dflash(folder, embed, lm_head) if is_dflash(folder) else DraftModel.load(folder, embed, lm_head)
