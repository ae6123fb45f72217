"""An engine that starts warm: its learned state (`dcut_core.learned.LearnedState`) is saved beside
the cost-model cache — at shutdown and every `SAVE_EVERY` steps — and reloaded when an engine of
the same deployment, kinds and block starts; a fresh deployment starts from the bundle's prior
(`prior.json` beside the target, made from traces of training prompts by `dcut trace --prior`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib

from actors.engine.costs import deployment_key
from dcut_core.learned import KindState, LearnedState

log = logging.getLogger(__name__)

SAVE_EVERY = 1024  # steps between saves while serving
PRIOR = "prior.json"  # a bundle's prior, beside its target/ folder


def prior_of(target_dir: str) -> pathlib.Path | None:
    """The bundle's prior: ROOT/prior.json for ROOT/target, or beside a plain checkpoint's files."""
    target = pathlib.Path(target_dir)
    for candidate in (target.parent / PRIOR, target / PRIOR):
        if candidate.is_file():
            return candidate
    return None


class WarmStart:
    """Where one engine's learned state is saved, and what it starts from."""

    def __init__(self, cfg) -> None:
        self.path = None
        if cfg.cost_model_cache:
            key = deployment_key(cfg)
            kinds = hashlib.sha1(f"{cfg.drafter}|{cfg.block}".encode()).hexdigest()[:8]
            self.path = pathlib.Path(cfg.cost_model_cache) / f"learned_{key}_{kinds}.json"
        self.prior = prior_of(cfg.target_dir)

    def load(self) -> tuple[LearnedState | None, str]:
        """(state, where from: "saved", "prior" or "none"); a file that cannot be read is logged
        and skipped (a fresh start is always safe)."""
        for source, path in (("saved", self.path), ("prior", self.prior)):
            if path is None or not path.is_file():
                continue
            try:
                return LearnedState.from_dict(json.loads(path.read_text())), source
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("learned state %s unreadable (%s); not used", path, exc)
        return None, "none"

    def save(self, state: LearnedState) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state.as_dict()))
        tmp.replace(self.path)  # atomic: a reader never sees half a file


def snapshot(engine) -> LearnedState:
    """The engine's estimators as a `LearnedState` (calibration, trackers, costs, overhead)."""
    learner = engine.draft_cost
    kinds = {name: KindState.of(cal, tracker, cost) for name, cal, tracker, cost in
             zip(engine.kinds, engine.calibrators, engine.gate.trackers, learner.costs, strict=True)}
    over = engine.overhead.mean
    overhead = {n: over[k] for n, k in (("plain", False), ("drafting", True)) if k in over}
    log_ratio = engine.cost.log_ratio if engine.cost is not None else 0.0
    return LearnedState(kinds, float(learner.shared), overhead, log_ratio,
                        engine.gate.exploration.steps,
                        payoff=engine.payoff.as_dict() if engine.payoff is not None else {})


def warm(engine, state: LearnedState) -> None:
    """Set the engine's estimators from `state` (kinds matched by name)."""
    missing = state.restore(engine.kinds, engine.calibrators, engine.gate.trackers, engine.gate.exploration)
    engine.draft_cost.restore([k.draft if (k := state.kinds.get(name)) is not None else None
                               for name in engine.kinds], state.shared)
    for name, drafting in (("plain", False), ("drafting", True)):
        if name in state.overhead:
            engine.overhead.mean[drafting] = state.overhead[name]
            engine.overhead.count[drafting] = max(engine.overhead.count[drafting], 50)
    if engine.cost is not None:
        engine.cost.log_ratio = state.cost_log_ratio
        engine.cost.observed = max(engine.cost.observed, 50)  # a correction from many steps: not a first guess
    if engine.payoff is not None and state.payoff:
        engine.payoff.restore(state.payoff)
    if missing:
        log.info("learned state has nothing for drafter kind(s) %s: they start cold", ", ".join(missing))
