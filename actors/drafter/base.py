"""What every drafter takes and returns (block drafter and n-gram drafter alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class DraftOutput:
    """Drafts of one pass for R requests, ragged: flat arrays + offsets."""

    tokens: np.ndarray  # [N] int64
    cu: np.ndarray  # [R + 1]
    confidence: np.ndarray  # [N] probability the drafter gave the drafted token
    margin: np.ndarray  # [N] top-1 minus top-2 probability
    probs: np.ndarray | None = None  # [N, V] the distribution each draft was drawn from (sampling only)
    compute_s: float = 0.0  # the drafter's own time for this pass (set by the replica)
    lost: tuple[int, ...] = ()  # requests given no drafts: their context could not be fetched (replica)
    kind_s: dict[int, float] | None = None  # each hosted kind's own drafting time (a replica of several)
    kinds: np.ndarray | None = None  # [R] the kind that drafted each request (a fallback may stand in)
    kind_context: dict[int, int] | None = None  # context tokens each kind caught up on before drafting


def merge_outputs(r: int, parts) -> DraftOutput:
    """One ragged output for R requests from parts (batch indices, output) that cover them (the
    drafts' sampling distributions are not carried: drafts from a replica are greedy)."""
    tokens = [np.zeros(0, dtype=np.int64)] * r
    conf, margin = [np.zeros(0)] * r, [np.zeros(0)] * r
    for idx, d in parts:
        for j, i in enumerate(idx):
            sl = slice(d.cu[j], d.cu[j + 1])
            tokens[i], conf[i], margin[i] = d.tokens[sl], d.confidence[sl], d.margin[sl]
    cu = np.zeros(r + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=cu[1:])
    return DraftOutput(np.concatenate(tokens).astype(np.int64), cu, np.concatenate(conf).astype(np.float64),
                       np.concatenate(margin).astype(np.float64))


def cat_rows(parts: list) -> np.ndarray | torch.Tensor:
    """Feature rows of one request in order: host arrays stay on the host; if any part is a
    tensor (features handed over on a rank's device), all join it there."""
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if not tensors:
        return np.concatenate(parts)
    dev = tensors[0].device
    return torch.cat([as_tensor(p).to(dev, non_blocking=True) for p in parts])


def as_tensor(rows: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor as it is, a host array as a host tensor (never on torch's default device)."""
    return rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(rows))


def on(rows, device: torch.device) -> torch.Tensor:
    """Feature rows (a host array, or a tensor already on the rank's device) as float32 on `device`."""
    return as_tensor(rows).to(device=device, dtype=torch.float32, non_blocking=True)


class Drafter(Protocol):
    """Drafts for a batch of requests; owns whatever per-request state it keeps."""

    def draft(self, request_ids: list[int], last_tokens: list[int], lengths: list[int],
              temperature: float = 0.0, rng: np.random.Generator | None = None) -> DraftOutput:
        """Up to lengths[i] drafts for request i following last_tokens[i] (its newest token)."""
        ...

    def commit(self, request_ids: list[int], tokens: list[list[int]], features: list[dict]) -> None:
        """Newly committed tokens of each request, and the target's hidden states (layer ->
        [m_i, H]) at those of them the target has processed (all but the newest)."""
        ...

    def release(self, request_ids: list[int]) -> None: ...

    def held_requests(self) -> set[int]:
        """The requests it keeps any state for (none once each is released)."""
        ...
