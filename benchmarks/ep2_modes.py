"""EP 2 driven from rank 0 (`DriverGroup`, the default) against every rank a Ray actor called per
step (`in_process=False`), in alternating rounds; then what the control link itself costs.

    .venv/bin/python benchmarks/ep2_modes.py [--rounds 2]

Per mode, policy and concurrency: tokens/s and the mean decode step split into the ranks' own
forward, the drafter's pass, and the rest ("outside"). Then, on a bare `DriverGroup`: the CPU an
idle rank burns in 10 s, and the round trip of one control call (`cache_info`: rank 0 locally,
one message to rank 1 and its answer).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from actors.target.driver import DriverGroup
    from actors.target.group import EPConfig
    from deployments.settings import ServeSettings
    from deployments.workload import heldout_prompts

    start_local_ray(num_cpus=6)
    driven = ServeSettings(ep=2, max_running=16).engine_config()
    tok = Tokenizer.from_file(driven.tokenizer_path)
    prompts = [tok.encode(t).ids for t in heldout_prompts(16)]
    engines = {"driven": Engine(driven),
               "actors": Engine(ServeSettings(ep=2, max_running=16, in_process=False).engine_config())}
    for e in engines.values():
        e.set_policy("ar")
        closed_loop(e, prompts[:2], 2, 8)
    ms = lambda xs: round(1e3 * statistics.fmean(xs), 2)  # noqa: E731
    for rnd in range(args.rounds):
        for c in (1, 16):
            for policy in ("ar", "dcut"):
                order = list(engines.items())[:: 1 if rnd % 2 == 0 else -1]
                for name, e in order:
                    e.set_policy(policy)
                    t0 = time.perf_counter()
                    res = closed_loop(e, prompts[:12], c, 48)
                    wall = time.perf_counter() - t0
                    recs = [r for r in res.records if r.requests]
                    print(json.dumps({"round": rnd, "C": c, "policy": policy, "mode": name,
                                      "tok_s": round(sum(map(len, res.outputs)) / wall, 1),
                                      "step_ms": ms([r.step_s for r in recs]),
                                      "target_ms": ms([r.target_compute_s for r in recs]),
                                      "draft_ms": ms([r.draft_compute_s for r in recs]),
                                      "outside_ms": ms([r.overhead_s for r in recs])}), flush=True)
    for e in engines.values():
        e.shutdown()
    group = DriverGroup(EPConfig(driven.target_dir, world=2, threads_per_rank=1))
    try:
        pid = group.ranks[1]["pid"]
        time.sleep(1)
        before = cpu_seconds(pid)
        time.sleep(10)
        idle = cpu_seconds(pid) - before
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            group.cache_info()
            times.append(time.perf_counter() - t0)
        times.sort()
        print(json.dumps({"idle_rank_cpu_s_in_10s": round(idle, 3),
                          "control_round_trip_ms_median": round(1e3 * times[150], 3),
                          "control_round_trip_ms_p90": round(1e3 * times[270], 3)}))
    finally:
        group.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
