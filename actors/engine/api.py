"""The engine's typed interface across Serve: what goes in (`GenerateRequest`), what comes out
(`Delta`, or an `EngineError` as a value in the same stream), and what health looks like.

Errors are values, never exceptions matched by name: the ingress maps `ErrorKind` to an HTTP
status through one table (deployments/errors.py). Only transport failures (the engine replica
died) still arrive as Ray exceptions, and the ingress resubmits those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.errors import EngineError, ErrorKind
from actors.engine.sequence import SamplingParams

__all__ = ["Delta", "EngineError", "ErrorKind", "GenerateRequest", "Health"]


@dataclass(frozen=True)
class GenerateRequest:
    """One validated request: token ids in, sampling parameters, and `resume` — output an
    engine that failed had already streamed to the client (not sent again; max_tokens counts it)."""

    prompt: list[int]
    params: SamplingParams
    resume: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("the prompt must not be empty")
        if self.params.max_tokens and len(self.resume) >= self.params.max_tokens:
            raise ValueError("nothing left to generate: resume already holds max_tokens tokens")


@dataclass
class Delta:
    """New output of one request since its last delta."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    logprobs: list | None = None  # TokenLogprob per token of token_ids (when asked for)
    prompt_logprobs: list | None = None  # per prompt token (the first None), in the request's first delta


@dataclass(frozen=True)
class Health:
    """Whether the step loop can make progress: `ok` is False when it died, or when work waits
    and no step finished within the stall limit."""

    ok: bool
    reason: str = ""
    in_flight: int = 0
    steps: int = 0
    idle_s: float = 0.0  # since the loop last made progress (0 while it has nothing to do)
