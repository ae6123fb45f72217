"""The engine unit as a Ray Serve deployment: coordinator + drafter replicas + EP target group.

One replica of this deployment is one whole engine: `build_app` gives it one placement group
(actors/engine/placement.py) holding the replica (the coordinator), its EP ranks and its drafter
replicas; the actors are created by it and die with it, and it scales as a unit. Requests
arrive already tokenized from the ingress and leave as streams of deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
from ray import serve

from actors.engine.sequence import SamplingParams
from actors.engine.server import AsyncEngine
from deployments.settings import ENGINE_CPUS, ServeSettings


@serve.deployment(name="engine", max_ongoing_requests=4096, health_check_period_s=5, health_check_timeout_s=30,
                  ray_actor_options={"num_cpus": ENGINE_CPUS})
class EngineDeployment:
    """Streams completions; applies the queue limit (429) before a request enters the engine."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.engine = AsyncEngine(settings.engine_config(unit_placement=True), settings.max_waiting)

    async def generate(self, prompt: list[int], params: dict, resume: list[int] | None = None) -> AsyncIterator[dict]:
        async for delta in self.engine.stream(prompt, SamplingParams(**params), resume):
            yield delta.__dict__

    def stats(self) -> dict:
        """Engine-level figures for /metrics: MAT, keep ratio, cost-model error, load."""
        recs = self.engine.engine.records[-200:]
        drafted = sum(r.drafted for r in recs)
        reqs = sum(r.requests for r in recs)
        errors = [abs(r.predicted_verify_s - r.measured_verify_s) / r.measured_verify_s
                  for r in recs if r.measured_verify_s > 0 and np.isfinite(r.predicted_verify_s)]
        return {
            "mat": (sum(r.accepted for r in recs) + reqs) / reqs if reqs else 0.0,
            "keep_ratio": sum(r.kept for r in recs) / drafted if drafted else 0.0,
            "cost_model_error": float(np.median(errors)) if errors else 0.0,
            "predicted_verify_s": float(np.mean([r.predicted_verify_s for r in recs])) if recs and errors else 0.0,
            "measured_verify_s": float(np.mean([r.measured_verify_s for r in recs])) if recs else 0.0,
            "in_flight": self.engine.load,
            "drafter_replicas_lost": self.engine.engine.degraded["drafter_replica_lost"],
            "drafter_context_lost": self.engine.engine.degraded["drafter_context_lost"],
            "ep_group_rebuilds": self.engine.engine.degraded["ep_group_rebuilt"],
            "steps": self.engine.steps,
        }

    def placement(self) -> dict:
        """Node and placement group of the coordinator, each EP rank and each drafter replica."""
        return self.engine.engine.placement()

    def check_health(self) -> None:
        if not self.engine.engine.target.healthy:
            raise RuntimeError("the EP target group is down")
