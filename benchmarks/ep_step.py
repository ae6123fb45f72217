"""Micro-benchmark: the expert-parallel verification step versus verify tokens.

    .venv/bin/python benchmarks/ep_step.py [--requests 16] [--context 128] [--repeats 5]

Random weights of the demo target shape; EP sizes 1 and 2 on this machine (gloo over
loopback). For each verify-tokens-per-request q, one step of R requests × q tokens is timed at
the driver (median of repeats) and split, from the ranks' own clocks, into attention, expert
compute, dispatch, combine and the rest. Writes runs/bench/ep_step.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

import numpy as np

from actors.ray_env import set_local_env

set_local_env()

from actors.ray_env import start_local_ray  # noqa: E402
from actors.target.decode import prefill  # noqa: E402
from actors.target.demo import DEMO_TARGET, write_random_demo  # noqa: E402
from actors.target.group import EPConfig, EPGroup  # noqa: E402


def bench(group: EPGroup, requests: int, context: int, per_request: list[int], repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    ids = list(range(requests))
    prefill(group, ids, [rng.integers(0, DEMO_TARGET.vocab_size, context).tolist() for _ in ids])
    rows = []
    for q in per_request:
        runs = []
        for _ in range(repeats):
            out = group.forward(ids, [rng.integers(0, DEMO_TARGET.vocab_size, q).tolist() for _ in ids])
            group.truncate(dict.fromkeys(ids, context))
            runs.append(out)
        runs.sort(key=lambda o: o.wall_s)
        med = runs[len(runs) // 2]
        s = med.rank_stats
        n = len(s)
        a2a = sum(x.dispatch_s + x.combine_s for x in s) / n
        rows.append({
            "verify_tokens": requests * q, "per_request": q, "step_ms": 1e3 * med.wall_s,
            "attention_ms": 1e3 * sum(x.attention_s for x in s) / n,
            "experts_ms": 1e3 * sum(x.experts_s for x in s) / n,
            "a2a_ms": 1e3 * a2a, "a2a_share": a2a / med.wall_s,
            "bytes_sent_per_rank": max(x.bytes_sent for x in s),
            "experts_touched_per_layer": sum(x.distinct_experts for x in s) / max(1, sum(x.moe_layers for x in s)),
        })
    group.release(ids)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--per-request", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    per_request = [int(x) for x in args.per_request.split(",")]
    model_dir = write_random_demo(pathlib.Path(tempfile.gettempdir()) / "dcut-demo-random")
    cores = os.cpu_count() or 1
    start_local_ray(num_cpus=max(2, cores))
    results = {}
    for ep in (1, 2):
        group = EPGroup(EPConfig(str(model_dir), world=ep, cpus_per_rank=min(1.0, cores / ep),
                                 threads_per_rank=max(1, cores // ep)))
        try:
            results[ep] = bench(group, args.requests, args.context, per_request, args.repeats)
        finally:
            group.shutdown()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ep_step.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"R = {args.requests} requests, context {args.context}, demo shape, random weights")
    print("| EP | verify tokens | step ms | attention ms | experts ms | all-to-all ms | all-to-all share "
          "| bytes sent/rank | experts touched/layer/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ep, rows in results.items():
        for r in rows:
            print(f"| {ep} | {r['verify_tokens']} | {r['step_ms']:.1f} | {r['attention_ms']:.1f} | "
                  f"{r['experts_ms']:.1f} | {r['a2a_ms']:.1f} | {100 * r['a2a_share']:.0f} % | "
                  f"{r['bytes_sent_per_rank'] / 1024:.0f} KiB | {r['experts_touched_per_layer']:.1f} |")


if __name__ == "__main__":
    main()
