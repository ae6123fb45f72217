"""What the coordinator measures of step costs at start-up: the target's verify cost model
(profiled, cached on disk by deployment shape and device, then refined online) and each drafter
kind's pass cost (profiled on synthetic requests, then learned online by
`dcut_core.learners.DraftCostLearner`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import platform
import time

import numpy as np

from actors.engine.backlog import CatchUp
from actors.inprocess import resolve
from actors.target.checkpoint import serving_dtype
from actors.target.config import MoEConfig
from actors.target.profile import ProfileGrid, fit_profile, run_profile
from dcut_core.cost_model import CostModel, OnlineCorrection
from dcut_core.learners import DraftCostLearner

log = logging.getLogger(__name__)

# Two contexts, so the KV-read term is told apart from what grows with the request count: with one
# (64), context rose only with requests, the fit put 0.012 ms on every context token read, and at
# 24-32 requests of 150+ tokens each the verify cost came out nearly flat in tokens — plain steps
# predicted 1.25 x what they took, drafting ones 0.99 x: drafting looked cheap at high load
# (docs/benchmarks.md, session 16).
STARTUP_GRID = ProfileGrid(requests=(1, 8, 32), tokens_per_request=(1, 4, 8, 16), contexts=(64, 256), repeats=1)
# A cached profile is checked at start against a few forwards timed now (~0.6 s on the bundled model
# here): one whose level is off by more than `STALE_LEVEL` either way was taken under other conditions
# (other processes on the cores: a profile cached at 4 x the step's time, and with it a shape whose
# marginal token cost, its level corrected, was 10-30 % too low, survived every later start) and is made again.
CHECK_GRID = ProfileGrid(requests=(1, 8), tokens_per_request=(1, 8), contexts=(64,), repeats=3)
STALE_LEVEL = 2.0


def device_identity(gpus_per_rank: float) -> str:
    """What the ranks compute on, as far as it changes a profile: the GPU's name (NVML, GPU 0 of
    the node) when ranks hold GPUs, else the CPU's model name and core count."""
    if gpus_per_rank:
        from actors.accelerator import detect

        return f"cuda:{detect().device_name or 'unknown'}"
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")
    return f"cpu:{model or platform.machine()}:{os.cpu_count()}"


def _cpuinfo() -> list[str]:
    try:
        return pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# Part of every cache key: raised when a change to the ranks' code moves a forward's cost by shape
# (a level alone the start-up check and the online correction absorb; a shape they do not). 2:
# session 28's gathers made batches of 16-64 requests 16-30 % cheaper and one request 7 %. 3: session
# 33's CPU weight layout (actors/target/layout.py), 11-15 % a forward, unevenly by product shape. 4: the
# profile's fit gained the `batching` term (dcut_core/cost_model.py), which a profile cached before lacks.
FORWARD_REVISION = 4


def deployment_key(cfg) -> str:
    """Cache key of a profile (and of the learned state beside it): the model's config and
    weights' size, the device and dtype the ranks compute in, EP size, threads, whether the rank
    runs in the caller's process (a Ray call per step is part of what is measured), CUDA
    graphs where not left to `auto`, and `FORWARD_REVISION`. A CPU
    profile is never reused on a GPU, nor one GPU's on another."""
    path = pathlib.Path(cfg.target_dir)
    config = (path / "config.json").read_text()
    sizes = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
    device = [device_identity(cfg.gpus_per_rank),
              str(serving_dtype(cfg.dtype, "cuda" if cfg.gpus_per_rank else "cpu", cfg.target_dir))]
    shape = [cfg.ep, cfg.threads_per_rank] + (["in-process"] if cfg.in_process else [])
    shape += [f"graphs-{cfg.cuda_graphs}"] if cfg.cuda_graphs != "auto" else []  # a step's cost differs ×3–5
    raw = json.dumps([config, sizes, *device, *shape, FORWARD_REVISION])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def startup_cost_model(target, cfg, check: bool = True) -> CostModel:
    """Load the cached profile of this deployment (`cfg`: EngineConfig) — checked against
    forwards timed now (`check`) — or profile now (a few seconds) and cache it."""
    model_cfg = MoEConfig.load(cfg.target_dir)
    cache = None
    if cfg.cost_model_cache:
        cache = pathlib.Path(cfg.cost_model_cache) / f"cost_model_{deployment_key(cfg)}.json"
    if cache is not None and cache.exists():
        cached = CostModel.from_json(cache.read_text())
        level = measured_level(cached, target, model_cfg.vocab_size) if check else 1.0
        if 1 / STALE_LEVEL <= level <= STALE_LEVEL:
            return cached
        log.warning("the cached start-up profile %s predicts %.2f x the forwards timed now: profiling again",
                    cache, 1 / level)
    samples = run_profile(target, STARTUP_GRID, model_cfg.vocab_size)
    model = fit_profile(samples, model_cfg.shape(pathlib.Path(cfg.target_dir).name), cfg.ep)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(model.to_json())
    log.info("profiled the target at start-up: %s", {k: round(v, 6) for k, v in model.coef.items() if v})
    return model


