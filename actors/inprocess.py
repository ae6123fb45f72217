"""Ray's actor-call syntax over a plain object in this process: the in-process engine (EP 1, where
the coordinator, the target's rank and the drafters share one process and a step is function
calls; DESIGN.md, "Where the step runs").

The engine's parts talk to ranks and drafters as `handle.method.remote(*args)`, then `resolve`
the result. `InProcess(obj)` answers the same calls by running the method at once and returning
its value; `resolve` waits for Ray references and passes values through. One code path serves
both, and the in-process one costs a function call: no task submission, no pickling.
"""

from __future__ import annotations

from typing import Any

import ray


class InProcess:
    """`obj` behind an actor handle's call syntax (`h.m.remote(*a)` is `obj.m(*a)`, now)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self.obj, name))


class _Call:
    __slots__ = ("remote",)

    def __init__(self, method) -> None:
        self.remote = method


def resolve(result: Any) -> Any:
    """The value of a call's result: `ray.get` for a reference (or a list of them), else as is."""
    if isinstance(result, ray.ObjectRef) or (isinstance(result, list) and result
                                             and isinstance(result[0], ray.ObjectRef)):
        return ray.get(result)
    return result
