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


class Pending:
    """A result owed by a peer outside Ray (a rank answering over its control group): `get()`
    waits for it."""

    __slots__ = ()

    def get(self) -> Any:
        raise NotImplementedError


def resolve(result: Any) -> Any:
    """The value of a call's result: `ray.get` for a reference (or a list of them), `get()` for a
    `Pending`, else as is (a list may mix them)."""
    if isinstance(result, ray.ObjectRef) or (isinstance(result, list) and result
                                             and all(isinstance(r, ray.ObjectRef) for r in result)):
        return ray.get(result)
    if isinstance(result, Pending):
        return result.get()
    if isinstance(result, list):
        return [resolve(r) for r in result]
    return result
