"""What each request's drafter kinds lack: `ContextLedger`, owned by the drafter pool, and its
`Backlog` of context not yet sent (lazy drafter upkeep).

A drafter conditions on everything a request committed: the tokens, and for the neural kinds
the target's features at them (its hidden states at the layers the drafter reads). Sending those
every step and projecting them into the drafter's context cache is wasted while the drafting
gate runs plain decoding. So commits wait, and travel with the first draft call that needs them
(`DrafterReplica.draft(..., catchup=...)`):

- tokens wait here, in the coordinator (a few integers a step);
- features of a step in which the request did not draft stay on its target rank
  (`FeatureStore`): the backlog only tracks the span of positions the drafter lacks, and the
  coordinator turns it into references (`EPGroup.features`) that the drafter resolves itself;
- features of a step in which it drafted come back with the target's result and wait here
  (float16): a request that drafts again next step would otherwise pay a fetch from the rank
  every step. They are always older than any span (a drafting step took the whole backlog).

A request's backlog is bounded: past `limit` tokens it is sent at once (as a plain commit), so
neither a rank nor a drafter's catch-up ever holds much more than `limit` positions per request.

Once sent, a replica of one kind hands the context straight to its drafter; a replica of several
holds each kind's share until that kind drafts (`actors/drafter/pending.py`, the data itself, in
the replica's process). The ledger is the one account of both on the coordinator's side: what
kind k of request r lacks is what it would catch up on before drafting (`lag`, the gate's input).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CatchUp:
    """Context some requests' drafter lacks: committed tokens, and the target's features at the
    positions it has not seen — first those sent along (`features`, per request), then those held
    by the target's ranks (`spans`, turned into `sources`: references resolving to
    {request: {layer: rows}})."""

    rids: list[int]
    tokens: list[list[int]]
    features: list[dict] | None = None
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    sources: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(map(len, self.tokens))


@dataclass
class Pending:
    tokens: list[int] = field(default_factory=list)
    features: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> row blocks held here
    start: int = 0  # first position whose features the drafter lacks (held here, then on the ranks)
    end: int = 0  # features exist for positions before this

    @property
    def held_here(self) -> int:
        return sum(map(len, next(iter(self.features.values()), [])))


class Backlog:
    """Per request: committed tokens its drafter has not received, and the span of positions
    whose features it lacks (`features=False`: the drafter needs none, e.g. n-gram)."""

    def __init__(self, limit: int = 512, features: bool = True) -> None:
        self.limit = limit
        self.features = features
        self._pending: dict[int, Pending] = {}

    def __len__(self) -> int:
        """Requests with something queued."""
        return len(self._pending)

    def add(self, rid: int, tokens: list[int], end: int, features: dict[int, np.ndarray] | None = None) -> bool:
        """Queue one commit: tokens, and features now held up to position `end` — on the ranks,
        or here when `features` brings this commit's rows (layer -> [n, H]). True when the
        request's backlog is over the limit (send it now)."""
        p = self._pending.setdefault(rid, Pending())
        p.tokens.extend(tokens)
        rows = len(next(iter(features.values()))) if features else 0
        if rows:
            if p.end != p.start + p.held_here:
                raise RuntimeError(f"request {rid}: features sent along must not follow features on the ranks")
            for layer, h in features.items():
                p.features.setdefault(layer, []).append(np.array(h, dtype=np.float16))  # a copy, never a view
        p.end = max(p.end, end)
        return len(p.tokens) > self.limit

    def take(self, rids: list[int]) -> CatchUp | None:
        """Remove and return the backlog of these requests as one catch-up (None: nothing)."""
        out = CatchUp([], [], [])
        for rid in rids:
            p = self._pending.get(rid)
            if p is None or not (p.tokens or p.end > p.start):
                continue
            out.rids.append(rid)
            out.tokens.append(p.tokens)
            out.features.append({layer: np.concatenate(blocks) for layer, blocks in p.features.items()})
            if self.features and p.end > p.start + p.held_here:
                out.spans[rid] = (p.start + p.held_here, p.end)
            p.tokens, p.features, p.start = [], {}, p.end
        return out if out.rids else None

    def rids(self) -> set[int]:
        """Requests with something queued."""
        return set(self._pending)

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


class ContextLedger:
    """Per request and per engine kind: the context that kind's drafter has not consumed.

    `hosted` marks the kinds the replicas draft (the coordinator drafts n-gram itself: it lacks
    nothing). With one hosted kind (`direct`) what it lacks is the backlog; with several, the
    context since it last drafted for the request (`drafted`): the replica holds the rest."""

    def __init__(self, hosted: np.ndarray, limit: int = 512, features: bool = True) -> None:
        self.hosted = np.asarray(hosted, dtype=bool)
        self.direct = int(self.hosted.sum()) == 1
        self.backlog = Backlog(limit, features)
        self._seen: dict[int, np.ndarray] = {}  # request -> context length each kind has consumed

    def __len__(self) -> int:
        """Requests with something recorded."""
        return len(self.backlog.rids() | self._seen.keys())

    def queue(self, rid: int, tokens: list[int], end: int, features: dict[int, np.ndarray] | None = None) -> bool:
        """A commit for request rid's drafter (`Backlog.add`): True when it must be sent now."""
        return self.backlog.add(rid, tokens, end, features)

    def take(self, rids: list[int]) -> CatchUp | None:
        """The backlog of these requests, to send with their draft call or now."""
        return self.backlog.take(rids)

    def drafted(self, rids: list[int], kinds: list[int], cached: list[int]) -> None:
        """Kind kinds[j] drafted for request rids[j] with cached[j] tokens of context: it has
        consumed all of it (the replica flushed that kind's share first)."""
        if self.direct:
            return
        for rid, k, n in zip(rids, kinds, cached, strict=True):
            self._seen.setdefault(rid, np.zeros(len(self.hosted), dtype=np.int64))[k] = n

    def lag(self, rids: list[int], cached: list[int]) -> np.ndarray:
        """[R, kinds]: context tokens of each request that each kind has not consumed (what it
        would catch up on before drafting; 0 for a kind the replicas do not draft)."""
        lag = np.zeros((len(rids), len(self.hosted)))
        if not len(rids) or not self.hosted.any():
            return lag
        if self.direct:
            lag[:, self.hosted] = np.array([self.backlog.size(rid) for rid in rids], dtype=np.float64)[:, None]
            return lag
        none = np.zeros(len(self.hosted), dtype=np.int64)
        lag[:] = np.asarray(cached, dtype=np.float64)[:, None] - np.array([self._seen.get(rid, none) for rid in rids])
        lag[:, ~self.hosted] = 0.0
        return lag

    def drop(self, rids: list[int]) -> None:
        """Forget these requests (released, orphaned or refed from their first token)."""
        self.backlog.drop(rids)
        for rid in rids:
            self._seen.pop(rid, None)

    def tokens(self) -> int:
        """Tokens waiting to be sent, in all (for metrics and tests)."""
        return self.backlog.tokens()
