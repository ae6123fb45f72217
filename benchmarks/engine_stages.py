"""Where an embedded engine's time goes at one concurrency: wall time per stage of `Engine.step`,
the target's forward (wall and the slowest rank's own), and what the drafting gate learned.

    .venv/bin/python benchmarks/engine_stages.py --concurrency 64 --policies ar,dcut,ar,dcut --ep 2

Policies run in the order given on one engine (so a repeated policy runs warm); each prints its
rate and the seconds spent per stage over the run. With --profile, the driver's cProfile too.
The machine is shared: alternate policies and compare neighbouring runs.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import time

STAGES = ("schedule", "plan", "propose", "prune", "verify", "accept", "commit", "_release")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--policies", default="ar,dcut")
    p.add_argument("--num-prompts", type=int, help="default: 3 × concurrency")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also print the driver's cProfile (top 25)")
    args = p.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop, summarize
    from actors.ray_env import start_local_ray
    from deployments.settings import ServeSettings
    from deployments.workload import heldout_prompts

    c = args.concurrency
    n = args.num_prompts or 3 * c
    cfg = ServeSettings(ep=args.ep, max_running=c).engine_config()
    tok = Tokenizer.from_file(cfg.tokenizer_path)
    prompts = [tok.encode(t).ids for t in heldout_prompts(n)]
    start_local_ray(num_cpus=max(4, (os.cpu_count() or 1) + args.ep + 1))
    eng = Engine(cfg)
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    for name in STAGES:
        setattr(eng, name, timed(name, getattr(eng, name)))
    try:
        closed_loop(eng, prompts[:2], 2, 8)  # warm-up: lazy loading
        reference = None
        for policy in args.policies.split(","):
            eng.set_policy(policy)
            forward = eng.target.run
            eng.target.run = timed("target.run (wall)", forward)
            spent.clear()
            prof = cProfile.Profile() if args.profile else None
            if prof:
                prof.enable()
            run = closed_loop(eng, prompts, c, args.max_tokens)
            if prof:
                prof.disable()
            eng.target.run = forward
            s = summarize(run)
            reference = reference or run.outputs
            print(f"== {policy} C={c}: {s['output_tok_s']:.0f} tok/s, {s['steps']} steps of {s['step_ms_mean']:.1f} ms "
                  f"(target {s['target_compute_ms_mean']:.1f}, drafter {s['draft_compute_ms_mean']:.1f}, overhead "
                  f"{100 * s['overhead_frac']:.0f} %), MAT {s['mat']:.2f}, lossless {run.outputs == reference}")
            for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
                print(f"   {name:24s} {sec:7.3f} s")
            if policy == "dcut":
                print(f"   gate: drafting cost {eng.draft_cost.cost}, verify scale {eng.cost.scale:.2f}, "
                      f"global acceptance by position {eng.gate.trackers[0].global_rate.round(2).tolist()}")
            if prof:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
