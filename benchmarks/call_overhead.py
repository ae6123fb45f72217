"""Micro-benchmark: what one step's fan-out to the EP ranks costs in Ray calls alone.

    .venv/bin/python benchmarks/call_overhead.py [--ranks 2] [--calls 300]

Two ways to send every rank its `RankBatch` and wait for all results, with ranks that do no
work (so the time is the calls'): plain actor calls (what `EPGroup.forward` does), and a Ray
Compiled Graph over the same actors (channels set up once; each step only writes and reads).
Payloads are those of a decode step at C = 1 and C = 64 (one and 32 tokens per rank). Then the
CPU each rank process burns while the graph sits idle for a few seconds (`--idle-s`): a graph's
actors wait for their next input on a background thread.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

import numpy as np


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--idle-s", type=float, default=5.0)
    args = p.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    import ray
    from ray.dag import InputNode, MultiOutputNode

    from actors.ray_env import start_local_ray
    from actors.target.worker import RankBatch, RankResult

    @ray.remote(num_cpus=0)
    class Rank:
        def forward(self, rb: RankBatch) -> RankResult:
            m = len(rb.logit_index)
            return RankResult(np.zeros(m, np.int64), None)

        def pick(self, batches: list, r: int) -> RankResult:
            return self.forward(batches[r])

        def pid(self) -> int:
            return os.getpid()

    start_local_ray(num_cpus=4)
    ranks = [Rank.remote() for _ in range(args.ranks)]

    def batch(tokens: int) -> RankBatch:
        return RankBatch(list(range(tokens)), np.arange(tokens, dtype=np.int64),
                         np.arange(tokens + 1, dtype=np.int64), np.arange(tokens, dtype=np.int64))

    with InputNode() as inp:
        dag = MultiOutputNode([w.pick.bind(inp, r) for r, w in enumerate(ranks)])
    compiled = dag.experimental_compile()
    print("| per rank | actor calls ms (median) | compiled graph ms (median) |")
    print("|---|---|---|")
    try:
        for tokens in (1, 32):
            batches = [batch(tokens) for _ in ranks]
            plain, graph = [], []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                ray.get([w.forward.remote(b) for w, b in zip(ranks, batches, strict=True)])
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ray.get(compiled.execute(batches))
                graph.append(time.perf_counter() - t0)
            print(f"| {tokens} token{'s' if tokens > 1 else ''} | {1e3 * statistics.median(plain):.2f} | "
                  f"{1e3 * statistics.median(graph):.2f} |")
        pids = ray.get([w.pid.remote() for w in ranks])
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(args.idle_s)
        busy = [(cpu_seconds(pid) - b) / args.idle_s for pid, b in zip(pids, before, strict=True)]
        print(f"\nidle compiled graph, {args.idle_s:.0f} s: each rank process used "
              + ", ".join(f"{100 * u:.0f} %" for u in busy) + " of a core")
    finally:
        compiled.teardown()
        ray.shutdown()


if __name__ == "__main__":
    main()
