"""Which configuration should `dcut serve` default to? (issue #24, items 5 and 6)

End to end on the held-out mixed workload (nothing here was tuned on it), EP 1, greedy, 48 new
tokens, every engine built as `dcut serve` builds it: plain decoding, the previous default
(`block` drafter, block 16) and the candidates the trace simulator ranks best on training
prompts. Each (round, setting, concurrency) gets a fresh engine whose learned state starts
empty (it may still read the bundle's prior): its first run is `cold`, a second run of the same
prompts `warm` (the n-gram kind's corpus of earlier outputs emptied first: loadgen). Rounds
rotate the settings' order; the tables give medians of per-round ratios to `ar` and their range.

    .venv/bin/python benchmarks/defaults.py --rounds 3 --out runs/defaults

`--paired GROUPS` instead builds every setting's engine once per level, in one process, and runs
the prompts group by group (GROUPS groups of max(--prompts / GROUPS, 4·C) prompts),
every engine in turn on the same group, the order reversed each group: the machine's phase (10–25 %
between rounds of fresh processes here) falls on every engine alike, and a group's ratio is read
within seconds. Each engine's first group is its cold start; it learns on from there (warm).

    .venv/bin/python benchmarks/defaults.py --paired 12 --concurrency 1,4 --settings default,ngram-8
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()

SETTINGS = {  # name: (drafter, block, policy[, other ServeSettings fields])
    "ar": ("block", 8, "ar"),
    "block-16 (old default)": ("block", 16, "dcut"),
    "auto-8": ("auto", 8, "dcut"),
    "mtp-8": ("mtp", 8, "dcut"),
    "ngram-8": ("ngram", 8, "dcut"),
    "ngram-12": ("ngram", 12, "dcut"),  # a longer block for the n-gram default (docs/benchmarks.md, session 50)
    "ngram-16": ("ngram", 16, "dcut"),
    "ngram-16/8": ("ngram", 16, "dcut", {"load_block": (5, 8)}),  # block 16 up to 5 decoding requests, 8 above
    "default": ("ngram", None, "dcut"),  # `dcut serve`'s: block 16 while one request decodes alone, 8 above
    "ngram-8 unchecked": ("ngram", 8, "dcut", {"payoff_check": False}),  # the gate alone (dcut_core/payoff.py)
    "tuned-8": ("tuned", 8, "dcut"),  # the kinds the bundle's prior names (MTP + n-gram for the demo)
    # Fixed depths: the n-gram kind's drafts verified whole every step, up to K (`full`, no gate, no
    # pruning) — the static choices issue #24's goal says the default must not lose to.
    "ngram-fixed-1": ("ngram", 2, "full"),
    "ngram-fixed-2": ("ngram", 3, "full"),
    "ngram-fixed-4": ("ngram", 5, "full"),
    "ngram-fixed-7": ("ngram", 8, "full"),
}


def _engine(setting: tuple, max_running: int, cache: str):
    """An engine built as `dcut serve` builds it, its learned state in `cache` (start-up profiles
    copied in from runs/cache: cost_model_*.json)."""
    from actors.engine.coordinator import Engine
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings

    drafter, block, policy, *more = setting
    for f in pathlib.Path("runs/cache").glob("cost_model_*.json"):
        shutil.copy(f, cache)
    s = ServeSettings(model_root=str(BUNDLED), drafter=drafter, block=block, policy=policy,
                      max_running=max_running, cost_model_cache=cache, **(more[0] if more else {}))
    return Engine(s.engine_config())


def _paired(args, chosen: dict, levels: list[int], per_level: dict[int, int], ids: list[list[int]]) -> int:
    """Every setting's engine built once per level; the prompts run group by group, every engine on
    the same group in turn, the order reversed each group. Ratios to `ar` and to the first setting
    named (`--settings`): tokens over seconds of all groups, and the median and range of the
    groups' own ratios."""
    from actors.engine.loadgen import closed_loop

    rows, lossless = [], True
    for c in levels:
        per = per_level[c] // args.paired
        names = list(chosen)
        with tempfile.TemporaryDirectory() as root:
            engines = {}
            try:
                for i, name in enumerate(names):
                    cache = pathlib.Path(root) / str(i)
                    cache.mkdir()
                    engines[name] = _engine(chosen[name], c, str(cache))
                groups = {n: [] for n in names}  # (tokens, seconds, mat) a group
                for g in range(args.paired):
                    batch = ids[g * per:(g + 1) * per]
                    outputs = {}
                    for name in (names if g % 2 == 0 else names[::-1]):
                        res = closed_loop(engines[name], batch, c, args.max_tokens)
                        groups[name].append((res.output_tokens, res.wall_s, res.mat()))
                        outputs[name] = res.outputs
                    lossless &= all(o == outputs["ar"] for o in outputs.values())
            finally:
                for e in engines.values():
                    e.shutdown()
        first = names[1] if len(names) > 1 else "ar"  # the first setting named: the other ratios' base
        for name in names:
            mine = groups[name]
            rows.append({"concurrency": c, "setting": name, "prompts_a_group": per, "groups": args.paired,
                         "tok_s": sum(t for t, _, _ in mine) / sum(s for _, s, _ in mine),
                         "group_tok_s": [t / s for t, s, _ in mine],
                         **_over(mine, groups["ar"], "ar"), **_over(mine, groups[first], "first"), "first": first,
                         "mat": statistics.median(m for _, _, m in mine)})
            print(json.dumps(rows[-1]), flush=True)
    md = ["| C | setting | tok/s | × `ar` (all groups) | first group (cold) | groups' median (range) "
          "| × the first named (all groups) | groups' median (range) | MAT |", "|---" * 9 + "|"]
    md += [f"| {r['concurrency']} | {r['setting']} | {r['tok_s']:.0f} | {r['x_ar']:.3f} | {r['cold_x_ar']:.2f} | "
           f"{r['ar_median']:.3f} ({r['ar_min']:.2f}–{r['ar_max']:.2f}) | {r['x_first']:.3f} | "
           f"{r['first_median']:.3f} ({r['first_min']:.2f}–{r['first_max']:.2f}) | {r['mat']:.2f} |" for r in rows]
    md.append(f"\nEvery setting's output equal to `ar`'s in every group: {lossless}.")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if lossless else 1


