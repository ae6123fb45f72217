"""`BatchCoordinator`: the engine as one Ray actor, the central place where every replica's
drafts meet (`dcut generate`; under Serve the engine replica plays this part)."""

from __future__ import annotations

import ray

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams


@ray.remote
class BatchCoordinator:
    """The engine as one Ray actor: the central place where every replica's drafts meet."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.engine = Engine(cfg)

    def set_policy(self, name: str) -> None:
        self.engine.set_policy(name)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
        return [
            {"token_ids": s.output, "text": s.text, "finish_reason": s.finish_reason, "steps": s.steps,
             "drafted": s.drafted, "kept": s.kept, "accepted": s.accepted}
            for s in self.engine.generate(prompts, params)
        ]

    def records(self) -> list[dict]:
        """The most recent steps (the engine keeps a bounded window)."""
        return [r.__dict__ for r in self.engine.history.recent]

    def shutdown(self) -> None:
        self.engine.shutdown()
