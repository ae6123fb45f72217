"""`TargetRank`: one expert-parallel rank of the target; `TargetWorker` is it as a Ray actor (the
in-process engine calls a `TargetRank` directly).

Each rank holds the dense weights, E/N experts, and the KV caches of the requests assigned to
it (attention is data-parallel). Every forward is a collective: all ranks call it for the same
step, each with its own requests (possibly none).

A rank can host guests: objects living in its process beside it (the engine puts a drafter
replica there, next to the features it drafts from). Under a driver rank (`group.DriverGroup`)
the ranks other than 0 run `serve`: a loop that takes the driver's messages (a part, a method,
its arguments) from the unit's control group and answers them; no Ray call per step.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from actors import heap
from actors.ray_env import whereabouts
from actors.target import wire
from actors.target.checkpoint import load_model, serving_dtype
from actors.target.features import FeatureStore
from actors.target.gpu import memory_in_use
from actors.target.graphs import StepGraphs
from actors.target.host import download, upload
from actors.target.kv_cache import KVCacheFull, tokens_for_memory
from actors.target.link import RankLink
from actors.target.model import ForwardBatch, Prepared
from actors.target.moe import StepStats
from actors.target.parallel import all_agree, apply_expert_parallel, expert_range, join_groups
from actors.target.sampling import apply_controls, draw, target_probs

log = logging.getLogger(__name__)
MIN_KV_TOKENS = 4096  # below this a GPU rank refuses to start: a few long requests would not fit


class BatchRejected(ValueError):
    """A rank refused a forward batch before any collective ran; every rank refused it too."""


@dataclass(frozen=True)
class WorkerSpec:
    model_dir: str
    rank: int
    world: int
    threads: int = 1
    kv_capacity_tokens: int = 65536
    kv_block_size: int = 16
    group_timeout_s: float = 30.0
    rendezvous_timeout_s: float = 120.0  # the group's forming: every rank started and joined
    backend: str = "gloo"
    device: str = "cpu"
    dtype: str = "auto"  # `checkpoint.serving_dtype`: the checkpoint's on an accelerator, float32 on the CPU
    gpu_memory_utilization: float = 0.9  # on a GPU the KV cache takes what this share leaves beside the weights
    activation_reserve_bytes: int = 2 << 30  # and beside this much kept for a step's activations
    cuda_graphs: str = "auto"  # decode and verify steps replayed as CUDA graphs where they can be (graphs.py)
    graph_warmup_requests: int = 0  # and the usual buckets up to this many requests captured at the first step


@dataclass(frozen=True)
class RankBatch:
    """One rank's share of a step: ragged tokens of its own requests."""

    request_ids: list[int]
    tokens: np.ndarray  # [N] int64
    cu: np.ndarray  # [R + 1] int64
    logit_index: np.ndarray  # [M] flat indices into tokens
    with_logits: bool = False
    capture_layers: tuple[int, ...] = ()
    temperature: np.ndarray | None = None  # [M] per logit row; rows > 0 get sampling probabilities
    top_p: np.ndarray | None = None  # [M]
    truncate: dict[int, int] | None = None  # roll-backs of the last step (request -> length), applied first
    keep_features: np.ndarray | None = None  # [R] bool: captured rows stay in the rank's FeatureStore (the
    # other requests' rows come back in the result)
    logprob_rows: np.ndarray | None = None  # [M] bool: these logit rows come back as log-softmax rows
    controls: tuple | None = None  # [R] RequestControls or None: sampling controls applied to its rows
    uniform: np.ndarray | None = None  # [M] float64: the sampling rows' uniforms (the request's seeded stream)


