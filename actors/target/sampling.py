"""The target's sampling distribution for each verified row: temperature, then top-p."""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [M, V] for logits [M, V] with per-row temperature [M] (> 0) and top_p [M].

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one)
    and renormalises; this is the distribution speculative sampling must reproduce.
    """
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if bool((top_p < 1.0).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop = before >= top_p[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
