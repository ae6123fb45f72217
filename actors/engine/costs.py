"""What the coordinator knows about step costs: the target's verify cost model (profiled at
start-up, cached on disk by deployment shape, refined online) and the drafter's pass cost
(learned online from measured drafting calls)."""

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
from actors.target.checkpoint import COMPUTE_DTYPE
from actors.target.config import MoEConfig
from actors.target.profile import ProfileGrid, fit_profile, run_profile
from dcut_core.cost_model import CostModel, OnlineCorrection
from dcut_core.drafting import DraftCost
from dcut_core.nnls import nnls

log = logging.getLogger(__name__)

STARTUP_GRID = ProfileGrid(requests=(1, 8, 32), tokens_per_request=(1, 4, 8, 16), contexts=(64,), repeats=1)


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


def deployment_key(cfg) -> str:
    """Cache key of a profile (and of the learned state beside it): the model's config and
    weights' size, the device and dtype the ranks compute in, EP size, threads, and whether the
    rank runs in the caller's process (a Ray call per step is part of what is measured). A CPU
    profile is never reused on a GPU, nor one GPU's on another."""
    path = pathlib.Path(cfg.target_dir)
    config = (path / "config.json").read_text()
    sizes = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
    device = [device_identity(cfg.gpus_per_rank), str(COMPUTE_DTYPE)]
    shape = [cfg.ep, cfg.threads_per_rank] + (["in-process"] if cfg.in_process else [])
    raw = json.dumps([config, sizes, *device, *shape])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def startup_cost_model(target, cfg) -> CostModel:
    """Load the cached profile of this deployment (`cfg`: EngineConfig), or profile now (a few
    seconds) and cache it."""
    model_cfg = MoEConfig.load(cfg.target_dir)
    cache = None
    if cfg.cost_model_cache:
        cache = pathlib.Path(cfg.cost_model_cache) / f"cost_model_{deployment_key(cfg)}.json"
    if cache is not None and cache.exists():
        return CostModel.from_json(cache.read_text())
    samples = run_profile(target, STARTUP_GRID, model_cfg.vocab_size)
    model = fit_profile(samples, model_cfg.shape(pathlib.Path(cfg.target_dir).name), cfg.ep)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(model.to_json())
    log.info("profiled the target at start-up: %s", {k: round(v, 6) for k, v in model.coef.items() if v})
    return model


# What the gate assumes of the drafter before any measurement (seconds: call, request, position,
# context token caught up); the start-up profile replaces it.
PRIOR_DRAFT_COST = DraftCost(1e-3, 2e-4, 5e-5, 1e-5)


class RateFit:
    """One drafter kind's cost fitted to its measured drafting time: per call, per request, per
    position, per context token caught up, per chained pass."""

    def __init__(self, initial: DraftCost, refit_every: int = 16, keep: int = 512) -> None:
        self.cost = initial
        self.refit_every, self.keep = refit_every, keep
        self._x: list[tuple[float, ...]] = []
        self._y: list[float] = []

    def observe(self, requests: int, positions: int, seconds: float, catchup: int = 0, passes: int = 0) -> None:
        """One pass: `requests` drafted `positions` in all, the longest `passes` drafts (a chained
        drafter's sequential passes), after catching up on `catchup` context tokens."""
        if positions <= 0:
            return
        self._x.append((1.0, float(requests), float(positions), float(catchup), float(passes)))
        self._y.append(seconds)
        del self._x[: -self.keep], self._y[: -self.keep]
        if len(self._y) % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        if len(set(self._x)) < 4:  # too few distinct shapes to tell the rates apart
            return
        # Relative errors (rows scaled by 1 / measured): small calls count as much as large ones.
        c = nnls(np.array(self._x) / np.array(self._y)[:, None], np.ones(len(self._y))).astype(float)
        self.cost = DraftCost(*c)


