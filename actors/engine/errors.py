"""A request's failure as a value (`EngineError`): set on its sequence by the scheduler, carried
in its own stream to the ingress, which maps its `ErrorKind` to an HTTP status
(deployments/errors.py). Its own module, so the scheduler can set one without importing the
interface across Serve (actors/engine/api.py re-exports both)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorKind(enum.Enum):
    INVALID = "invalid_request"  # the request itself cannot be served (the client must change it)
    OVERLOADED = "overloaded"  # too many requests in flight: retry shortly
    UNAVAILABLE = "unavailable"  # a step failed under it, or the engine is rebuilding: retry
    INTERNAL = "internal"  # a fault of ours that hit this request alone


@dataclass(frozen=True)
class EngineError:
    """A request's failure, delivered in its own stream; it ends the stream."""

    kind: ErrorKind
    message: str

    @property
    def retryable(self) -> bool:
        return self.kind in (ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE)
