"""Typed messages of an EP unit's control link (`link.RankLink`): msgpack, never pickle.

What a rank reads from its socket can only become plain data: msgpack's own types (None, bools,
numbers, strings, bytes, lists, maps), numpy arrays (an extension type: dtype, shape, raw
buffer), and, as one-key maps under a marker key, tuples, the dataclasses of `DATACLASSES` and the
exceptions of `EXCEPTIONS` (by name, with their message). Nothing else can be named, so no frame can make a rank
import or call anything. Calls and answers are maps with a version (`VERSION`); a rank accepts only
the calls of `CALLS`, each with its arguments' types.
"""

from __future__ import annotations

import dataclasses
import importlib

import msgpack
import numpy as np

VERSION = 1
MAX_BYTES = 1 << 30  # a larger message is refused (a step's features at 1,024 requests are ~100 MiB)

# The calls a driver may make of a rank, and nothing else: (part, method) -> the type of each
# argument ("?": None allowed too; after "|" the arguments may be left out). A call whose
# arguments are not of these types is refused before anything runs.
CALLS: dict[tuple[str, str], tuple[str, ...]] = {
    ("target", "forward"): ("RankBatch",),
    ("target", "truncate"): ("dict",),
    ("target", "release"): ("list",),
    ("target", "cache_info"): (),
    ("target", "take_features"): ("dict", "|", "bool"),
    ("target", "ping"): (),
    ("drafter", "draft"): ("list", "list", "list", "|", "CatchUp?", "list?", "list?", "dict?"),
    ("drafter", "commit"): ("CatchUp",),
    ("drafter", "release"): ("list",),
    ("drafter", "target_layers"): (),
    ("drafter", "whereabouts"): (),
    ("drafter", "held"): (),
}
METHODS = {part: frozenset(m for p, m in CALLS if p == part) for part, _ in CALLS}
_PLAIN = {"dict": dict, "list": (list, tuple), "bool": bool}

# Every dataclass that crosses the link, by name (imported when first needed).
DATACLASSES = {
    "RankBatch": "actors.target.worker",
    "RankResult": "actors.target.worker",
    "StepStats": "actors.target.moe",
    "Controls": "actors.target.sampling",
    "RequestControls": "actors.target.sampling",
    "CatchUp": "actors.engine.backlog",
    "DraftOutput": "actors.drafter.base",
    "ChainStop": "dcut_core.chains",
}
EXCEPTIONS = {
    "BatchRejected": "actors.target.worker",
    "KVCacheFull": "actors.target.kv_cache",
    "ValueError": "builtins",
    "RuntimeError": "builtins",
    "KeyError": "builtins",
    "TypeError": "builtins",
    "IndexError": "builtins",
}
_ARRAY = 1  # the one extension type: a numpy array (its raw buffer written once)
_TUPLE, _DATACLASS, _EXCEPTION = "\x00tuple", "\x00dataclass", "\x00exception"  # marker keys of one-key maps


class WireError(ValueError):
    """A message that is not one this link speaks: malformed, too large, of an unknown type, or
    of another version."""


def _named(table: dict[str, str], name) -> type:
    if not isinstance(name, str) or name not in table:
        raise WireError(f"unknown type {name!r}")
    return getattr(importlib.import_module(table[name]), name)


def _default(obj):
    """What msgpack cannot write itself: arrays as an extension (header, then the raw buffer,
    copied once), tuples, dataclasses and exceptions as one-key maps under a marker key."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("object arrays do not cross the control link")
        a = np.ascontiguousarray(obj)  # (a 0-d array comes back 1-d: its shape is obj's)
        head = msgpack.packb([a.dtype.str, list(obj.shape)])
        raw = memoryview(a.reshape(-1).view(np.uint8))  # empty and 0-d arrays too
        return msgpack.ExtType(_ARRAY, b"".join((len(head).to_bytes(4, "little"), head, raw)))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {_TUPLE: list(obj)}
    if dataclasses.is_dataclass(obj) and DATACLASSES.get(type(obj).__name__) == type(obj).__module__:
        return {_DATACLASS: [type(obj).__name__, [getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init]]}
    if isinstance(obj, BaseException):
        name = type(obj).__name__
        if name not in EXCEPTIONS:  # its kind, in words: the driver fails the group on it anyway
            return {_EXCEPTION: ["RuntimeError", f"{name}: {obj}"]}
        return {_EXCEPTION: [name, str(obj.args[0]) if obj.args else ""]}
    raise TypeError(f"{type(obj).__name__} does not cross the control link")


def _ext(code: int, data: bytes):
    if code != _ARRAY:
        raise WireError(f"unknown extension type {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgpack.unpackb(data[4:4 + n])
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise WireError("object arrays do not cross the control link")
    return np.frombuffer(data, dtype=dt, offset=4 + n).reshape(shape).copy()  # writable, its own memory


def _map(d: dict):
    if len(d) == 1:
        key, value = next(iter(d.items()))
        if key == _TUPLE:
            return tuple(value)
        if key == _DATACLASS:
            name, values = value
            return _named(DATACLASSES, name)(*values)
        if key == _EXCEPTION:
            name, message = value
            return _named(EXCEPTIONS, name)(message)
    return d


def pack(obj) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def unpack(data: bytes):
    try:
        return msgpack.unpackb(data, ext_hook=_ext, object_hook=_map, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # whatever msgpack or a constructor says of a malformed message
        raise WireError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def call(part: str, method: str, args: tuple, answer: bool) -> bytes:
    return pack({"v": VERSION, "part": part, "method": method, "args": list(args), "answer": answer})


def read_call(data: bytes) -> tuple[str, str, tuple, bool]:
    """(part, method, args, answer) of a call message; WireError unless it is a call this link
    knows (`METHODS`), of this version."""
    msg = unpack(data)
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise WireError(f"not a version-{VERSION} call")
    part, method, args, answer = msg.get("part"), msg.get("method"), msg.get("args"), msg.get("answer")
    if method not in METHODS.get(part, ()) or not isinstance(args, list) or not isinstance(answer, bool):
        raise WireError(f"no call {part!r}.{method!r} on this link")
    _check_args(part, method, args)
    return part, method, tuple(args), answer


def _check_args(part: str, method: str, args: list) -> None:
    """WireError unless `args` fit the call's signature in `CALLS`."""
    spec = CALLS[(part, method)]
    required = spec.index("|") if "|" in spec else len(spec)
    types = [t for t in spec if t != "|"]
    if not required <= len(args) <= len(types):
        raise WireError(f"{part}.{method} takes {required}–{len(types)} arguments, not {len(args)}")
    for i, (arg, name) in enumerate(zip(args, types, strict=False)):
        if arg is None and name.endswith("?"):
            continue
        name = name.rstrip("?")
        want = _PLAIN.get(name) or _named(DATACLASSES, name)
        if not isinstance(arg, want):
            raise WireError(f"{part}.{method}: argument {i} is {type(arg).__name__}, not {name}")


def reply(ok: bool, value) -> bytes:
    return pack({"v": VERSION, "ok": ok, "value": value})


def read_reply(data: bytes) -> tuple[bool, object]:
    msg = unpack(data)
    if not isinstance(msg, dict) or msg.get("v") != VERSION or not isinstance(msg.get("ok"), bool):
        raise WireError(f"not a version-{VERSION} answer")
    return msg["ok"], msg.get("value")
