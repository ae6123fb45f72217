"""`DrafterPool`: an engine's drafter replicas and the per-request state around them.

Where replicas live: with `in_process` (the default) every target rank hosts one, in its own
process, and a request's owner is the rank that holds its KV — its drafter reads the features
from that rank's store, and no features travel (DESIGN.md, "Where the step runs"). Otherwise
(`in_process=False`) `drafters` Ray actors hold them, requests are sharded by id, and features
are fetched from the ranks by reference.

Replicas host every kind but n-gram, which the coordinator drafts itself
(actors/engine/lookahead.py); kinds are indexed as the engine indexes them (`EngineConfig.kinds`)
everywhere outside the replica, which numbers its own (`replica_kinds`): the pool translates.

The pool also keeps what context each request's drafter kinds lack (`ContextLedger`), and what
happens when a drafter cannot draft: a replica actor that dies is replaced and its requests
continue as plain decoding (orphans, still exact); so do requests whose context could not be
fetched from the target's ranks. Both are logged and counted. A hosted replica fails with its
rank: the target is rebuilt, every running request is refed from its first token and any
replica can rebuild its context: orphans draft again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np
import ray

from actors.drafter.base import DraftOutput
from actors.engine.backlog import CatchUp, ContextLedger
from actors.engine.config import EngineConfig
from actors.engine.placement import in_bundle
from actors.engine.replica import LOCAL, Drafter, DrafterReplica
from actors.engine.sequence import Sequence
from actors.inprocess import InProcess, resolve
from actors.target.group import EPGroupError
from dcut_core import ragged
from dcut_core.chains import ChainStop

log = logging.getLogger(__name__)

ORPHAN = -1  # owner of requests that continue without drafts
ONE_WAY = frozenset({"commit", "release"})  # replica calls nobody waits for


def hosted_drafter(cfg: EngineConfig) -> tuple:
    """The guest each target rank builds beside it when drafters are hosted (`in_process`)."""
    return (("drafter", Drafter, (cfg.drafter_spec(),)),) if cfg.in_process and cfg.drafts and cfg.replica_kinds \
        else ()


class DrafterPool:
    """The replicas (none for an `ar`-only engine), request ownership, and the context ledger."""

    def __init__(self, cfg: EngineConfig, target, unit_pg=None) -> None:
        self.cfg = cfg
        self.unit_pg = unit_pg
        self.spec = cfg.drafter_spec()
        self.hosted = cfg.in_process  # one replica in each target rank's process
        self.target = target
        self.kinds = cfg.kinds
        theirs = cfg.replica_kinds
        self.to_replica = np.array([theirs.index(k) if k in theirs else -1 for k in cfg.kinds], dtype=np.int64)
        self.from_replica = np.array([cfg.kinds.index(k) for k in theirs], dtype=np.int64)
        self.replicas = self._hosted() if self.hosted else \
            [self._new_replica(r) for r in range(cfg.drafters)] if cfg.drafts and theirs else []
        self.layers: tuple[int, ...] = resolve(self.replicas[0].target_layers.remote()) if self.replicas else ()
        self.owner: dict[int, int] = {}  # request -> replica index, or ORPHAN
        self.ledger = ContextLedger(self.to_replica >= 0 if self.replicas else np.zeros(len(self.kinds), bool),
                                    cfg.drafter_backlog_tokens, features=bool(self.layers))
        self.lost = {"drafter_replica_lost": 0, "drafter_context_lost": 0}

    def __bool__(self) -> bool:
        return bool(self.replicas)

    def admit(self, rid: int) -> None:
        self.owner[rid] = self.target.rank_of(rid) if self.hosted else rid % max(1, len(self.replicas))

    def rebind(self, target) -> None:
        """The target was rebuilt: hosted replicas are those of its new ranks."""
        self.target = target
        if self.hosted:
            self.replicas = self._hosted()

    def lag(self, rids: np.ndarray, cached: list[int]) -> np.ndarray:
        """[R, kinds]: context tokens of each request (`rids`, the batch's) that each kind has not
        seen (what it would catch up on before drafting; 0 for the kind the coordinator drafts).
        cached[i]: request i's KV length."""
        if not self.replicas:  # every kind is drafted in the coordinator (n-gram alone): no context to send
            return np.zeros((len(rids), len(self.kinds)))
        return self.ledger.lag(rids.tolist(), cached)

    def drafting(self, rid: int) -> bool:
        """Whether request rid has a drafter (not orphaned)."""
        return self.owner.get(rid) != ORPHAN

    @property
    def orphaned(self) -> bool:
        """Whether any request continues without a drafter (a scan of the owners, in C)."""
        return ORPHAN in self.owner.values()

    def draft(self, batch: list[Sequence], plan, stops: dict[int, ChainStop] | None = None,
              ) -> dict[int, tuple[list[int], DraftOutput]]:
        """Every replica drafts for its shard in parallel, catching up first on its backlog
        (features fetched by the replica from `target`'s ranks): request i plan.lengths[i] drafts
        with kind plan.kinds[i], or plan.fallback[i] if that makes none; a chained kind cut as
        `stops` (by engine kind) says. Returns {replica: (batch indices, drafts)} of the replicas
        that answered."""
        calls = {}
        theirs = {int(self.to_replica[k]): rule for k, rule in (stops or {}).items() if self.to_replica[k] >= 0}
        lengths = plan.lengths.tolist()
        # In the replica's numbering: a kind it does not host is none of its business (-1), and
        # cannot stand in as a fallback there.
        kinds = self.to_replica[plan.kinds].tolist()
        fallback = np.where(plan.fallback >= 0, self.to_replica[np.maximum(plan.fallback, 0)], -1).tolist()
        for r in reversed(range(len(self.replicas))):  # replica 0 may be in this process: it runs last
            idx = [i for i, s in enumerate(batch) if lengths[i] > 0 and kinds[i] >= 0 and self.owner[s.rid] == r]
            if idx:
                rids = [batch[i].rid for i in idx]
                catchup = self._sourced(self.ledger.take(rids), self.target)
                calls[r] = (idx, self.replicas[r].draft.remote(rids, [batch[i].last for i in idx],
                                                               [lengths[i] for i in idx], catchup,
                                                               [kinds[i] for i in idx], [fallback[i] for i in idx],
                                                               theirs or None))
        outs = {}
        for r, (idx, ref) in calls.items():
            try:
                outs[r] = (idx, self._engine_kinds(resolve(ref)))
            except ray.exceptions.RayActorError as exc:  # its requests go on without drafts
                self._replace(r, exc)  # (a hosted replica fails with its rank: EPGroupError)
        self._orphan_lost([rid for _, out in outs.values() for rid in out.lost])
        for idx, out in outs.values():  # each kind that drafted a request has consumed all its context
            drew = [j for j, n in enumerate(ragged.lengths(out.cu).tolist()) if n]
            self.ledger.drafted([batch[idx[j]].rid for j in drew], out.kinds[drew].tolist(),
                                [batch[idx[j]].cached for j in drew])
        return outs

    def _engine_kinds(self, out: DraftOutput) -> DraftOutput:
        """A replica's output with its kinds in the engine's numbering."""
        back = self.from_replica
        return dataclasses.replace(out, kinds=back[out.kinds], kind_s={int(back[k]): v for k, v in out.kind_s.items()},
                                   kind_context={int(back[k]): v for k, v in (out.kind_context or {}).items()})

    def commit(self, seqs: list[Sequence], tokens: list[list[int]], held: list[int], features: list[dict | None],
               target) -> None:
        """Queue committed context: tokens, and features that exist up to `held` (on the ranks,
        or in `features` when they came back with the step's result). It travels with the
        request's next draft call, or now if its backlog grew past the limit."""
        if not self.replicas:  # the n-gram kind alone: the coordinator holds all it needs
            return
        over = [s for s, t, end, h in zip(seqs, tokens, held, features, strict=True)
                if self.drafting(s.rid) and self.ledger.queue(s.rid, t, end, h)]
        if not over:
            return
        for r, replica in enumerate(self.replicas):  # ordered before later draft calls: no need to wait
            mine = self._sourced(self.ledger.take([s.rid for s in over if self.owner[s.rid] == r]), target)
            if mine is not None:
                replica.commit.remote(mine)

    def release(self, rids: list[int]) -> None:
        mine = [[rid for rid in rids if self.owner.get(rid) == r] for r in range(len(self.replicas))]
        for rid in rids:
            self.owner.pop(rid, None)
        self.ledger.drop(rids)
        for replica, theirs in zip(self.replicas, mine, strict=True):
            if theirs:
                with contextlib.suppress(EPGroupError):  # a hosted replica of a failed group goes with its rank
                    replica.release.remote(theirs)

    def reset(self, rids: list[int]) -> None:
        """These requests will be refed from their first token (the target was rebuilt): every
        replica forgets them, and each gets an owner again (orphans too)."""
        for replica in self.replicas:
            replica.release.remote(rids)
        self.ledger.drop(rids)
        for rid in rids:
            self.admit(rid)

    def held(self) -> dict[str, int]:
        """Request state kept here and in the replicas (all 0 once every request is released).
        Asks the replicas: call it between steps."""
        replicas = resolve([r.held.remote() for r in self.replicas]) if self.replicas else []
        return {"drafter_owner": len(self.owner), "drafter_ledger": len(self.ledger),
                "drafter_replicas": sum(replicas)}

    def whereabouts(self) -> list[dict]:
        """Where each replica runs. A hosted one is where its rank is (known since the ranks
        started: asking them would race the step loop for the control group)."""
        if self.hosted:
            return [{k: v for k, v in self.target.ranks[r].items() if k not in ("rank", "experts")}
                    for r in range(len(self.replicas))]
        return resolve([r.whereabouts.remote() for r in self.replicas])

    def shutdown(self) -> None:
        if self.hosted:  # they go with their ranks
            return
        for r in self.replicas:
            if not isinstance(r, InProcess):
                ray.kill(r)

    # -- helpers ----------------------------------------------------------------------------------

    def _sourced(self, catchup: CatchUp | None, target) -> CatchUp | None:
        """The catch-up with references to its features on the target's ranks (the replica
        fetches them; they never pass through the coordinator)."""
        if catchup is None or not catchup.spans:
            return catchup
        return dataclasses.replace(catchup, sources=LOCAL if self.hosted else target.features(catchup.spans))

    def _hosted(self) -> list:
        if not self.cfg.drafts or not self.cfg.replica_kinds:
            return []
        return [self.target.part(r, "drafter", one_way=ONE_WAY) for r in range(self.cfg.ep)]

    def _new_replica(self, r: int):
        opts = {"num_cpus": self.cfg.cpus_per_drafter}
        if self.unit_pg is not None:
            opts["scheduling_strategy"] = in_bundle(self.unit_pg, self.cfg.layout().drafter_bundle(r))
        return DrafterReplica.options(**opts).remote(self.spec)

    def _replace(self, r: int, exc: Exception) -> None:
        """A replica died: its requests lose their drafter state and continue as plain decoding
        (still exact); a fresh replica takes new requests."""
        orphans = [rid for rid, owner in self.owner.items() if owner == r]
        log.warning("drafter replica %d died (%s); %d requests continue without drafts", r,
                    type(exc).__name__, len(orphans))
        self.lost["drafter_replica_lost"] += 1
        self._orphan(orphans)
        self.replicas[r] = self._new_replica(r)

    def _orphan_lost(self, rids: list[int]) -> None:
        """Requests whose context could not be fetched continue as plain decoding."""
        if rids:
            log.warning("%d requests lost their drafter context; they continue without drafts", len(rids))
            self.lost["drafter_context_lost"] += 1
            self._orphan(rids)

    def _orphan(self, rids: list[int]) -> None:
        for rid in rids:
            self.owner[rid] = ORPHAN
        self.ledger.drop(rids)
