"""The drafting gate at C = 4 and 16 on the bundled model: `ar` against `dcut` with the gate's
slack and extension switched off and on, in rotating rounds; per run, the share of steps that
drafted. Round 0 starts from a cold engine (the gate explores every step until it has seen 64
verifications); later rounds run warm.

    .venv/bin/python benchmarks/gate_variants.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()

VARIANTS = {"default": {}, "no-extend": {"draft_extend": False}, "slack0": {"draft_slack": 0},
            "no-extend-slack0": {"draft_extend": False, "draft_slack": 0}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from deployments.settings import ServeSettings
    from deployments.workload import heldout_prompts

    start_local_ray(num_cpus=4)
    base = ServeSettings(max_running=16, threads_per_rank=2).engine_config()
    tok = Tokenizer.from_file(base.tokenizer_path)
    prompts = [tok.encode(t).ids for t in heldout_prompts(16)]
    engines = {name: Engine(dataclasses.replace(base, **kw)) for name, kw in VARIANTS.items()}
    for e in engines.values():
        e.set_policy("dcut")
        closed_loop(e, prompts[:4], 4, 16)
    results: dict = {}
    for rnd in range(args.rounds):
        for c in (16, 4):
            order = [("ar", engines["default"]), *engines.items()]
            order = order[rnd % len(order):] + order[:rnd % len(order)]
            for name, e in order:
                e.set_policy("ar" if name == "ar" else "dcut")
                t0 = time.perf_counter()
                run = closed_loop(e, prompts, c, 48)
                tok_s = sum(map(len, run.outputs)) / (time.perf_counter() - t0)
                recs = [r for r in run.records if r.requests]
                results.setdefault((c, name), []).append(tok_s)
                print(json.dumps({"round": rnd, "C": c, "variant": name, "tok_s": round(tok_s), "steps": len(recs),
                                  "drafting_steps": round(sum(r.drafted > 0 for r in recs) / len(recs), 2)}),
                      flush=True)
    for (c, name), xs in sorted(results.items()):
        ratio = statistics.median(a / b for a, b in zip(xs, results[(c, "ar")], strict=True))
        print(f"C={c} {name}: median {statistics.median(xs):.0f} tok/s, {ratio:.3f} x ar")
    for e in engines.values():
        e.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