def _over(mine: list[tuple], base: list[tuple], key: str) -> dict:
    """One setting's groups (tokens, seconds, MAT) over another's: tokens over seconds of all
    groups, the first group's ratio (cold engines), and the median and range of the groups'."""
    by_group = [(t / s) / (bt / bs) for (t, s, _), (bt, bs, _) in zip(mine, base, strict=True)]
    whole = (sum(t for t, _, _ in mine) / sum(s for _, s, _ in mine)) / (sum(t for t, _, _ in base) /
                                                                        sum(s for _, s, _ in base))
    return {f"x_{key}": whole, f"cold_x_{key}": by_group[0], f"{key}_median": statistics.median(by_group),
            f"{key}_min": min(by_group), f"{key}_max": max(by_group)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--prompts", type=int, default=32,
                   help="held-out prompts a level runs at least; a level of C runs max(this, 4·C): a closed loop "
                        "of C over fewer than 4·C prompts spends much of its run in the first wave's prefill and "
                        "the last wave's tail (session 35's 'C = 64' with 32 prompts ran 32 at once, one wave)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="runs/defaults")
    p.add_argument("--paired", type=int, default=0, metavar="GROUPS",
                   help="one engine a setting, prompt groups alternated between them (see above); 0: rounds")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated names from SETTINGS (ar is always run: the ratios' base)")
    args = p.parse_args()
    chosen = {"ar": SETTINGS["ar"]} | {n: SETTINGS[n] for n in args.settings.split(",") if n and n != "ar"}

    from tokenizers import Tokenizer

    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from deployments.bundle import BUNDLED
    from deployments.workload import mixed_prompts

    levels = [int(c) for c in args.concurrency.split(",")]
    per_level = {c: max(args.prompts, 4 * c) for c in levels}
    if args.paired:  # whole groups, each a closed loop over at least 4·C prompts (more than one wave)
        per_level = {c: args.paired * max(4 * c, n // args.paired) for c, n in per_level.items()}
    pairs = mixed_prompts(max(per_level.values()) + 8, seed=11)[8:]
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    ids = [tok.encode(t).ids for _, t in pairs]
    start_local_ray(num_cpus=8)
    if args.paired:
        return _paired(args, chosen, levels, per_level, ids)
    runs = []
    for rnd in range(args.rounds):
        names = list(chosen)
        names = names[rnd % len(names):] + names[:rnd % len(names)]
        for c in levels:
            for name in names:
                with tempfile.TemporaryDirectory() as cache:
                    eng = _engine(chosen[name], max(levels), cache)
                    try:
                        for phase in ("cold", "warm"):
                            res = closed_loop(eng, ids[:per_level[c]], c, args.max_tokens)
                            runs.append({"round": rnd, "concurrency": c, "setting": name, "phase": phase,
                                         "tok_s": res.output_tokens / res.wall_s, "mat": res.mat(),
                                         "outputs": res.outputs})
                            print(json.dumps({k: v for k, v in runs[-1].items() if k != "outputs"}), flush=True)
                    finally:
                        eng.shutdown()
    lossless = all(r["outputs"] == next(x["outputs"] for x in runs if x["setting"] == "ar" and
                                        x["concurrency"] == r["concurrency"]) for r in runs)
    rows = []
    for c in levels:
        for phase in ("cold", "warm"):
            for name in chosen:
                ratios = []
                for rnd in range(args.rounds):
                    mine = [r for r in runs if (r["round"], r["concurrency"], r["phase"]) == (rnd, c, phase)]
                    by = {r["setting"]: r["tok_s"] for r in mine}
                    ratios.append(by[name] / by["ar"])
                ar = statistics.median(r["tok_s"] for r in runs if (r["concurrency"], r["phase"], r["setting"]) ==
                                       (c, phase, "ar"))
                rows.append({"concurrency": c, "phase": phase, "setting": name, "x_ar": statistics.median(ratios),
                             "min": min(ratios), "max": max(ratios), "ar_tok_s": ar})
    md = ["| C | phase | `ar` tok/s | " + " | ".join(n for n in chosen if n != "ar") + " |",
          "|---" * (len(chosen) + 2) + "|"]
    for c in levels:
        for phase in ("cold", "warm"):
            cells = [r for r in rows if (r["concurrency"], r["phase"]) == (c, phase)]
            md.append(f"| {c} | {phase} | {cells[0]['ar_tok_s']:.0f} | " + " | ".join(
                f"{r['x_ar']:.2f} ({r['min']:.2f}–{r['max']:.2f})" for r in cells if r["setting"] != "ar") + " |")
    md.append(f"\nEvery setting's output equal to `ar`'s in every run: {lossless}.")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": [{k: v for k, v in r.items() if k != "outputs"}
                                                            for r in runs], "rows": rows, "args": vars(args)},
                                                 indent=1))
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
