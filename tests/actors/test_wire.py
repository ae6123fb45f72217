"""The control link's messages (`actors/target/wire.py`): every kind of value a step sends round-
trips exactly; nothing outside the closed set of types can be named, so a pickle payload, an
unknown type or method, another version or a malformed frame is refused and runs nothing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from actors.drafter.base import DraftOutput
from actors.engine.backlog import CatchUp
from actors.target import wire
from actors.target.kv_cache import KVCacheFull
from actors.target.moe import StepStats
from actors.target.sampling import Controls, RequestControls
from actors.target.worker import BatchRejected, RankBatch, RankResult
from dcut_core.chains import ChainStop


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b and type(a) is type(b)


def test_a_steps_values_round_trip_exactly():
    rng = np.random.default_rng(0)
    rc = RequestControls(Controls(0.5, 0.0, 1.2, ((7, -1.5),), 2, (0,), 5, 0.1), np.arange(9), 4,
                         rng.integers(0, 2**31, (3, 4)).astype(np.int32))
    batch = RankBatch([3, 9], np.arange(12, dtype=np.int64), np.array([0, 5, 12]), np.array([4, 11]), False, (1, 3),
                      np.array([0.0, 0.7], dtype=np.float32), np.array([1.0, 0.9], dtype=np.float32), {3: 40},
                      np.array([True, False]), np.array([False, True]), (None, rc), np.array([0.0, 0.25]))
    result = RankResult(np.array([5, 6]), None,
                        {1: rng.standard_normal((7, 4)).astype(np.float16)}, StepStats(total_s=0.01, per_layer=[1, 2]),
                        np.array([5, 2]), None)
    draft = DraftOutput(np.array([1, 2]), np.array([0, 2, 2]), np.array([0.9, 0.5]), np.array([0.3, 0.1]),
                        lost=(4,), kind_s={0: 0.001}, kinds=np.array([0, 1]), kind_context={1: 7})
    catchup = CatchUp([3], [[5, 6]], [{2: np.ones((2, 4), dtype=np.float16)}], {3: (0, 2)}, "local")
    odd = (np.zeros((0, 4), dtype=np.float16), np.array(3.5), np.array([True, False]), np.arange(6).reshape(2, 3)[:, 1])
    for value in (batch, result, draft, catchup, {"lengths": {3: 40}, "free": 9}, (1, "a", None, [2.5, True]), odd):
        assert same(wire.unpack(wire.pack(value)), value), value
    part, method, args, answer = wire.read_call(wire.call("target", "forward", (batch,), True))
    assert (part, method, answer) == ("target", "forward", True) and same(args, (batch,))
    ok, err = wire.read_reply(wire.reply(False, BatchRejected("rank 1: KV cache full")))
    assert not ok and type(err) is BatchRejected and str(err) == "rank 1: KV cache full"
    assert type(wire.read_reply(wire.reply(False, KVCacheFull("full")))[1]) is KVCacheFull
    ok, err = wire.read_reply(wire.reply(False, ZeroDivisionError("x")))  # not named: its kind in words
    assert type(err) is RuntimeError and "ZeroDivisionError: x" in str(err)


class Trap:
    """What a pickle payload can do: call anything on load (here: write a file)."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        return (_touch, (str(self.path),))


def _touch(path: str) -> None:
    open(path, "w").close()


def test_nothing_outside_the_closed_set_is_built_or_run(tmp_path):
    trap = tmp_path / "ran"
    evil = pickle.dumps(Trap(trap))
    for data in (evil, b"", b"\xc1", wire.pack([1, 2])[:-1], b"\xd4\x09\x00"):  # pickle, empty, bad byte, cut, ext 9
        with pytest.raises(wire.WireError):
            wire.read_call(data)
    assert not trap.exists()
    for marker, name in (("\x00dataclass", "Path"), ("\x00exception", "SystemExit"), ("\x00dataclass", 7)):
        forged = wire.pack({marker: [name, [str(trap)]]})  # naming a class outside the tables
        with pytest.raises(wire.WireError, match="unknown type"):
            wire.unpack(forged)
    with pytest.raises(wire.WireError, match="no call"):
        wire.read_call(wire.call("target", "__init__", (), True))
    with pytest.raises(wire.WireError, match="no call"):
        wire.read_call(wire.call("target", "setup", (("1.2.3.4", 1),), True))
    with pytest.raises(wire.WireError, match="version"):
        wire.read_call(wire.pack({"v": 2, "part": "target", "method": "ping", "args": [], "answer": True}))
    with pytest.raises(TypeError):  # the sender refuses what the link cannot carry, too
        wire.pack(Trap(trap))
    assert not trap.exists()


def test_a_call_must_fit_its_signature_before_anything_runs():
    """Each call's arguments are typed (`wire.CALLS`): a known method with too few or too many
    arguments, or one of another type, is refused as a malformed message; the optional ones
    may be left out or None."""
    catchup = CatchUp([3], [[5, 6]], [{}], {}, "local")
    ok = [("target", "truncate", ({3: 40},)), ("target", "take_features", ({3: (0, 2)},)),
          ("target", "take_features", ({3: (0, 2)}, False)), ("target", "cache_info", ()),
          ("drafter", "draft", ([3], [7], [4])), ("drafter", "draft", ([3], [7], [4], None, [0], None)),
          ("drafter", "draft", ([3], [7], [4], catchup, [0], [-1])), ("drafter", "commit", (catchup,)),
          ("drafter", "draft", ([3], [7], [4], None, [1], [-1], {1: ChainStop((0.0, 1.0, 0.0, 0.0), 8, 0.2, 1.5)})),
          ("target", "release", ((3, 4),))]
    for part, method, args in ok:
        assert wire.read_call(wire.call(part, method, args, True))[:2] == (part, method)
    stops = ok[-2][2][-1]
    assert wire.read_call(wire.call("drafter", "draft", ok[-2][2], True))[2][-1] == stops  # a chain's cut, exactly
    bad = [("target", "forward", ()), ("target", "forward", ({"tokens": [1]},)), ("target", "truncate", ([3],)),
           ("target", "ping", (1,)), ("target", "take_features", ({}, "yes")),
           ("drafter", "draft", ([3], [7])), ("drafter", "draft", ([3], [7], [4], "catchup")),
           ("drafter", "draft", ([3], [7], [4], None, None, None, None, None)),
           ("drafter", "draft", ([3], [7], [4], None, None, None, [0.2])), ("drafter", "commit", (None,))]
    for part, method, args in bad:
        with pytest.raises(wire.WireError, match=f"{part}.{method}"):
            wire.read_call(wire.call(part, method, args, True))
