"""`EPGroup`: the expert-parallel target as one unit, seen from the coordinator.

Creates N `TargetWorker` actors in one placement group (PACK on a node, STRICT_SPREAD across
nodes) — its own, or bundles `bundle_offset ..` of the engine unit's group when given one
(actors/engine/placement.py) — forms their torch.distributed group, assigns each request to one rank (data-parallel
attention: that rank owns its KV cache) and fans every step out to all ranks.

`InProcessGroup` is the same handle over one `TargetRank` in the caller's process (EP 1: the
engine's step is then function calls). `DriverGroup` (actors/target/driver.py) is EP N with rank 0
in the caller's process and the other ranks answering it over the unit's control group (no Ray
call per step).

Failure model: the group is one unit. If any rank dies, a step exceeds `step_timeout_s`, or a
rank has not answered a call `group_timeout_s` after another did, the step raises `EPGroupError`
at once (without waiting for the survivors, which would sit in a collective), every actor of the
group is killed, and the group refuses further work. A batch that
a rank rejects before any collective (KV cache full, bad token ids) raises `BatchRejected` and
leaves the group healthy.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.inprocess import InProcess
from actors.target.batch import VerifyBatch
from actors.target.gpu import local_rank_device, release_gpu
from actors.target.moe import StepStats
from actors.target.worker import BatchRejected, TargetRank, TargetWorker, WorkerSpec
from dcut_core import ragged


class EPGroupError(RuntimeError):
    """The EP group failed (a rank died or hung); it must be rebuilt."""


@dataclass(frozen=True)
class EPConfig:
    model_dir: str
    world: int = 1
    placement: str = "PACK"  # or "STRICT_SPREAD": one rank per node
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    threads_per_rank: int = 1
    kv_capacity_tokens: int = 65536  # per rank, on the CPU (a GPU rank sizes its cache from its memory)
    dtype: str = "auto"  # what the ranks compute in (`checkpoint.serving_dtype`)
    cuda_graphs: str = "auto"  # `graphs.StepGraphs`: auto (where a step can be), off, or padded (uncaptured: tests)
    graph_warmup_requests: int = 0  # its usual buckets up to this many requests captured at the first step
    gpu_memory_utilization: float = 0.9
    kv_block_size: int = 16
    step_timeout_s: float = 120.0
    group_timeout_s: float = 30.0
    start_timeout_s: float = 120.0
    placement_group: PlacementGroup | None = None  # the engine unit's group (not owned); None: own one
    bundle_offset: int = 0  # rank r runs in bundle bundle_offset + r of that group
    guests: tuple = ()  # (name, class, args) built in every rank's process (TargetRank)


@dataclass
class TargetOutput:
    """The target's answer to one forward, flat in the batch's request order: request i's rows are
    `rows_cu[i]:rows_cu[i + 1]` of `argmax`, `logits` and `sampled` (`rows(i)`)."""

    argmax: np.ndarray  # [M] the target's greedy token at each row
    rows_cu: np.ndarray  # [R + 1] int64
    logits: np.ndarray | None = None  # [M, V] when asked for
    features: list[dict[int, np.ndarray]] = field(default_factory=list)  # per request: layer -> [n_i, H]
    # (what drafters read; {} where none came back)
    rank_stats: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    sampled: np.ndarray | None = None  # [M] the target's draw at each row of a sampling request (its
    # uniform through its sampling distribution), the argmax at every other row; None: no row samples
    logprobs: list[np.ndarray | None] | None = None  # per request: [m_i, V] log-softmax where it asked

    def rows(self, i: int) -> slice:
        return slice(int(self.rows_cu[i]), int(self.rows_cu[i + 1]))

    @property
    def emitted(self) -> np.ndarray:
        """[M] the token the target emits at each row: its draw where the request samples, its
        argmax elsewhere."""
        return self.argmax if self.sampled is None else self.sampled

    def tokens(self, i: int) -> np.ndarray:
        """Request i's emitted tokens, one per row."""
        return self.emitted[self.rows(i)]

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """`values` (one of this output's row arrays: argmax, logits, sampled) cut per request."""
        return np.split(values, self.rows_cu[1:-1])


