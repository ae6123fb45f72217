"""`FeatureStore`: the drafter's features kept on the rank that computed them.

The block drafter conditions on the target's hidden states after a few layers at every committed
position. While the drafting gate runs plain decoding nobody needs them, and shipping them every
step (rank → coordinator → drafter) cost about as much as the gate saved. So each rank keeps the
states of its own requests here, at their KV positions, and hands over a span only when a drafter
asks for it (`TargetWorker.features`, passed by reference into the drafter's call).

Positions follow the KV cache: a forward that starts at position p (after the previous step's
roll-back) replaces whatever the store held at p and beyond, so rejected drafts never survive.
A span that is taken is dropped: the store holds only what no drafter has yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class Chunk:
    """Positions start .. start + n of one request: rows offset .. offset + n of `block`, one
    step's capture of every layer side by side (shared by the step's requests, never copied
    per request: a step costs a few integers per request here)."""

    start: int
    n: int
    block: torch.Tensor  # [rows, layers × H] float16
    offset: int

    @property
    def end(self) -> int:
        return self.start + self.n

    def cut(self, a: int, b: int) -> Chunk:
        """Positions [a, b) of this chunk (within it)."""
        return Chunk(a, b - a, self.block, self.offset + a - self.start)

    def rows(self) -> torch.Tensor:
        return self.block[self.offset:self.offset + self.n]


class FeatureStore:
    """Per request, contiguous runs of feature rows keyed by position."""

    def __init__(self) -> None:
        self._chunks: dict[int, list[Chunk]] = {}

    def write(self, rid: int, start: int, block: torch.Tensor, offset: int = 0, n: int | None = None) -> None:
        """Rows offset .. offset + n of `block` (default: all) are positions start.. of request
        rid; anything held at start or beyond goes (and everything, if the rows would not
        continue what is held)."""
        n = len(block) - offset if n is None else n
        chunks = self._chunks.setdefault(rid, [])
        while chunks and chunks[-1].start >= start:
            chunks.pop()
        if chunks and chunks[-1].end > start:
            chunks[-1] = chunks[-1].cut(chunks[-1].start, start)
        if chunks and chunks[-1].end != start:  # positions were skipped: what is held can no longer be a span
            chunks.clear()
        if n:
            chunks.append(Chunk(start, n, block, offset))

    def take(self, spans: dict[int, tuple[int, int]], host: bool = True) -> dict[int, np.ndarray | torch.Tensor]:
        """Rows of positions [start, end) per request (float16: a host array, or with `host`
        False a tensor where they were computed, for a drafter on the same device), then dropped
        with everything before them. Raises LookupError if a span is not all held."""
        out = {}
        for rid, (start, end) in spans.items():
            chunks = self._chunks.get(rid, [])
            parts = [c.cut(max(c.start, start), min(c.end, end)) for c in chunks
                     if c.start < end and c.end > start and end > start]
            if end > start and (not parts or parts[0].start != start or parts[-1].end != end):
                held = [(c.start, c.end) for c in chunks]
                raise LookupError(f"request {rid}: features of positions [{start}, {end}) are not all held ({held})")
            rows = torch.cat([p.rows() for p in parts]) if parts else None
            out[rid] = rows.cpu().numpy() if host and rows is not None else rows
            self._chunks[rid] = [c if c.start >= end else c.cut(end, c.end) for c in chunks if c.end > end]
        return out

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self._chunks.pop(rid, None)

    def held(self, rid: int) -> tuple[int, int] | None:
        """[first, end) positions held for rid (None: nothing)."""
        chunks = self._chunks.get(rid)
        return (chunks[0].start, chunks[-1].end) if chunks else None

    @property
    def rows(self) -> int:
        return sum(c.n for chunks in self._chunks.values() for c in chunks)
