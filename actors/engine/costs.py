"""What the coordinator knows about step costs: the target's verify cost model (profiled at
start-up, cached on disk by deployment shape, refined online) and the drafter's pass cost
(learned online from measured drafting calls)."""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib

import numpy as np

from actors.target.config import MoEConfig
from actors.target.profile import ProfileGrid, fit_profile, run_profile
from dcut_core.cost_model import CostModel, OnlineCorrection
from dcut_core.drafting import DraftCost
from dcut_core.nnls import nnls

log = logging.getLogger(__name__)

STARTUP_GRID = ProfileGrid(requests=(1, 8, 32), tokens_per_request=(1, 4, 8, 16), contexts=(64,), repeats=1)


def deployment_key(target_dir: str, ep: int, threads: int) -> str:
    """Cache key of a profile: the model's config and weights' size, EP size and threads."""
    path = pathlib.Path(target_dir)
    config = (path / "config.json").read_text()
    sizes = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
    raw = json.dumps([config, sizes, ep, threads])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def startup_cost_model(target, target_dir: str, ep: int, threads: int, cache_dir: str | None) -> CostModel:
    """Load the cached profile of this deployment shape, or profile now (a few seconds) and cache it."""
    cfg = MoEConfig.load(target_dir)
    cache = None
    if cache_dir:
        cache = pathlib.Path(cache_dir) / f"cost_model_{deployment_key(target_dir, ep, threads)}.json"
    if cache is not None and cache.exists():
        return CostModel.from_json(cache.read_text())
    samples = run_profile(target, STARTUP_GRID, cfg.vocab_size)
    model = fit_profile(samples, cfg.shape(pathlib.Path(target_dir).name), ep)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(model.to_json())
    log.info("profiled the target at start-up: %s", {k: round(v, 6) for k, v in model.coef.items() if v})
    return model


class DraftCostLearner:
    """Fits DraftCost (call, per request, per position) to measured drafting passes."""

    def __init__(self, initial: DraftCost, refit_every: int = 16, keep: int = 512) -> None:
        self.cost = initial
        self.refit_every, self.keep = refit_every, keep
        self._x: list[tuple[float, float, float]] = []
        self._y: list[float] = []

    def observe(self, requests: int, positions: int, seconds: float) -> None:
        if positions <= 0:
            return
        self._x.append((1.0, float(requests), float(positions)))
        self._y.append(seconds)
        del self._x[: -self.keep], self._y[: -self.keep]
        if len(self._y) % self.refit_every == 0 and len(set(self._x)) >= 3:
            c = nnls(np.array(self._x) / np.array(self._y)[:, None], np.ones(len(self._y)))
            self.cost = DraftCost(*map(float, c))


def online(model: CostModel) -> OnlineCorrection:
    return OnlineCorrection(model, halflife_steps=50)
