"""`Backlog`: what each request's drafter has not been sent yet (lazy drafter upkeep).

A drafter conditions on everything a request committed: the tokens, and for the block drafter
the target's hidden states at them. Shipping those every step and projecting them into the
drafter's context cache costs a fifth of a step at concurrency 64 on this machine, and is
wasted while the drafting gate runs plain decoding. So commits wait here, per request, and
travel with the first draft call that needs them (`DrafterReplica.draft(..., catchup=...)`).

A request's backlog is bounded: past `limit` tokens it is sent at once (as a plain commit), so
the coordinator never holds more than about `limit` tokens of features per request.
Features are kept as float16, the precision the drafter was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core import ragged


@dataclass
class Pending:
    tokens: list[int] = field(default_factory=list)
    hidden: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> row blocks

    @property
    def size(self) -> int:
        return len(self.tokens)


class Backlog:
    """Per request: committed tokens and target features its drafter has not received."""

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self._pending: dict[int, Pending] = {}

    def add(self, rid: int, tokens: list[int], hidden: dict[int, np.ndarray]) -> bool:
        """Queue one commit; True when the request's backlog is over the limit (send it now)."""
        p = self._pending.setdefault(rid, Pending())
        p.tokens.extend(tokens)
        for layer, h in hidden.items():
            if len(h):
                p.hidden.setdefault(layer, []).append(np.array(h, dtype=np.float16))  # a copy, never a view
        return p.size > self.limit

    def take(self, rids: list[int]) -> tuple[list[int], list[list[int]], list[dict[int, np.ndarray]]] | None:
        """Remove and return the backlog of these requests as one commit (None: nothing pending)."""
        out: tuple[list, list, list] = ([], [], [])
        for rid in rids:
            p = self._pending.pop(rid, None)
            if p is None or not (p.tokens or p.hidden):
                continue
            out[0].append(rid)
            out[1].append(p.tokens)
            out[2].append({layer: np.concatenate(blocks) for layer, blocks in p.hidden.items()})
        return out if out[0] else None

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
        return p.size if p is not None else 0

    def drop(self, rids: list[int]) -> None:
        for rid in rids:
            self._pending.pop(rid, None)

    def tokens(self) -> int:
        """Tokens held in all (for metrics and tests)."""
        return sum(p.size for p in self._pending.values())
