"""Tuning the kind chooser on exact replays of several training traces (issue #24).

One training trace is one draw of prompts in one order, and a closed loop over it is chaotic:
one setting's cell moves by ±3 % when nothing but the order of requests changes. So a chooser
setting is judged over several training traces (the mixed workload's draws with seeds 23, 29,
31, ..., never the reported seed-11 prompts), each replayed in three request orders, at C = 1,
4, 16: per cell, `auto`'s tok/s over the best single kind's under the same setting; reported as
the geometric mean over the cells and its minimum. The held-out trace (the reported prompts) is
scored last with the settings as they are, never to choose between them.

Variants (each relative to its own single kinds; the first two replay older engines' settings
with today's chooser):
- before: no n-gram look-ahead; a request's factor shrunk toward 1 with 0.5 tokens of evidence
  at the global rate (session 14's engine);
- look-ahead: the n-gram kind drafted for every request before the gate (it knows what n-gram
  can draft, and n-gram learns from every step);
- now: the look-ahead, 4 more tokens of shrinkage that fade with the request's own
  verifications (0.5 + 4 / (1 + n): `AcceptanceTracker.shrink`), and the kind chooser's bonus
  over the unit (1 token: `DraftingGate.bonus`; session 16);
- no bonus: `now` without exploration (a kind the unit knows nothing of is never tried).

    .venv/bin/python benchmarks/chooser_tuning.py --train runs/train23.trace,runs/train29.trace,\\
        runs/train31.trace --heldout runs/heldout.trace --out runs/chooser-tuning    # about 5 minutes

Session 19's caution, at C = 1, 4, 16, 64 in two orders (`--variants` replaces the variants above):

    .venv/bin/python benchmarks/chooser_tuning.py --train runs/train23.trace,runs/train29.trace,\\
        runs/train31.trace --levels 1,4,16,64 --orders 2 \\
        --variants '{"caution 0": {"caution": 0}, "caution 1": {"caution": 1}}' --out runs/chooser-caution

(`dcut trace --workload mixed --seed S --num-prompts 32 --out runs/trainS.trace` records a
training trace; `benchmarks/trace_validate.py` records the held-out one as
runs/…/heldout.trace.)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dcut_core.trace_sim import SimSettings, shuffled, simulate_trace

LEVELS = (1, 4, 16)
ORDERS = 3
VARIANTS = {"before": {"lookahead": False, "shrink": 0.0}, "look-ahead": {"lookahead": True, "shrink": 0.0},
            "now": {"lookahead": True, "shrink": 4.0}, "no bonus": {"bonus": 0.0}}


def cells(traces: list, variant: dict, prior, levels=LEVELS, n_orders: int = ORDERS) -> list[dict]:
    """Per (trace, order, C): auto, each single kind and `ar` (tok/s) under one variant."""
    out = []
    for t, trace in enumerate(traces):
        for o, tr in enumerate(shuffled(trace, n_orders)):
            for c in levels:
                row = {"trace": t, "order": o, "concurrency": c}
                for name, kinds in (*((k, (k,)) for k in tr.kinds), ("auto", tuple(tr.kinds))):
                    row[name] = simulate_trace(tr, SimSettings(kinds=kinds, **variant), c, prior).tok_s
                row["ar"] = simulate_trace(tr, SimSettings(policy="ar", kinds=tr.kinds[:1]), c, prior).tok_s
                row["auto / best"] = row["auto"] / max(row[k] for k in tr.kinds)
                out.append(row)
    return out


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


def summary(rows: list[dict]) -> dict:
    levels = sorted({r["concurrency"] for r in rows})
    by_c = {c: geo(r["auto / best"] for r in rows if r["concurrency"] == c) for c in levels}
    kinds = [k for k in rows[0] if k not in ("trace", "order", "concurrency", "ar", "auto / best")]
    per_ar = {k: {c: geo(r[k] / r["ar"] for r in rows if r["concurrency"] == c) for c in levels} for k in kinds}
    return {"geo": geo(r["auto / best"] for r in rows), "min": min(r["auto / best"] for r in rows), "by_c": by_c,
            "x_ar": per_ar}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="training traces, comma-separated")
    p.add_argument("--heldout", help="a trace of the reported prompts (scored, never tuned on)")
    p.add_argument("--out", default="runs/chooser-tuning")
    p.add_argument("--variants", help='JSON {name: SimSettings fields}, e.g. \'{"no caution": {"caution": 0}}\' '
                   "(default: the variants above)")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies, comma-separated")
    p.add_argument("--orders", type=int, default=ORDERS, help="request orders per trace")
    args = p.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    levels = [int(c) for c in args.levels.split(",")]
    from actors.engine.warm import prior_of
    from dcut_core.learned import LearnedState
    from deployments.bundle import BUNDLED
    from deployments.trace_command import read_trace

    prior = LearnedState.from_dict(json.loads(prior_of(str(BUNDLED / "target")).read_text()))
    train = [read_trace(t) for t in args.train.split(",")]
    held = [read_trace(args.heldout)] if args.heldout else []
    results = {}
    for name, variant in variants.items():
        results[name] = {"training": summary(cells(train, variant, prior, levels, args.orders))}
        if held:
            results[name]["held-out"] = summary(cells(held, variant, prior, levels, args.orders))
        print(name, json.dumps(results[name]), flush=True)
    md = ["| variant | traces | auto / best single kind: geo-mean (min) | " + " | ".join(f"C = {c}" for c in levels)
          + " | n-gram × `ar`, C = " + " / ".join(map(str, levels)) + " |", "|---" * (4 + len(levels)) + "|"]
    for name, res in results.items():
        for which, s in res.items():
            ng = s["x_ar"].get("ngram", {})
            md.append(f"| {name} | {which} | {s['geo']:.3f} ({s['min']:.2f}) | "
                      + " | ".join(f"{s['by_c'][c]:.3f}" for c in levels) + " | "
                      + " / ".join(f"{ng[c]:.2f}" for c in levels) + " |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