@dataclass(frozen=True)
class RankResult:
    argmax: np.ndarray  # [M] the target's greedy token at each asked-for row
    logits: np.ndarray | None  # [M, V] float32 when asked for
    features: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [N', H] float16 (drafters read them)
    # of every token, or with keep_features of the requests not kept only, in their order
    stats: StepStats = field(default_factory=StepStats)
    sampled: np.ndarray | None = None  # [M] int64 the target's draw at each sampling row (its uniform
    # through the sampling distribution: `sampling.draw`), the argmax elsewhere; None when no row samples
    logprobs: np.ndarray | None = None  # [M', V] float32 log-softmax of the raw logits at the flagged rows


class TargetRank:
    """One EP rank: its expert slice, the shared dense weights, and its requests' KV caches."""

    def __init__(self, spec: WorkerSpec, guests: tuple = ()) -> None:
        """`guests`: (name, class, args) of objects to build in this process beside the rank; one
        with an `attach(rank)` method is handed the rank (a drafter reads its features)."""
        torch.set_num_threads(spec.threads)  # ranks share the machine's cores: set it, never guess
        if torch.device(spec.device).index is not None:  # rank 0 in its driver's process: its own GPU
            torch.cuda.set_device(torch.device(spec.device))
        self.spec = spec
        self.model = None
        self.cache = None
        self.graphs: StepGraphs | None = None
        self.features = FeatureStore()
        self._feature_layers: tuple[int, ...] = ()  # the layers side by side in stored rows
        self.data = self.link = None  # the unit's data and control groups (world > 1)
        self.parts: dict[str, object] = {"target": self}
        for name, cls, args in guests:
            self.parts[name] = cls(*args)
            if hasattr(self.parts[name], "attach"):
                self.parts[name].attach(self)
        torch.set_num_threads(spec.threads)  # a guest may have set its own

    def master_address(self) -> tuple[str, int]:
        """Address for the process group's rendezvous (called on rank 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def setup(self, master: tuple[str, int]) -> dict:
        """Join the process group and load this rank's slice of the model."""
        s = self.spec
        if s.world > 1:
            self._store, self.data, control = join_groups(master, s.rank, s.world, s.backend, s.group_timeout_s,
                                                                s.rendezvous_timeout_s)
            self.link = RankLink(control, s.rank)
        first, count = expert_range(_num_experts(s.model_dir), s.rank, s.world)
        dtype = serving_dtype(s.dtype, s.device, s.model_dir)
        self.model = load_rank_model(s.model_dir, first, count, dtype, s.device)
        if s.world > 1:
            apply_expert_parallel(self.model, s.rank, s.world, self.data)
        self.cache = self.model.new_cache(self._kv_tokens(), s.kv_block_size)
        device = str(self.model.lm_head.weight.device)
        if StepGraphs.wanted(s.cuda_graphs, self.model, s.world, device):
            self.graphs = StepGraphs(self.model, self.cache, s.cuda_graphs, warm_requests=s.graph_warmup_requests)
        return {"rank": s.rank, "experts": (first, count), "dtype": str(dtype).removeprefix("torch."),
                "kv_tokens": self.cache.num_blocks * s.kv_block_size,
                "cuda_graphs": self.graphs.mode if self.graphs is not None else "off"} | whereabouts()

    def _kv_tokens(self) -> int:
        """The KV cache's size in tokens: as configured on the CPU; on a GPU, what fits in
        `gpu_memory_utilization` of its memory beside the loaded weights and the activation
        reserve — refused at start when that is not even a few requests' worth."""
        s = self.spec
        if s.device == "cpu":
            return s.kv_capacity_tokens
        used, total = memory_in_use(torch.device(s.device))
        spec = self.model.cache_spec(s.kv_block_size, s.kv_block_size)
        per_token = spec.bytes_per_token * self.model.lm_head.weight.element_size()
        tokens = tokens_for_memory(total, used, s.gpu_memory_utilization, per_token, s.kv_block_size,
                                   s.activation_reserve_bytes)
        if tokens < MIN_KV_TOKENS:
            raise RuntimeError(
                f"rank {s.rank}: room for only {tokens} KV tokens ({used / 2**30:.1f} of "
                f"{total / 2**30:.1f} GiB in use after loading the weights, utilization {s.gpu_memory_utilization}); "
                "raise gpu_memory_utilization, or serve at a larger EP or in a smaller dtype")
        return tokens

    def forward(self, rb: RankBatch) -> RankResult:
        """Run this rank's part of one step (a collective when world > 1)."""
        if torch.get_num_threads() != self.spec.threads:  # a rank in a shared process (the driver's)
            torch.set_num_threads(self.spec.threads)  # must not oversubscribe the cores its peers use
        if rb.truncate:  # committed decisions of the previous step: applied whatever this batch does
            self.cache.truncate_all(rb.truncate)
        dev = self.spec.device

        def put(a: np.ndarray) -> torch.Tensor:  # a host array on the device, queued (actors/target/host.py)
            return upload(torch.from_numpy(a), dev)

        batch = ForwardBatch(rb.request_ids, put(rb.tokens), torch.from_numpy(rb.cu), put(rb.logit_index))
        prepared, error = None, None
        if batch.request_ids:
            try:
                prepared = self.model.prepare(batch, self.cache, rb.tokens)
            except (ValueError, KVCacheFull) as exc:
                error = exc
        if not self._all_agree(error is None):
            if prepared is not None:
                self.model.undo(prepared, self.cache)
            raise BatchRejected(f"rank {self.spec.rank}: {error}" if error else "rejected by another rank")
        stats = StepStats()
        if prepared is None:  # no requests here, but the MoE collectives still need this rank
            prepared = Prepared(batch, [], [], [])
        graphed = (self.graphs.forward(prepared, stats, rb.capture_layers)
                   if self.graphs is not None and prepared.lengths else None)
        logits, captured = graphed or self.model.forward(prepared, self.cache, stats, rb.capture_layers)
        logits = logits.float()  # argmax, controls, sampling and log-probabilities: float32 in any dtype
        # Rows are picked by integer indices made on the host: an index by a boolean mask on a GPU
        # reads the mask back to the host first.
        if rb.keep_features is not None and captured and rb.keep_features.any():
            self._keep(prepared, captured, rb.keep_features)
            shipped = np.flatnonzero(np.repeat(~rb.keep_features, np.diff(rb.cu)))  # rows of the requests not kept
            captured = {k: v[put(shipped)] for k, v in captured.items()} if len(shipped) else {}
        logprobs = None  # of the raw logits, before any control
        if rb.logprob_rows is not None and rb.logprob_rows.any():
            logprobs = torch.log_softmax(logits[put(np.flatnonzero(rb.logprob_rows))], dim=-1)
        top_k = min_p = None
        if rb.controls is not None:
            logits, top_k, min_p = self._controlled(logits, rb)
        argmax = logits.argmax(-1)
        sampled = None
        if rb.temperature is not None and len(rb.temperature) and float(rb.temperature.max()) > 0:
            # Drawn here, on the device: what comes back is a token a row, not rows × vocabulary.
            rows = put(np.flatnonzero(rb.temperature > 0))
            temp = put(rb.temperature).float().clamp_min(1e-6)
            probs = target_probs(logits[rows], temp[rows], put(rb.top_p).float()[rows],
                                 None if top_k is None else upload(top_k, dev)[rows],
                                 None if min_p is None else upload(min_p, dev)[rows])
            sampled = argmax.clone()
            sampled[rows] = draw(probs, put(rb.uniform)[rows])
        # float16 features: the drafter was trained on features of that precision, and half the
        # bytes keep a decode step's result under Ray's inline size at concurrency 64.
        names = list(captured)
        host = download(argmax, logits if rb.with_logits else None, sampled, logprobs, stats.unread_counts(),
                        *(captured[k].half() for k in names))
        stats.settle(host[4])
        return RankResult(host[0], host[1], dict(zip(names, host[5:], strict=True)), stats, host[2], host[3])

    @staticmethod
    def _controlled(logits: torch.Tensor, rb: RankBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each controlled request's rows with its sampling controls applied (actors/target/
        sampling.py), and per-row top-k and min-p for the sampling distribution."""
        logits = logits.clone()
        top_k = torch.zeros(len(rb.logit_index), dtype=torch.long)
        min_p = torch.zeros(len(rb.logit_index))
        owner = np.searchsorted(rb.cu, rb.logit_index, side="right") - 1  # request of each logit row
        for j, rc in enumerate(rb.controls):
            if rc is None:
                continue
            mine = np.nonzero(owner == j)[0]
            if not len(mine):
                continue
            sl = slice(int(mine[0]), int(mine[-1]) + 1)  # a request's rows are contiguous
            if rc.controls.changes_logits or rc.allowed is not None:
                chunk = rb.tokens[rb.cu[j]:rb.cu[j + 1]]
                logits[sl] = apply_controls(logits[sl], chunk, rb.logit_index[sl] - rb.cu[j], rc).to(logits.dtype)
            top_k[sl], min_p[sl] = rc.controls.top_k, rc.controls.min_p
        return logits, top_k, min_p

    def _keep(self, prepared: Prepared, captured: dict[int, torch.Tensor], keep: np.ndarray) -> None:
        """Store each kept request's rows at its KV positions: one float16 block of every
        captured layer side by side per step, shared by its requests."""
        self._feature_layers = tuple(captured)
        block = torch.cat(list(captured.values()), dim=-1).half()
        cu = prepared.batch.cu.tolist()
        for j, (rid, start) in enumerate(zip(prepared.batch.request_ids, prepared.starts, strict=True)):
            if keep[j]:
                self.features.write(rid, start, block, cu[j], cu[j + 1] - cu[j])

    def take_features(self, spans: dict[int, tuple[int, int]], host: bool = True) -> dict[int, dict]:
        """Hand over (and drop) stored features: request -> (start, end) positions; each request
        gets {layer: [end - start, H] float16} — host arrays, or with `host` False tensors on this
        rank's device (for the drafter it hosts). A drafter resolves this call's result itself;
        the coordinator only passes the reference on."""
        out = {}
        for rid, rows in self.features.take(spans, host).items():
            parts = (np.split(rows, len(self._feature_layers), axis=1) if isinstance(rows, np.ndarray) else
                     rows.chunk(len(self._feature_layers), dim=1)) if rows is not None else ()
            out[rid] = dict(zip(self._feature_layers, parts, strict=False))
        return out

    def _all_agree(self, ok: bool) -> bool:
        return ok if self.spec.world == 1 else all_agree(self.data, ok, self.spec.device)

    def serve(self) -> None:
        """Ranks 1 .. N-1 under a driver rank: answer the driver's calls, one at a time, in order,
        until the group fails. A call is a typed message (`wire.read_call`: a part, one of its
        allowed methods, arguments); the answer is (True, value) or (False, the exception) — a
        failure of one call is the driver's to judge, the loop goes on. A message that is not a
        call this link knows is logged and dropped: nothing it holds is run."""
        while True:
            try:
                part, method, args, answer = wire.read_call(self.link.recv(0))
            except wire.WireError as exc:
                log.error("rank %d: dropped a message from the driver: %s", self.spec.rank, exc)
                continue
            try:
                value, ok = getattr(self.parts[part], method)(*args), True
            except Exception as exc:
                value, ok = exc, False
            if answer:
                try:
                    self.link.send(0, wire.reply(ok, value))
                except TypeError as exc:  # a value the link cannot carry: the driver hears why
                    self.link.send(0, wire.reply(False, RuntimeError(f"{part}.{method}: {exc}")))
            elif not ok:
                log.error("rank %d: %s.%s failed: %r", self.spec.rank, part, method, value)

    def ping(self) -> int:
        """Liveness while `serve` runs (a threaded actor answers it beside the loop)."""
        return self.spec.rank

    def truncate(self, lengths: dict[int, int]) -> None:
        """Roll back rejected tokens: request -> new length."""
        self.cache.truncate_all(lengths)

    def release(self, request_ids: list[int]) -> None:
        self.cache.release_all(request_ids)
        self.features.release(request_ids)

    def close(self) -> None:
        """Let go of the model, the KV cache, the stored features and the guests (a rank in the
        driver's process, before its replacement loads: never two ranks' memory at once), and hand
        the GPU memory back to the device (other processes see it free; this one counts it free
        either way: `memory_in_use`)."""
        self.model = self.cache = self.graphs = self.data = self.link = None
        self.features = FeatureStore()
        self.parts = {"target": self}
        if self.spec.device != "cpu":
            heap.collect_everything()  # a cycle through a guest may still hold the cache's tensors
            torch.cuda.empty_cache()

    def cache_info(self) -> dict:
        return {"free_tokens": self.cache.free_tokens, "requests": len(self.cache.requests),
                "lengths": {rid: self.cache.length(rid) for rid in self.cache.requests},
                "feature_rows": self.features.rows}


class TargetRankProcess(TargetRank):
    """A rank in a process of its own (a Ray actor): its heap frozen once the model is loaded
    (actors/heap.py); a rank in the engine's process is frozen with it."""

    def setup(self, master: tuple[str, int]) -> dict:
        out = super().setup(master)
        heap.freeze()
        return out


TargetWorker = ray.remote(TargetRankProcess)


def _num_experts(model_dir: str) -> int:
    from actors.target.config import MoEConfig

    return MoEConfig.load(model_dir).num_experts


def load_rank_model(model_dir: str, first: int, count: int, dtype: torch.dtype, device: str, **fp8):
    """A rank's slice of the model (experts first .. first + count), loaded on the host in
    `dtype`, its FP8-stored layers swapped for FP8 ones there when `device` multiplies FP8
    (`fp8.keep_fp8`, which checks one layer on the device first), then moved: the device receives
    the weights it serves, never their dequantized copies beside them. `fp8`: keep_fp8's
    options (tests)."""
    model = load_model(model_dir, first, count, dtype=dtype)
    if device != "cpu" or fp8:
        from actors.target.fp8 import keep_fp8

        keep_fp8(model, model_dir, first, count, device=device, **fp8)
    if device == "cpu":  # linear products posed for the CPU (actors/target/layout.py)
        from actors.target.layout import for_cpu

        for_cpu(model)
    return model.to(device)
