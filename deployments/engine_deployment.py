"""The engine unit as a Ray Serve deployment: coordinator + drafter replicas + EP target group.

One replica of this deployment is one whole engine: `build_app` gives it one placement group
(actors/engine/placement.py) holding the replica (the coordinator), its EP ranks and its drafter
replicas; the actors are created by it and die with it, and it scales as a unit. Requests
arrive validated and tokenized (`GenerateRequest`) and leave as streams of `Delta`s, or one
`EngineError` value. The replica's health is the step loop's (`AsyncEngine.health`): Serve
replaces a replica whose loop died or stalled.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from ray import serve

from actors.engine.api import Delta, EngineError, GenerateRequest, Health
from actors.engine.server import AsyncEngine
from deployments.settings import ServeSettings


@serve.deployment(name="engine", max_ongoing_requests=4096)
class EngineDeployment:
    """Streams completions; the queue limit (429) applies before a request enters the engine."""

    def __init__(self, settings: ServeSettings) -> None:
        self.engine = AsyncEngine(settings.engine_config(unit_placement=True), settings.max_waiting,
                                  settings.stall_timeout_s)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta | EngineError]:
        async for item in self.engine.stream(request):
            yield item

    def stats(self) -> dict:
        """Engine-level figures for /metrics."""
        return self.engine.stats()

    def health(self) -> Health:
        return self.engine.health()

    def placement(self) -> dict:
        """Node and placement group of the coordinator, each EP rank and each drafter replica."""
        return self.engine.placement()

    async def held(self) -> dict[str, int]:
        """This replica's process and the request state it keeps by owner, once idle (all 0
        unless something leaked; `benchmarks/chaos.py` checks it after faults)."""
        return {"pid": os.getpid(), **await self.engine.held()}

    def check_health(self) -> None:
        """Serve's health check: fails when the step loop cannot make progress."""
        health = self.engine.health()
        if not health.ok:
            raise RuntimeError(health.reason)
