"""Engine settings side by side on the replay target: every stage real, the forward modelled.

End-to-end runs on this machine scatter 10–25 % between rounds, more than most changes to a
decision or to the step's own Python are worth; the trace simulator (`dcut_core.trace_sim`) is
exact but models the step's own time as a fitted line. Between them: the real engine (the
scheduler, the look-ahead, the gate, the n-gram drafter, pruning, acceptance, commit, learning)
over `ReplayEngine` — the target's forward a lookup of the bundled model's greedy outputs that
sleeps what the real target's profile predicts for the step's shape. Decisions and own time are
the engine's; the forward's time is the profile's, the same in every round. Rounds of 3 here
agree within ±1.5 % (docs/benchmarks.md, session 31).

Each variant is a set of `ServeSettings` fields (`block`, `ngram_corpus_tokens`, `policy`, ...)
and `EngineConfig` fields (`drafting_gate`, ...) over `dcut serve`'s defaults with the n-gram
kind (the replay target makes no features for a neural kind); `ar` runs beside them. Per round
and concurrency, every variant on a fresh engine in turn (the order reversed every other round),
a closed loop over the prompts; outputs checked against the model's. Reported: tok/s over `ar`'s
in the same round (median and range of rounds), MAT, and variant over the first variant.

`--forward-split B,E`: the forward takes B × what the profile predicts for the step without its
extra tokens, plus E × what the profile says those tokens add — a target whose price of a drafted
token differs from its profile's, as the real one's does at 16–64 requests (docs/benchmarks.md,
session 36: a plain step ~0.85 ×, its extra tokens 1.4–1.8 × there); the engine is not told, and
learns it as it would serving. `--forward-model FILE`: the forward takes what a cost model's JSON
predicts (one fitted to a denser grid of the real target than the start-up profile's, say: a
truth whose shape the engine's profile may not share).

Prompts: a training draw of the mixed workload (seed 29 by default, never the reported seed 11).

    .venv/bin/python benchmarks/replay_ab.py \\
        --variants '{"gated": {}, "ungated": {"drafting_gate": false}}' --out runs/replay-ab
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


def split(settings: dict) -> tuple[dict, dict]:
    """(ServeSettings fields, EngineConfig fields) of a variant; ValueError naming any other."""
    from actors.engine.config import EngineConfig
    from deployments.settings import ServeSettings

    serve = {k: v for k, v in settings.items() if k in ServeSettings.model_fields}
    rest = {k: v for k, v in settings.items() if k not in serve}
    unknown = set(rest) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"not a ServeSettings or EngineConfig field: {', '.join(sorted(unknown))}")
    return serve, rest


def engine(settings: dict, concurrency: int, table: dict, forward, cache: str):
    """A fresh `ReplayEngine` as `dcut serve` builds one with `settings` (ServeSettings fields,
    then EngineConfig fields)."""
    from actors.engine.replay import ReplayEngine
    from deployments.settings import ServeSettings

    serve, rest = split(settings)
    cfg = ServeSettings(**{"max_running": concurrency, "cost_model_cache": cache, **serve}).engine_config()
    return ReplayEngine(dataclasses.replace(cfg, **rest), table, forward)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default='{"dcut": {}}', help="JSON: name -> settings over the defaults")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=29, help="the workload's draw (11 is the reported one: refused)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--forward-split", default="1,1",
                   help="B,E: a forward takes B × the profile's time of the step without its extra tokens and E × "
                        "what the profile says they add (1,1: the profile's time)")
    p.add_argument("--forward-model", default=None,
                   help="a cost model's JSON (dcut_core.cost_model.CostModel): a forward takes what it predicts "
                        "for the step's shape, times --forward-split's split of it")
    p.add_argument("--out", default="runs/replay-ab")
    args = p.parse_args()
    try:
        base_x, extra_x = (float(x) for x in args.forward_split.split(","))
        if min(base_x, extra_x) <= 0:
            raise ValueError
    except ValueError:
        p.error("--forward-split takes two positive numbers, B,E")
    if args.seed == 11:
        p.error("seed 11 draws the reported prompts: tune on a training draw")
    truth = None
    if args.forward_model is not None:
        from dcut_core.cost_model import CostModel

        try:
            truth = CostModel.from_json(pathlib.Path(args.forward_model).read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--forward-model {args.forward_model}: not a cost model's JSON ({exc})")
    variants = {"ar": {"policy": "ar"}, **json.loads(args.variants)}
    try:
        for settings in variants.values():
            split(settings)
    except ValueError as exc:
        p.error(str(exc))

    from tokenizers import Tokenizer

    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from benchmarks.coordinator import greedy_outputs
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings
    from deployments.trace_command import workload

    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in workload("mixed", args.num_prompts, args.seed, 11)]
    start_local_ray(num_cpus=4)
    table, model = greedy_outputs(prompts, args.max_tokens)
    model = truth or model
    cache = tempfile.mkdtemp(prefix="replay-ab-")  # the real target's profile; nothing learnt is saved
    for f in pathlib.Path(ServeSettings().cost_model_cache).glob("cost_model_*.json"):
        shutil.copy(f, cache)
    rows = []
    try:
        for rnd in range(args.rounds):
            for c in (int(x) for x in args.concurrency.split(",")):
                names = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
                for name in names:
                    eng = engine(variants[name], c, table, forward_split(model, base_x, extra_x), cache)
                    try:
                        res = closed_loop(eng, prompts, c, args.max_tokens)
                    finally:
                        eng.shutdown()
                    if any(o != table[tuple(q)] for o, q in zip(res.outputs, prompts, strict=True)):
                        raise AssertionError(f"{name} at C = {c}: an output differs from the model's greedy one")
                    rows.append({"variant": name, "concurrency": c, "round": rnd, "mat": res.mat(),
                                 "tok_s": res.output_tokens / res.wall_s})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"variants": variants, "rows": rows}, indent=1))
    table_md = render(rows, list(variants))
    (out / "table.md").write_text(table_md + "\n")
    print(table_md)
    return 0


def forward_split(model, base_x: float, extra_x: float):
    """The forward's time for a step's shape: `base_x` × the profile's time for its requests at one
    token each, plus `extra_x` × what the profile says its further tokens add."""
    if base_x == extra_x == 1.0:
        return model.predict

    def seconds(shape) -> float:
        base, extra = model.base_and_extra(shape)  # as the engine's online correction splits a step
        return base_x * base + extra_x * extra
    return seconds


def render(rows: list[dict], names: list[str]) -> str:
    """Per variant and concurrency: tok/s over `ar`'s and over the first variant's in the same
    round (median [range] of rounds), and MAT."""
    first = names[1] if len(names) > 1 else names[0]
    cell = {(r["variant"], r["concurrency"], r["round"]): r for r in rows}
    lines = [f"| variant | C | × `ar` | × {first} | MAT |", "|---|---|---|---|---|"]
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        rounds = sorted({r["round"] for r in rows if r["concurrency"] == c})
        for name in names[1:]:
            over_ar = [cell[name, c, k]["tok_s"] / cell["ar", c, k]["tok_s"] for k in rounds]
            over_first = [cell[name, c, k]["tok_s"] / cell[first, c, k]["tok_s"] for k in rounds]
            mat = statistics.median(cell[name, c, k]["mat"] for k in rounds)
            lines.append(f"| {name} | {c} | {_median_range(over_ar)} | {_median_range(over_first)} | {mat:.2f} |")
    return "\n".join(lines)


def _median_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}–{max(xs):.3f}]"


if __name__ == "__main__":
    sys.exit(main())
