"""The EP unit's control link: a call's round trip and what encoding a step costs (issue #27).

An EP 2 `DriverGroup` on the bundled target: rank 0 here, rank 1 a Ray actor in its serve loop.
- `ping`: a call to rank 1 and its answer, the smallest message (median and p90 of 500);
- `cache_info`: rank 0's part here, rank 1's over the link, both answers;
- encoding, where the `wire` module exists: a step plan of R requests × 8 tokens (`RankBatch`) and
  a result with their features (`RankResult`), packed and unpacked, against pickle protocol 5.

    .venv/bin/python benchmarks/link_round_trip.py
"""

from __future__ import annotations

import json
import pathlib
import pickle
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()


def timed(f, n: int) -> tuple[float, float]:
    """Median and p90 milliseconds of n calls."""
    f()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(1e3 * (time.perf_counter() - t0))
    xs.sort()
    return statistics.median(xs), xs[int(0.9 * len(xs))]


def codec(requests: int) -> dict:
    from actors.target import wire
    from actors.target.moe import StepStats
    from actors.target.worker import RankBatch, RankResult

    rng = np.random.default_rng(0)
    n = 8 * requests
    batch = RankBatch(list(range(requests)), rng.integers(0, 4096, n), np.arange(0, n + 1, 8), np.arange(n),
                      False, (2, 5), None, None, {i: 100 for i in range(requests)}, np.ones(requests, dtype=bool))
    result = RankResult(rng.integers(0, 4096, n), None,
                        {2: rng.standard_normal((n, 512)).astype(np.float16)}, StepStats(total_s=0.01))
    out = {}
    for name, value in (("plan", batch), ("result", result)):
        msg = wire.call("target", "forward", (value,), True)
        out[f"{name} wire ms"] = timed(lambda v=value: wire.read_call(wire.call("target", "forward", (v,), True)),
                                       200)[0]
        out[f"{name} pickle ms"] = timed(lambda v=value: pickle.loads(pickle.dumps(("target", "forward", (v,), True),
                                                                                   protocol=5)), 200)[0]
        out[f"{name} bytes"] = len(msg)
    return out


def main() -> int:
    from actors.ray_env import start_local_ray
    from actors.target.driver import DriverGroup
    from actors.target.group import EPConfig
    from deployments.bundle import BUNDLED

    start_local_ray(num_cpus=4)
    group = DriverGroup(EPConfig(str(BUNDLED / "target"), world=2, threads_per_rank=1))
    try:
        ping = timed(lambda: group.call(1, "target", "ping", ()).get(), 500)
        info = timed(lambda: group.cache_info(), 200)
    finally:
        group.shutdown()
    row = {"ping median ms": ping[0], "ping p90 ms": ping[1], "cache_info median ms": info[0],
           "cache_info p90 ms": info[1]}
    try:
        for r in (64, 1024):
            row |= {f"R={r} {k}": v for k, v in codec(r).items()}
    except ImportError:  # code from before the typed messages
        pass
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
