"""Self-distillation data for the drafter: the target's own continuations and hidden states.

Prompts are corpus windows; the target continues each, greedily or by sampling, and the hidden
states after the drafter's conditioning layers are captured at every position as the tokens are
fed (prefill and each decode step), so no second pass is needed.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from actors.target.model import ForwardBatch, MoETransformer
from tools.demo.data import token_array, windows


@dataclass
class DistillSet:
    tokens: torch.Tensor  # [S, T] int64: prompt then continuation
    features: torch.Tensor  # [S, T, L·H] float16: target hidden states at each position
    prompt_len: int
    sampled: torch.Tensor  # [S] bool: continuation sampled (else greedy)


@dataclass(frozen=True)
class DistillSpec:
    """What to distil: `count` sequences of `total_len` tokens from prompts of `prompt_len`, the
    hidden states after `layers`, a `sample_fraction` of the continuations sampled at
    `temperature` (the rest greedy), generated `batch` sequences at a time."""

    count: int
    prompt_len: int
    total_len: int
    layers: tuple[int, ...]
    sample_fraction: float = 0.4
    temperature: float = 0.8
    batch: int = 64
    seed: int = 0


def cached(model: MoETransformer, tokenizer: str | pathlib.Path, split: str, path: pathlib.Path,
           spec: DistillSpec) -> DistillSet:
    """The set saved at `path`, or generated from the tokenizer's corpus `split` and saved there."""
    if path.exists():
        return DistillSet(**torch.load(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    data = generate(model, token_array(tokenizer, split), spec)
    torch.save(data.__dict__, path)
    return data


@torch.inference_mode()
def generate(model: MoETransformer, arr: np.ndarray, spec: DistillSpec) -> DistillSet:
    count, prompt_len, total_len, layers = spec.count, spec.prompt_len, spec.total_len, spec.layers
    rng = np.random.default_rng(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    all_tokens, all_feats, all_sampled = [], [], []
    for start in tqdm(range(0, count, spec.batch), desc="distill", unit="batch"):
        b = min(spec.batch, count - start)
        prompts = windows(arr, rng, b, prompt_len - 1)  # [b, prompt_len]
        sampled = torch.from_numpy(rng.random(b) < spec.sample_fraction)
        cache = model.new_cache(b * total_len + 16 * b)
        ids = list(range(b))
        tokens = torch.zeros(b, total_len, dtype=torch.long)
        tokens[:, :prompt_len] = torch.from_numpy(prompts)
        feats = torch.zeros(b, total_len, len(layers) * model.cfg.hidden_size, dtype=torch.float16)
        chunk = prompts.tolist()
        pos = 0
        while True:
            batch_in = ForwardBatch.from_lists(ids, chunk, logits="last")
            logits, cap = model(batch_in, cache, capture_layers=layers)
            n = len(chunk[0])
            feats[:, pos:pos + n] = torch.cat([cap[layer] for layer in layers], -1).view(b, n, -1).half()
            pos += n
            if pos >= total_len:
                break
            greedy = logits.argmax(-1)
            draws = torch.multinomial(torch.softmax(logits / spec.temperature, -1), 1, generator=gen).squeeze(-1)
            nxt = torch.where(sampled, draws, greedy)
            tokens[:, pos] = nxt
            chunk = nxt[:, None].tolist()
        all_tokens.append(tokens)
        all_feats.append(feats)
        all_sampled.append(sampled)
    return DistillSet(torch.cat(all_tokens), torch.cat(all_feats), prompt_len, torch.cat(all_sampled))
