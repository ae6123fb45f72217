"""`Backlog`: what each request's drafter has not been sent yet (lazy drafter upkeep).

A drafter conditions on everything a request committed: the tokens, and for the block drafter
the target's hidden states at them. Sending those every step and projecting them into the
drafter's context cache is wasted while the drafting gate runs plain decoding. So commits wait,
and travel with the first draft call that needs them (`DrafterReplica.draft(..., catchup=...)`):

- tokens wait here, in the coordinator (a few integers a step);
- features never come here: each target rank keeps its requests' rows (`FeatureStore`) and
  the backlog only tracks, per request, the span of positions the drafter lacks. The coordinator
  turns spans into references (`EPGroup.features`) that the drafter resolves itself.

A request's backlog is bounded: past `limit` tokens it is sent at once (as a plain commit), so
neither a rank nor a drafter's catch-up ever holds much more than `limit` positions per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core import ragged


@dataclass(frozen=True)
class CatchUp:
    """Context some requests' drafter lacks: committed tokens, and the target's features at the
    positions it has not seen — inline (`hidden`, per request) or held by the target's ranks
    (`spans`, turned into `sources`: references resolving to {request: {layer: rows}})."""

    rids: list[int]
    tokens: list[list[int]]
    hidden: list[dict] | None = None
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    sources: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(map(len, self.tokens))


@dataclass
class Pending:
    tokens: list[int] = field(default_factory=list)
    start: int = 0  # first position whose features the drafter lacks
    end: int = 0  # features exist (on the ranks) for positions before this


class Backlog:
    """Per request: committed tokens its drafter has not received, and the span of positions
    whose features it lacks (`features=False`: the drafter needs none, e.g. n-gram)."""

    def __init__(self, limit: int = 512, features: bool = True) -> None:
        self.limit = limit
        self.features = features
        self._pending: dict[int, Pending] = {}

    def add(self, rid: int, tokens: list[int], end: int) -> bool:
        """Queue one commit (tokens, and features now held up to position `end`); True when the
        request's backlog is over the limit (send it now)."""
        p = self._pending.setdefault(rid, Pending())
        p.tokens.extend(tokens)
        p.end = max(p.end, end)
        return len(p.tokens) > self.limit

    def take(self, rids: list[int]) -> CatchUp | None:
        """Remove and return the backlog of these requests as one catch-up (None: nothing)."""
        out = CatchUp([], [])
        for rid in rids:
            p = self._pending.get(rid)
            if p is None or not (p.tokens or p.end > p.start):
                continue
            out.rids.append(rid)
            out.tokens.append(p.tokens)
            if self.features:
                out.spans[rid] = (p.start, p.end)
            p.tokens, p.start = [], p.end
        return out if out.rids else None

    def charged(self, rids: list[int], predicted: list[np.ndarray], remaining: np.ndarray) -> np.ndarray:
        """Tokens each request's drafter would catch up on, charged to this step only in
        proportion to the share of its remaining output the step may commit (1 + Σ predicted
        survival over `remaining`): catching up is paid once and serves every later drafting
        step. (Charged in full, it grows each step a request does not draft, and keeps it from
        ever drafting.)"""
        flat, cu = ragged.flatten(predicted)
        expected = 1.0 + ragged.segment_sums(ragged.segment_cumprod(flat, cu), cu)
        backlog = np.array([self.size(rid) for rid in rids], dtype=np.float64)
        return backlog * np.minimum(1.0, expected / np.maximum(1.0, remaining))

    def size(self, rid: int) -> int:
        """Tokens request rid's drafter has yet to receive."""
        p = self._pending.get(rid)
        return len(p.tokens) if p is not None else 0

    def drop(self, rids: list[int]) -> None:
        for rid in rids:
            self._pending.pop(rid, None)

    def tokens(self) -> int:
        """Tokens held in all (for metrics and tests)."""
        return sum(len(p.tokens) for p in self._pending.values())