def measured_level(model: CostModel, target, vocab_size: int) -> float:
    """Median of measured / predicted seconds over `CHECK_GRID`'s forwards, timed now."""
    samples = run_profile(target, CHECK_GRID, vocab_size, seed=1)
    return float(np.median([s.seconds / max(model.predict(s.shape), 1e-12) for s in samples]))


# What the gate assumes of the drafter before any measurement (seconds: call, request, position,
# context token caught up); the start-up profile replaces it.
PROFILE_CONTEXT = 48  # context tokens of each synthetic request the start-up profile drafts for


def profile_drafter(replica, model, layers: tuple[int, ...], max_requests: int, block: int,
                    kind: int = 0) -> list[tuple[int, int, int, int, float, float]]:
    """Time drafting calls on synthetic requests at start-up: (requests, positions, context tokens
    caught up, drafts per request, seconds at the coordinator, seconds of the kind's own) per
    call. Each shape runs twice: first with its requests' context sent along (catch-up), then
    without. `model`: the target's `MoEConfig` (features as wide as its hidden size, tokens from
    its vocabulary); `kind`: the hosted kind that drafts."""
    rng, context = np.random.default_rng(0), PROFILE_CONTEXT
    hidden_size, vocab_size = model.hidden_size, model.vocab_size
    shapes = sorted({1, min(16, max_requests), max_requests})
    samples = []
    for r in shapes:
        for n in sorted({1, block - 1}):
            rids = [-(1 + i) for i in range(r)]  # never a real request id
            history = [rng.integers(0, vocab_size, context).tolist() for _ in rids]
            last = [h[-1] for h in history]  # a request's newest token ends its history
            catchup = CatchUp(rids, history, [{k: rng.standard_normal((context, hidden_size)).astype(np.float16)
                                               for k in layers} for _ in rids])
            for sent in (catchup, None):
                t0 = time.perf_counter()
                out = resolve(replica.draft.remote(rids, last, [n] * r, sent, [kind] * r))
                wall = time.perf_counter() - t0
                own = out.kind_s[kind]
                samples.append((r, n * r, context * r if sent else 0, n, wall, own))
            resolve(replica.release.remote(rids))
    return samples


def startup_draft_cost(pool, model, max_requests: int, block: int, learner: DraftCostLearner) -> DraftCostLearner:
    """`learner` (one fit per engine kind) seeded by profiling the first replica of `pool` (a
    `DrafterPool`), about a second for each kind it hosts, so the drafting gate starts from
    measured costs instead of a guess. `model`: the target's `MoEConfig`."""
    replica, layers, hidden = pool.replicas[0], pool.layers, model.hidden_size
    for kind, engine_kind in enumerate(pool.from_replica.tolist()):
        warm = CatchUp([-1], [[0] * 8], [{k: np.zeros((8, hidden), np.float16) for k in layers}])
        resolve(replica.draft.remote([-1], [0], [1], warm, [kind]))  # lazy set-up
        resolve(replica.release.remote([-1]))
        for r, p, c, n, wall, own in profile_drafter(replica, model, layers, max_requests, block, kind=kind):
            learner.observe_kind(engine_kind, r, p, own, c, n)
            learner.observe_call(wall - own)
    learner.refit()
    log.info("profiled the drafter at start-up: %s", learner.costs)
    return learner


def online(model: CostModel) -> OnlineCorrection:
    return OnlineCorrection(model, halflife_steps=50)
