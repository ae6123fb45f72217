"""`DrafterReplica`: one drafter for a shard of the running requests, as a Ray actor."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from actors import heap
from actors.drafter.base import DraftOutput, cat_rows, merge_outputs
from actors.drafter.kinds import BuildArgs
from actors.drafter.kinds import kind as drafter_kind
from actors.drafter.pending import PendingContext
from actors.engine.backlog import CatchUp
from actors.inprocess import resolve
from actors.ray_env import whereabouts
from dcut_core import ragged
from dcut_core.chains import ChainStop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # "block", "mtp", "eagle3" or "ngram", or several: "block,mtp,ngram" (one replica hosts them all)
    target_dir: str
    drafter_dir: str | None  # the weights of a single kind
    block: int
    threads: int = 1
    capacity_tokens: int = 65536
    dirs: tuple[tuple[str, str], ...] = ()  # (kind, weights folder) of each kind that has weights
    pending_tokens: int = 2048  # several kinds: context held per kind and request until it drafts (pending.py)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.kind.split(","))

    def dir_of(self, kind: str) -> str | None:
        return dict(self.dirs).get(kind, self.drafter_dir)


def build_drafter(spec: DrafterSpec, kind: str | None = None):
    """The drafter of `kind` (default: the spec's only kind), built as the kind registry says."""
    kind = kind or spec.kind
    return drafter_kind(kind).build(BuildArgs(spec.target_dir, spec.dir_of(kind), spec.capacity_tokens, spec.block))


LOCAL = "local"  # a catch-up's `sources` when the features are in the hosting rank's own store


class Drafter:
    """Holds the drafters of one or several kinds and the per-request state they need; drafts
    for the requests it is given, each with the kind the coordinator chose for it. With several
    kinds, a request's context reaches a kind when that kind drafts for it (`PendingContext`),
    so any kind can draft for any request and none pays for requests it does not draft for.
    `DrafterReplica` is it as a Ray actor; the in-process engine calls it directly, and under a
    driver rank each rank hosts one (`attach`) that drafts for the requests whose KV it holds."""

    def __init__(self, spec: DrafterSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.drafters = [build_drafter(spec, kind) for kind in spec.kinds]
        self.drafter = self.drafters[0]
        self.pending = PendingContext(self.drafters, spec.pending_tokens) if len(self.drafters) > 1 else None
        self.lost: set[int] = set()  # requests whose context could not be fetched: no drafts
        self._local_features = None  # the hosting rank's `take_features`

    def attach(self, rank) -> None:
        """Live beside a target rank: on its device, and catch-ups with `sources=LOCAL` read its
        feature store there (on a GPU the features never leave it)."""
        self.to(rank.spec.device)
        self._local_features = lambda spans: rank.take_features(spans, host=False)

    def to(self, device: str) -> Drafter:
        """Every hosted kind with weights moves to `device` (before any request's context)."""
        for d in self.drafters:
            if hasattr(d, "to"):
                d.to(device)
        return self

    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs any hosted kind reads (their union)."""
        return tuple(sorted({layer for d in self.drafters for layer in getattr(d, "target_layers", ())}))

    def commit(self, catchup: CatchUp) -> None:
        """Context committed since these requests' last draft (sent when a backlog is full)."""
        self._catch_up(catchup)

    def draft(self, request_ids: list[int], last_tokens: list[int], lengths: list[int],
              catchup: CatchUp | None = None, kinds: list[int] | None = None,
              fallback: list[int] | None = None, stops: dict[int, ChainStop] | None = None) -> DraftOutput:
        """Drafts for these requests, request i's by hosted kind kinds[i] (default: the first), or
        by fallback[i] if that kind made none (an n-gram drafter without a match; -1: no
        fallback); `catchup` is context committed since their last draft (the engine's backlog),
        committed first. Requests whose context could not be fetched get no drafts and are named
        in `lost`. `kinds` of the output: the kind that drafted each request; `kind_s` each
        kind's own drafting time. `stops`: a chained kind's cut this step, by hosted kind
        (`dcut_core.chains`)."""
        t0 = time.perf_counter()
        stops = stops or {}
        if catchup is not None:
            self._catch_up(catchup)
        lost = tuple(rid for rid in request_ids if rid in self.lost)
        if lost:
            lengths = [0 if rid in self.lost else n for rid, n in zip(request_ids, lengths, strict=True)]
        if self.pending is None:  # one kind: the catch-up went straight into it, and is its time too
            out = self._draft_with(0, request_ids, last_tokens, lengths, stops)
            spent = time.perf_counter() - t0
            return dataclasses.replace(out, compute_s=spent, lost=lost, kind_s={0: spent},
                                       kinds=np.zeros(len(request_ids), dtype=np.int64),
                                       kind_context={0: catchup.size if catchup is not None else 0})
        kinds = [0] * len(request_ids) if kinds is None else kinds
        parts, kind_s, context, used = [], {}, {}, np.asarray(kinds, dtype=np.int64).copy()

        def by_kind(k: int, idx: list[int]):
            """(batch indices, drafts) of kind k for requests idx, its held context given to it first."""
            t1 = time.perf_counter()
            context[k] = context.get(k, 0) + self.pending.flush(k, [request_ids[i] for i in idx if lengths[i] > 0])
            out = self._draft_with(k, [request_ids[i] for i in idx], [last_tokens[i] for i in idx],
                                   [lengths[i] for i in idx], stops)
            kind_s[k] = kind_s.get(k, 0.0) + time.perf_counter() - t1
            return idx, out

        for k in sorted(set(kinds)):
            parts.append(by_kind(k, [i for i, kk in enumerate(kinds) if kk == k]))
        if fallback is not None:  # a second pass for the requests whose kind drafted nothing
            drafted = ragged.lengths(merge_outputs(len(request_ids), parts).cu)
            missed = [i for i in range(len(request_ids)) if lengths[i] > 0 and not drafted[i]
                      and 0 <= fallback[i] != kinds[i] and request_ids[i] not in self.lost]
            for k in sorted({fallback[i] for i in missed}):
                idx = [i for i in missed if fallback[i] == k]
                parts.append(by_kind(k, idx))
                used[idx] = k
        out = merge_outputs(len(request_ids), parts)  # a fallback's rows replace the empty ones
        return dataclasses.replace(out, compute_s=time.perf_counter() - t0, lost=lost, kind_s=kind_s, kinds=used,
                                   kind_context=context)

    def _draft_with(self, k: int, rids: list[int], last: list[int], lengths: list[int],
                    stops: dict[int, ChainStop]) -> DraftOutput:
        """Hosted kind k's drafts (its cut, if it has one this step)."""
        stop = stops.get(k)
        if stop is None:
            return self.drafters[k].draft(rids, last, lengths)
        return self.drafters[k].draft(rids, last, lengths, stop=stop)

    def _catch_up(self, c: CatchUp) -> None:
        """Commit a catch-up: per request, the rows sent along, then those fetched from the
        target's ranks (`c.sources`)."""
        fetched: dict[int, dict] = {}
        if c.sources == LOCAL:
            fetched = self._local_features(c.spans) if c.spans else {}
        elif c.sources:
            try:
                for part in resolve(c.sources):
                    fetched.update(part)
            except ray.exceptions.RayError as exc:  # a rank died, or did not hold a span
                log.warning("drafter context of %d requests lost: %s", len(c.spans), str(exc).splitlines()[0])
                self.lost.update(c.spans)
        features = []
        for i, rid in enumerate(c.rids):
            parts = [h for h in (c.features[i] if c.features else None, fetched.get(rid)) if h]  # older rows first
            features.append(parts[0] if len(parts) == 1 else
                            {k: cat_rows([h[k] for h in parts]) for k in parts[0]} if parts else {})
        keep = [i for i, rid in enumerate(c.rids) if rid not in self.lost]
        commit = self.pending.add if self.pending is not None else self.drafter.commit
        commit([c.rids[i] for i in keep], [c.tokens[i] for i in keep], [features[i] for i in keep])

    def release(self, request_ids: list[int]) -> None:
        for d in self.drafters:
            d.release(request_ids)
        if self.pending is not None:
            self.pending.release(request_ids)
        self.lost.difference_update(request_ids)

    def held(self) -> int:
        """Requests this replica keeps any state for: in a kind, held back for one, or lost."""
        pending = self.pending.held_requests() if self.pending is not None else set()
        return len(set().union(*(d.held_requests() for d in self.drafters), pending, self.lost))

    def whereabouts(self) -> dict[str, str | None]:
        """Node and placement group this replica runs in."""
        return whereabouts()


class DrafterProcess(Drafter):
    """A drafter replica in a process of its own (a Ray actor): its heap frozen once its model is
    loaded (actors/heap.py); one hosted by a rank or the engine is frozen with that process."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        heap.freeze()


DrafterReplica = ray.remote(DrafterProcess)