class DraftCostLearner:
    """The drafting cost of the kinds a replica hosts (one kind is K = 1): each kind's rates
    fitted to its own time inside the replica (`DraftOutput.kind_s`: its catch-up on context and
    its pass), and what a call costs beyond them a `shared` running mean. One joint fit of every
    kind's rates to whole calls was tried first: online, calls mixing kinds left the split
    ambiguous, and the choices it drove got steadily worse (docs/benchmarks.md)."""

    def __init__(self, kinds: int, initial: DraftCost = PRIOR_DRAFT_COST) -> None:
        self.fits = [RateFit(initial) for _ in range(kinds)]
        self.shared = 0.0
        self._calls = 0

    @property
    def costs(self) -> list[DraftCost]:
        return [fit.cost for fit in self.fits]

    def observe_kind(self, kind: int, requests: int, positions: int, seconds: float, context: int = 0,
                     passes: int = 0) -> None:
        self.fits[kind].observe(requests, positions, seconds, context, passes)

    def observe_call(self, seconds: float) -> None:
        """A call's time beyond its kinds' own (messages, catch-up bookkeeping)."""
        self._calls += 1
        self.shared += max(1.0 / self._calls, 0.02) * (max(0.0, seconds) - self.shared)

    def restore(self, costs: list[DraftCost | None], shared: float) -> None:
        """Start from learnt costs (a kind's None: keep its own); `shared` counts as a mean of
        many calls."""
        for fit, cost in zip(self.fits, costs, strict=True):
            if cost is not None:
                fit.cost = cost
        self.shared, self._calls = shared, max(self._calls, 50)

    def refit(self) -> None:
        for fit in self.fits:
            fit.refit()


def profile_drafter(replica, hidden_size: int, layers: tuple[int, ...], vocab_size: int, max_requests: int,
                    block: int, context: int = 48, seed: int = 0,
                    kind: int = 0) -> list[tuple[int, int, int, int, float, float]]:
    """Time drafting calls on synthetic requests at start-up: (requests, positions, context tokens
    caught up, drafts per request, seconds at the coordinator, seconds of the kind's own) per
    call. Each shape runs twice: first with its requests' context sent along (catch-up), then
    without. `kind`: the hosted kind that drafts."""
    rng = np.random.default_rng(seed)
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


def startup_draft_cost(replicas, hidden_size: int, layers: tuple[int, ...], vocab_size: int, max_requests: int,
                       block: int, kinds: int = 1) -> DraftCostLearner:
    """A drafting-cost learner seeded by profiling the first replica (about a second a kind), so
    the drafting gate starts from measured costs instead of a guess."""
    learner = DraftCostLearner(kinds)
    for kind in range(kinds):
        warm = CatchUp([-1], [[0] * 8], [{k: np.zeros((8, hidden_size), np.float16) for k in layers}])
        resolve(replicas[0].draft.remote([-1], [0], [1], warm, [kind]))  # lazy set-up
        resolve(replicas[0].release.remote([-1]))
        for r, p, c, n, wall, own in profile_drafter(replicas[0], hidden_size, layers, vocab_size, max_requests,
                                                     block, kind=kind):
            learner.observe_kind(kind, r, p, own, c, n)
            learner.observe_call(wall - own)
    learner.refit()
    log.info("profiled the drafter at start-up: %s", learner.costs)
    return learner


class StepOverhead:
    """Time a step spends outside the target's forward and the drafting stage, for drafting steps
    and plain ones apart (running means, then a half-life). What drafting adds to it — pruning,
    calibration, the tracker, the drafters' context bookkeeping — is a cost of drafting as real as
    the drafter's pass, and the gate charges it (`extra`) per drafting step."""

    def __init__(self, halflife_steps: float = 50.0) -> None:
        self.decay = 0.5 ** (1.0 / halflife_steps)
        self.mean: dict[bool, float] = {}
        self.count: dict[bool, int] = {True: 0, False: 0}

    def observe(self, drafting: bool, seconds: float) -> None:
        self.count[drafting] += 1
        alpha = max(1.0 - self.decay, 1.0 / self.count[drafting])
        self.mean[drafting] = self.mean.get(drafting, seconds) + alpha * (seconds - self.mean.get(drafting, seconds))

    @property
    def extra(self) -> float:
        """Seconds a drafting step spends outside the passes beyond a plain one (0 until both seen)."""
        if True not in self.mean or False not in self.mean:
            return 0.0
        return max(0.0, self.mean[True] - self.mean[False])


def online(model: CostModel) -> OnlineCorrection:
    return OnlineCorrection(model, halflife_steps=50)