class RequestRanks:
    """Which rank holds each request's KV cache. A new request goes to the rank holding the
    fewest (the first such), counted as requests come and go: a count over every held request at
    each placement had cost ~27 µs an arrival at 1,024 held requests, 23 ms for a wave of 1,024."""

    def __init__(self, world: int) -> None:
        self.owner: dict[int, int] = {}  # request -> rank
        self.load = [0] * world  # requests each rank holds

    def __len__(self) -> int:
        return len(self.owner)

    def __contains__(self, rid: int) -> bool:
        return rid in self.owner

    def __getitem__(self, rid: int) -> int:
        return self.owner[rid]

    def rank_of(self, rid: int) -> int:
        """Its rank, placing it first if it has none."""
        r = self.owner.get(rid)
        if r is None:
            load = self.load
            r = load.index(min(load))
            self.owner[rid] = r
            load[r] += 1
        return r

    def place(self, rids: list[int]) -> list[int]:
        """Place those of `rids` that have no rank yet; returns them."""
        owner = self.owner
        new = [rid for rid in rids if rid not in owner]
        for rid in new:
            self.rank_of(rid)
        return new

    def drop(self, rid: int) -> int | None:
        """Forget it; the rank that held it (None: none did)."""
        r = self.owner.pop(rid, None)
        if r is not None:
            self.load[r] -= 1
        return r


