"""Does the trace simulator predict the engine? (issue #24, item 2)

Records a counterfactual trace of the held-out mixed workload (the prompts the benchmarks
report; nothing is tuned here), then for each setting — plain decoding, each drafter kind alone,
every kind chosen per request (`auto`) — and each concurrency, runs the engine end to end
(closed loop, in-process, EP 1, built as `dcut serve` builds it) and the simulator over the
trace, and reports predicted / measured tok/s. Rounds alternate the settings' order; the table
gives the median ratio and its range over rounds, and each setting's speed over `ar`'s in the
same round, predicted and measured (the machine's speed drifts 10–25 % between phases of a run;
a ratio within a round cancels it). A second table splits each cell's time as the simulator
does — the target's forwards, the drafters' passes, the rest (the engine's own time, and the
loop's between steps) — with the steps taken, predicted / measured: which of them a
prediction off by more than 10 % misjudges.

    .venv/bin/python benchmarks/trace_validate.py --rounds 3 --out runs/trace-validate

`--default` adds the serving default (`dcut serve` with `drafter` and `block` unset: n-gram
alone, its block by load, `load_block`) as one more setting, simulated with the same
`load_block`; the trace must then be recorded at the default's block (`--block 16`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()

KINDS = ("block", "mtp", "ngram")
PARTS = ("steps", "forward_s", "draft_s", "rest_s")  # a run's time as the simulator splits it
SIM_PARTS = {"steps": "steps", "forward_s": "forward_seconds", "draft_s": "draft_seconds", "rest_s": "rest_seconds"}


def time_split(res) -> dict:
    """A closed loop's steps, and its wall time split as the simulator splits it: the target's
    forwards (the slowest rank's own time), the drafters' passes (the slowest replica's, the
    coordinator's look-ahead included) and the rest."""
    fwd = sum(r.target_compute_s for r in res.records)
    draft = sum(r.draft_compute_s for r in res.records)
    return {"steps": len(res.records), "forward_s": fwd, "draft_s": draft, "rest_s": res.wall_s - fwd - draft}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--default", action="store_true", help="also the serving default (needs --block at its block)")
    p.add_argument("--out", default="runs/trace-validate")
    args = p.parse_args()

    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop
    from actors.engine.trace_record import record_trace
    from actors.engine.warm import prior_of
    from actors.ray_env import start_local_ray
    from dcut_core.learned import LearnedState
    from dcut_core.trace_sim import oracle_run, simulate_trace
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings
    from deployments.trace_command import settings_of, write_trace
    from deployments.workload import mixed_prompts

    served = ServeSettings(model_root=str(BUNDLED))  # `dcut serve`'s own: drafter, block, load_block unset
    if args.default and served.block != args.block:
        p.error(f"--default: the serving default drafts within block {served.block}; record at --block {served.block}")
    levels = [int(c) for c in args.concurrency.split(",")]
    pairs = mixed_prompts(args.prompts + 8, seed=11)[8:]  # drafter_mix.py's held-out workload (its first 8 warm up)
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    ids = [tok.encode(t).ids for _, t in pairs]
    start_local_ray(num_cpus=8)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    cache = tempfile.mkdtemp(prefix="validate-")  # start-up profiles only: every engine starts from the prior
    for f in pathlib.Path("runs/cache").glob("cost_model_*.json"):
        shutil.copy(f, cache)

    def engine_of(name: str) -> Engine:
        if name == "default":
            s = ServeSettings(model_root=str(BUNDLED), max_running=max(levels), cost_model_cache=cache)
            return Engine(s.engine_config())
        drafter = ",".join(KINDS) if name in ("auto", "ar") else name
        s = ServeSettings(model_root=str(BUNDLED), drafter=drafter, block=args.block, max_running=max(levels),
                          policy="ar" if name == "ar" else "dcut", cost_model_cache=cache)
        return Engine(s.engine_config())

    auto = ServeSettings(model_root=str(BUNDLED), drafter=",".join(KINDS), block=args.block, max_running=max(levels),
                         cost_model_cache="runs/cache").engine_config()
    trace = record_trace(auto, ids, args.max_tokens, meta={"prompts": "mixed:11 held-out"})
    write_trace(trace, out / "heldout.trace")
    settings = {name: s for name, s in settings_of(trace).items() if not s.hindsight}  # what an engine can run
    if args.default:
        settings["default"] = dataclasses.replace(settings[served.drafter], load_block=served.load_block)
    engines = {name: engine_of(name) for name in settings}
    for e in engines.values():  # warm-up: lazy set-up and first calls, little learning
        closed_loop(e, ids[:2], 2, 8)
    prior = LearnedState.from_dict(json.loads(prior_of(auto.target_dir).read_text()))
    runs = []
    try:
        for rnd in range(args.rounds):
            names = list(settings)
            names = names[rnd % len(names):] + names[:rnd % len(names)]
            for c in levels:
                for name in names:
                    res = closed_loop(engines[name], ids, c, args.max_tokens)
                    measured = res.output_tokens / res.wall_s
                    runs.append({"round": rnd, "concurrency": c, "setting": name, "measured": measured,
                                 "mat": res.mat(), **time_split(res)})
                    print(json.dumps(runs[-1]), flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
        shutil.rmtree(cache, ignore_errors=True)
    rows = []
    for c in levels:
        sims = {name: simulate_trace(trace, s, c, prior) for name, s in settings.items()}  # from the bundle's prior
        for name, sim in sims.items():
            cell = [r for r in runs if r["concurrency"] == c and r["setting"] == name]
            meas = [r["measured"] for r in cell]
            ratios = [sim.tok_s / m for m in meas]
            # × `ar` in the same round: the machine's speed, which drifts 10–25 % between phases, cancels
            over_ar = [r["measured"] / next(a["measured"] for a in runs if a["round"] == r["round"]
                                            and a["concurrency"] == c and a["setting"] == "ar")
                       for r in runs if r["concurrency"] == c and r["setting"] == name]
            rows.append({"concurrency": c, "setting": name, "predicted": sim.tok_s, "measured": statistics.median(meas),
                         "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "x_ar_predicted": sim.tok_s / sims["ar"].tok_s, "x_ar_measured": statistics.median(over_ar),
                         "mat_predicted": sim.mat,
                         **{f"{k}_ratio": statistics.median(getattr(sim, SIM_PARTS[k]) / r[k] if r[k] else float("nan")
                                                            for r in cell) for k in PARTS},
                         "mat_measured": statistics.median(r["mat"] for r in runs
                                                           if r["concurrency"] == c and r["setting"] == name)})
        rows.append({"concurrency": c, "setting": "oracle", "predicted": oracle_run(trace, trace.kinds, c).tok_s})
    md = ["| C | setting | predicted tok/s | measured tok/s (median) | predicted / measured (range) "
          "| × `ar` pred / meas (ratio) | MAT pred / meas |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "measured" in r:
            md.append(f"| {r['concurrency']} | {r['setting']} | {r['predicted']:.0f} | {r['measured']:.0f} | "
                      f"{r['ratio']:.2f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                      f"{r['x_ar_predicted']:.2f} / {r['x_ar_measured']:.2f} "
                      f"({r['x_ar_predicted'] / r['x_ar_measured']:.2f}) | "
                      f"{r['mat_predicted']:.2f} / {r['mat_measured']:.2f} |")
        else:
            md.append(f"| {r['concurrency']} | hindsight oracle | {r['predicted']:.0f} | — | — | — | — |")
    md += ["", "| C | setting | steps | forward s | drafting s | rest s |  (predicted / measured, median of rounds)",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "measured" in r:
            md.append(f"| {r['concurrency']} | {r['setting']} | " + " | ".join(f"{r[f'{k}_ratio']:.2f}" for k in PARTS)
                      + " |")
    (out / "results.json").write_text(json.dumps({"runs": runs, "rows": rows, "args": vars(args)}, indent=1))
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
