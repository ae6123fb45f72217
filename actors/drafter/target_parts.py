"""The parts of the target checkpoint a drafter shares, read from its files without loading the
rest of the target: the token embedding and LM head, and the final norm."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open

from actors.target.config import MoEConfig


def shared_embeddings(target_dir: str) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The target's token embedding and LM head, without loading the rest of the target."""
    cfg = MoEConfig.load(target_dir)
    index = None
    path = pathlib.Path(target_dir)
    if (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]

    def get(key: str) -> torch.Tensor:
        f = path / (index[key] if index else "model.safetensors")
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(key).float()

    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.weight = torch.nn.Parameter(get("model.embed_tokens.weight"), requires_grad=False)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight = embed.weight if cfg.tie_word_embeddings else torch.nn.Parameter(get("lm_head.weight"),
                                                                                    requires_grad=False)
    return embed, head


def target_final_norm(target_dir: str):
    """The target's final RMSNorm (`model.norm`): the MTP drafter conditions on normed states."""
    from actors.target.layers import RMSNorm

    cfg = MoEConfig.load(target_dir)
    path = pathlib.Path(target_dir)
    index = path / "model.safetensors.index.json"
    f = path / (json.loads(index.read_text())["weight_map"]["model.norm.weight"] if index.exists()
                else "model.safetensors")
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    with safe_open(str(f), framework="pt") as h:
        norm.weight = torch.nn.Parameter(h.get_tensor("model.norm.weight").float(), requires_grad=False)
    return norm
