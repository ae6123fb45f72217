"""Drafter kinds on a mixed workload: each kind alone against every kind in one pool, chosen per
request (`auto`), on code, docstring, comment and documentation prompts held out from training.

    .venv/bin/python benchmarks/drafter_mix.py [--rounds 2] [--concurrency 1,4,16] [--out runs/drafter-mix]
        [--model BUNDLE]

One engine per setting (`ar`: plain decoding; `block`, `mtp`, `ngram`, and `eagle3` when the
bundle holds one: that kind alone; `auto`: all of them hosted, the gate choosing per request and
step), all in this process on the bundled demo model (or --model), the `dcut` policy. Every
round runs every setting on the same prompts, in a rotated order, at each concurrency: the mixed
workload, then each domain alone. A row is a setting's median over rounds; speed-ups are medians
of ratios within a round. Greedy outputs of every setting must equal `ar`'s (checked). Writes
OUT/results.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SETTINGS = {"ar": "block", "block": "block", "mtp": "mtp", "ngram": "ngram", "auto": "auto"}
SINGLE = ("block", "mtp", "eagle3", "ngram")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--domain-concurrency", default="4", help="levels at which each domain also runs alone")
    p.add_argument("--prompts", type=int, default=24, help="prompts of the mixed workload per level (≥ 2·C used)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--out", default="runs/drafter-mix")
    p.add_argument("--model", help="a bundle folder (default: the bundled demo)")
    args = p.parse_args()

    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from deployments.bench_command import kinds_chosen
    from deployments.bundle import BUNDLED, Bundle
    from deployments.settings import ServeSettings
    from deployments.workload import DOMAINS, mixed_prompts

    root = pathlib.Path(args.model) if args.model else BUNDLED
    if Bundle(root).has("eagle3"):
        SETTINGS["eagle3"] = "eagle3"

    levels = [int(c) for c in args.concurrency.split(",")]
    domain_levels = {int(c) for c in args.domain_concurrency.split(",") if c}
    n_max = max(args.prompts, 2 * max(levels))
    pairs = mixed_prompts(n_max + 8, seed=11)
    warm, pairs = pairs[:8], pairs[8:]
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    ids = [tok.encode(t).ids for _, t in pairs]
    domains = [d for d, _ in pairs]
    start_local_ray(num_cpus=8)
    engines = {}
    for name, drafter in SETTINGS.items():
        s = ServeSettings(model_root=str(root), drafter=drafter, block=args.block, max_running=max(levels),
                          policy="ar" if name == "ar" else "dcut", cost_model_cache="runs/cache")
        engines[name] = Engine(s.engine_config())
        closed_loop(engines[name], [tok.encode(t).ids for _, t in warm], 4, args.max_tokens)  # warm-up, learning
    runs = []
    try:
        for rnd in range(args.rounds):
            for c in levels:
                n = max(args.prompts, 2 * c)
                work = {"mixed": list(range(n))}
                if c in domain_levels:
                    work |= {d: [i for i in range(len(ids)) if domains[i] == d][:max(c, n // 2)] for d in DOMAINS}
                for workload, which in work.items():
                    names = list(SETTINGS)
                    names = names[rnd % len(names):] + names[:rnd % len(names)]  # rotated order per round
                    outputs = {}
                    for name in names:
                        eng = engines[name]
                        res = closed_loop(eng, [ids[i] for i in which], c, args.max_tokens)
                        outputs[name] = res.outputs
                        row = {"round": rnd, "concurrency": c, "workload": workload, "setting": name,
                               "tok_s": res.output_tokens / res.wall_s, "mat": res.mat(),
                               "kinds_chosen": kinds_chosen(res, eng.kinds)}
                        if workload == "mixed":
                            for d in DOMAINS:
                                mine = [j for j, i in enumerate(which) if domains[i] == d]
                                row[f"mat_{d}"] = res.mat(mine)
                                row[f"chosen_{d}"] = kinds_chosen(res, eng.kinds, mine)
                        runs.append(row)
                        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                                          if not k.startswith("chosen_")}), flush=True)
                    lossless = all(o == outputs["ar"] for o in outputs.values())
                    for r in runs[-len(names):]:
                        r["lossless"] = lossless
    finally:
        for e in engines.values():
            e.shutdown()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs)
    (out / "results.json").write_text(json.dumps({"runs": runs, "rows": rows, "args": vars(args)}, indent=1))
    print(tables(rows))
    return 0 if all(r["lossless"] for r in runs) else 1


def summarize(runs: list[dict]) -> list[dict]:
    """Per (workload, concurrency, setting): median tok/s and MAT over rounds, the median of the
    per-round ratios to `ar` and to the best single kind of that round."""
    rows = []
    keys = sorted({(r["workload"], r["concurrency"]) for r in runs})
    for workload, c in keys:
        mine = [r for r in runs if r["workload"] == workload and r["concurrency"] == c]
        by_round: dict[int, dict[str, dict]] = {}
        for r in mine:
            by_round.setdefault(r["round"], {})[r["setting"]] = r
        for setting in SETTINGS:
            rs = [rd[setting] for rd in by_round.values()]
            vs_ar = [rd[setting]["tok_s"] / rd["ar"]["tok_s"] for rd in by_round.values()]
            vs_best = [rd[setting]["tok_s"] / max(rd[k]["tok_s"] for k in SINGLE if k in rd)
                       for rd in by_round.values()]
            row = {"workload": workload, "concurrency": c, "setting": setting,
                   "tok_s": statistics.median(r["tok_s"] for r in rs), "mat": statistics.median(r["mat"] for r in rs),
                   "vs_ar": statistics.median(vs_ar), "vs_ar_runs": [round(v, 3) for v in vs_ar],
                   "vs_best_single": statistics.median(vs_best), "vs_best_runs": [round(v, 3) for v in vs_best],
                   "lossless": all(r["lossless"] for r in rs)}
            if setting == "auto":
                row["kinds_chosen"] = rs[-1]["kinds_chosen"]
                row |= {k: v for k, v in rs[-1].items() if k.startswith("chosen_")}
            row |= {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.startswith("mat_")}
            rows.append(row)
    return rows


def tables(rows: list[dict]) -> str:
    kinds = [k for k in SINGLE if k in SETTINGS]
    lines = [f"| workload | C | setting | tok/s | × ar | × best single | MAT | auto's choice ({'/'.join(kinds)}) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chosen = r.get("kinds_chosen")
        share = "/".join(f"{chosen.get(k, 0):.2f}" for k in kinds) if chosen else ""
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['setting']} | {r['tok_s']:.1f} | {r['vs_ar']:.2f} "
                     f"{r['vs_ar_runs']} | {r['vs_best_single']:.2f} {r['vs_best_runs']} | {r['mat']:.2f} | {share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