class EPGroup:
    """Driver-side handle of one expert-parallel target."""

    def __init__(self, cfg: EPConfig) -> None:
        self.cfg = cfg
        self._broken: str | None = None
        self._owner = RequestRanks(cfg.world)  # request -> rank holding its KV cache
        self._truncate: list[dict[int, int]] = [{} for _ in range(cfg.world)]  # per rank, sent with the next call
        self.workers = self._start(cfg)
        self.ranks = self._setup()

    def _setup(self) -> list[dict]:
        """Form the ranks' process groups and load the model; each rank's whereabouts."""
        master = ray.get(self.workers[0].master_address.remote(), timeout=self.cfg.start_timeout_s) \
            if self.cfg.world > 1 else None  # one rank: no process group
        return self._gather([w.setup.remote(master) for w in self.workers], self.cfg.start_timeout_s)

    def _start(self, cfg: EPConfig) -> list:
        """The ranks: actors in the placement group (its own, or the unit's)."""
        self.pg, self._owns_pg = self._reserve(cfg)
        return [TargetWorker.options(num_cpus=cfg.cpus_per_rank, num_gpus=cfg.gpus_per_rank,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         self.pg, placement_group_bundle_index=cfg.bundle_offset + r)
                                     ).remote(rank_spec(cfg, r), cfg.guests)
                for r in range(cfg.world)]

    @classmethod
    def _reserve(cls, cfg: EPConfig) -> tuple[PlacementGroup, bool]:
        """(placement group, owned?): the unit's group as given, else a new one of our own."""
        if cfg.placement_group is not None:
            return cfg.placement_group, False
        bundles = cls._bundles(cfg)
        pg = placement_group(bundles, strategy=cfg.placement, bundle_label_selector=cls._selectors(cfg))
        try:
            ray.get(pg.ready(), timeout=cfg.start_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            remove_placement_group(pg)
            raise EPGroupError(f"no room for the ranks' bundles {bundles} ({cfg.placement}) within "
                               f"{cfg.start_timeout_s:.0f} s") from exc
        return pg, True

    @staticmethod
    def _bundles(cfg: EPConfig) -> list[dict[str, float]]:
        """An own group's bundles: one per rank."""
        bundle = {"CPU": cfg.cpus_per_rank} | ({"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})
        return [dict(bundle) for _ in range(cfg.world)]

    @staticmethod
    def _selectors(cfg: EPConfig) -> list[dict[str, str]] | None:
        """Node labels each bundle must match (None: any node)."""
        return None

    # -- request placement ----------------------------------------------------------------------

    def rank_of(self, rid: int) -> int:
        """The rank that owns request rid's KV cache; new requests go to the least loaded rank."""
        return self._owner.rank_of(rid)

    # -- one step -------------------------------------------------------------------------------

    def forward(self, request_ids: list[int], chunks: list[list[int]], logits: str | list[list[int]] = "all",
                **per_request) -> TargetOutput:
        """Append chunks[i] to request_ids[i] on its rank; rows at `logits` ("all", "last", or
        per-request positions inside the chunk). The rest (`VerifyBatch.of`): `sampling[i]` =
        (temperature, top_p, uniforms): a request with temperature > 0 gets the target's draw at
        each of its rows (`sampled`), made on its rank with that row's uniform. With
        `keep_features`, the states at `capture_layers` of request i stay on its rank when
        keep_features[i] (fetched later by `EPGroup.features`; its `features` are then empty) and
        come back in `features` otherwise. With `logprobs[i]`, request i's rows also come back as the
        log-softmax of the raw logits (`TargetOutput.logprobs`). `controls[i]` (a
        `sampling.RequestControls`, or None) adjusts request i's rows before the argmax and the
        sampling distribution are taken. `with_logits`: the rows' logits too."""
        return self.run(VerifyBatch.of(request_ids, chunks, logits, **per_request))

    def run(self, batch: VerifyBatch) -> TargetOutput:
        """One step's forward (`forward`'s, as one flat batch): each rank gets its requests'
        share (`VerifyBatch.share`); the answers come back in the batch's request order."""
        t0 = time.perf_counter()
        request_ids = batch.request_ids
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("one chunk per request, each request once")
        new = self._owner.place(request_ids)
        if self.cfg.world == 1:  # one rank: all of it (None), as it is
            per_rank: list[np.ndarray | None] = [None]
        else:
            held = self._owner.owner
            owner = np.fromiter((held[rid] for rid in request_ids), dtype=np.int64, count=len(request_ids))
            per_rank = [np.flatnonzero(owner == r) for r in range(self.cfg.world)]
        batches = [batch.share(idx, truncate) for idx, truncate in zip(per_rank, self._truncate, strict=True)]
        self._truncate = [{} for _ in range(self.cfg.world)]  # applied by every rank first, even on rejection
        try:
            results = self._each("forward", [(b,) for b in batches])
        except BatchRejected:
            for rid in new:  # the rejected batch placed nothing
                self._owner.drop(rid)
            raise
        return self._assemble(batch, per_rank, results, time.perf_counter() - t0)

    @staticmethod
    def _assemble(batch: VerifyBatch, per_rank: list[np.ndarray | None], results: list,
                  started_s: float) -> TargetOutput:
        """The ranks' answers in the batch's order: one rank's as they are; several scattered
        to their requests' rows with one index each. Features and log-probabilities (rare: drafter
        actors, requests that asked) are cut per request."""
        rows_cu = batch.rows_cu
        stats = [r.stats for r in results]
        if per_rank == [None]:
            res = results[0]
            out = TargetOutput(res.argmax, rows_cu, res.logits if batch.with_logits else None, [], stats, started_s,
                               res.sampled)
            members = [np.arange(len(batch), dtype=np.int64)]
        else:
            dest = [ragged.gather(rows_cu, idx)[0] for idx in per_rank]
            members = [np.asarray(idx, dtype=np.int64) for idx in per_rank]
            out = TargetOutput(_scatter(dest, [r.argmax for r in results]), rows_cu,
                               _scatter(dest, [r.logits for r in results]) if batch.with_logits else None,
                               [], stats, started_s)
            if any(r.sampled is not None for r in results):
                out.sampled = _scatter(dest, [r.argmax if r.sampled is None else r.sampled for r in results])
        out.features = _features_of(batch, members, results)
        out.logprobs = _logprobs_of(batch, members, results)
        return out

    def features(self, spans: dict[int, tuple[int, int]]) -> list:
        """References to stored features, request -> (start, end) positions, one per rank
        asked; each resolves to {request: {layer: [end - start, H] float16}}. Does not wait:
        whoever needs the rows (a drafter) gets them, and the ranks drop them."""
        if self._broken:
            raise EPGroupError(f"EP group is down: {self._broken}")
        per_rank: list[dict[int, tuple[int, int]]] = [{} for _ in range(self.cfg.world)]
        for rid, span in spans.items():
            per_rank[self._owner[rid]][rid] = span
        return [w.take_features.remote(p) for w, p in zip(self.workers, per_rank, strict=True) if p]

    # -- cache management -----------------------------------------------------------------------

    def truncate(self, lengths: dict[int, int]) -> None:
        """Roll back rejected drafts: request -> new cached length. Sent with the next forward
        (each rank applies it before that step), saving a round trip per step."""
        for rid, n in lengths.items():
            self._truncate[self._owner[rid]][rid] = n

    def flush(self) -> None:
        """Apply pending roll-backs now (before reading cache state)."""
        pending, self._truncate = self._truncate, [{} for _ in range(self.cfg.world)]
        self._each("truncate", [(p,) if p else None for p in pending])

    def release(self, request_ids: list[int]) -> None:
        per_rank: list[list[int]] = [[] for _ in range(self.cfg.world)]
        for rid in request_ids:
            r = self._owner.drop(rid)
            if r is not None:
                per_rank[r].append(rid)
                self._truncate[r].pop(rid, None)  # nothing to roll back in a freed cache
        self._each("release", [(p,) if p else None for p in per_rank], answer=False)

    def cache_info(self) -> list[dict]:
        self.flush()
        return self._each("cache_info", [()] * self.cfg.world)

    def held(self) -> dict[str, int]:
        """Request state kept here and on the ranks: KV caches and drafter features (all 0 once
        every request is released). Asks the ranks: call it between steps."""
        ranks = self.cache_info()
        return {"target_owner": len(self._owner), "target_truncate": sum(map(len, self._truncate)),
                "rank_requests": sum(c["requests"] for c in ranks),
                "rank_feature_rows": sum(c["feature_rows"] for c in ranks)}

    # -- calls and failure handling -------------------------------------------------------------

    def _each(self, method: str, args: list[tuple | None], answer: bool = True) -> list:
        """Call `method` on every rank whose `args` are not None (all at once) and return their
        results in rank order; `answer=False` need not wait for them."""
        return self._gather([getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)
                             if a is not None], self.cfg.step_timeout_s, self.cfg.group_timeout_s)

    def _gather(self, refs: list, timeout_s: float, straggler_s: float | None = None) -> list:
        """ray.get for a group call: fail fast on the first dead rank, bounded by timeout_s, and
        by `straggler_s` after the first answer (one rank answered a step: it passed every
        collective, so the others did too, or hang: one stopped after the last, before answering)."""
        if self._broken:
            raise EPGroupError(f"EP group is down: {self._broken}")
        deadline = time.monotonic() + timeout_s
        pending, rejected, results = list(refs), [], {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                after = "" if straggler_s is None else f", or {straggler_s:.0f} s after another rank answered"
                self._fail(f"step exceeded {timeout_s:.0f} s{after} (a rank hung)")
            if straggler_s is not None:
                deadline = min(deadline, time.monotonic() + straggler_s)
            try:
                results[ready[0]] = ray.get(ready[0])
            except BatchRejected as exc:
                rejected.append(str(getattr(exc, "cause", exc)))  # the worker's message, not the traceback
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                self._fail(f"rank failed: {type(exc).__name__}: {str(exc).splitlines()[0]}", exc)
        if rejected:
            specific = [m for m in rejected if "another rank" not in m]
            raise BatchRejected((specific or rejected)[0])
        return [results[r] for r in refs]

    def _fail(self, reason: str, cause: BaseException | None = None) -> None:
        self._broken = reason
        self.shutdown()
        raise EPGroupError(f"EP group failed: {reason}") from cause

    @property
    def healthy(self) -> bool:
        return self._broken is None

    @functools.cached_property
    def kv_tokens(self) -> int:
        """KV tokens of the smallest rank's cache (what each rank sized at start; the scheduler
        asks every step, and a group's ranks never change: a rebuild is a new group)."""
        return min(r.get("kv_tokens", self.cfg.kv_capacity_tokens) for r in self.ranks)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self._owns_pg:  # the unit's group outlives this EP group: a rebuild reuses its bundles
            remove_placement_group(self.pg)


class InProcessGroup(EPGroup):
    """EP 1 in the caller's process: the same rank code, called directly. Nothing to reserve, no
    process group, no Ray call per step; a rank's error raises as itself."""

    def __init__(self, cfg: EPConfig) -> None:
        if cfg.world != 1:
            raise ValueError("an in-process target has one rank (EP 1)")
        super().__init__(cfg)

    def _start(self, cfg: EPConfig) -> list:
        self.pg, self._owns_pg = None, False
        device, self._gpu_holder = local_rank_device(cfg.gpus_per_rank, cfg.placement_group, cfg.bundle_offset,
                                                     cfg.start_timeout_s)
        self.local = self._new_rank(rank_spec(cfg, 0, device), cfg.guests)
        return [InProcess(self.local)]

    def _new_rank(self, spec: WorkerSpec, guests: tuple) -> TargetRank:
        return TargetRank(spec, guests)

    def part(self, rank: int, name: str, one_way: frozenset[str] = frozenset()) -> InProcess:
        """A handle on guest `name` of the rank (actor-call syntax, answered at once)."""
        return InProcess(self.local.parts[name])

    def _gather(self, results: list, timeout_s: float, straggler_s: float | None = None) -> list:
        if self._broken:
            raise EPGroupError(f"EP group is down: {self._broken}")
        return results

    def shutdown(self) -> None:
        self.local.close()
        self.workers = []
        release_gpu(self._gpu_holder)
        self._gpu_holder = None


def rank_spec(cfg: EPConfig, rank: int, device: str | None = None) -> WorkerSpec:
    """Rank `rank`'s spec; `device` default: "cuda" with GPUs (a rank actor sees only its own),
    else "cpu"."""
    gpu = bool(cfg.gpus_per_rank)
    return WorkerSpec(cfg.model_dir, rank, cfg.world, threads=cfg.threads_per_rank,
                      kv_capacity_tokens=cfg.kv_capacity_tokens, kv_block_size=cfg.kv_block_size,
                      group_timeout_s=cfg.group_timeout_s, rendezvous_timeout_s=cfg.start_timeout_s,
                      backend="nccl" if gpu else "gloo", device=device or ("cuda" if gpu else "cpu"), dtype=cfg.dtype,
                      gpu_memory_utilization=cfg.gpu_memory_utilization, cuda_graphs=cfg.cuda_graphs,
                      graph_warmup_requests=cfg.graph_warmup_requests)


def _scatter(dest: list[np.ndarray], parts: list[np.ndarray]) -> np.ndarray:
    """One array of every rank's rows, rank r's put at rows dest[r]."""
    out = np.empty((sum(len(d) for d in dest), *parts[0].shape[1:]), dtype=parts[0].dtype)
    for d, part in zip(dest, parts, strict=True):
        out[d] = part
    return out


def _features_of(batch: VerifyBatch, members: list[np.ndarray], results: list) -> list[dict[int, np.ndarray]]:
    """Each request's feature rows that came back ({} for one whose stay on its rank): a rank
    ships every token's rows of each request it does not keep, in its order."""
    out: list[dict[int, np.ndarray]] = [{} for _ in range(len(batch))]
    if not any(res.features for res in results):  # the usual step: nothing shipped
        return out
    lengths = ragged.lengths(batch.cu)
    for idx, res in zip(members, results, strict=True):
        if not res.features:
            continue
        shipped = lengths[idx] if batch.keep_features is None else np.where(batch.keep_features[idx], 0, lengths[idx])
        ends = np.cumsum(shipped).tolist()
        for i, n, end in zip(idx.tolist(), shipped.tolist(), ends, strict=True):
            if n:
                out[i] = {layer: h[end - n:end] for layer, h in res.features.items()}
    return out


def _logprobs_of(batch: VerifyBatch, members: list[np.ndarray], results: list) -> list | None:
    """Each request's log-probability rows (None where it did not ask): a rank returns the rows
    of the requests that asked, in its order."""
    if batch.logprobs is None or not batch.logprobs.any():
        return None
    out: list[np.ndarray | None] = [None] * len(batch)
    counts = batch.row_counts
    for idx, res in zip(members, results, strict=True):
        at = 0
        for i in idx[batch.logprobs[idx]].tolist():
            out[i] = res.logprobs[at:at + counts[i]]
            at += int(counts[i])
    return out

