"""`dcut simulate`: cluster-scale what-if runs of the coordinator loop (no weights, no Ray).

Without --model it reproduces the published D-Cut results (dcut_core/published.py explains the
procedure) and runs the MoE presets; with --model it runs one preset deployment:

    dcut simulate --out runs/simulate
    dcut simulate --model moe-295b-a21b --hardware h20 --ep 32 --batch 4,16,64 --block 16
    dcut simulate --model dense-8b --trace runs/steps.msgpack      # acceptance recorded by the engine
    dcut simulate --model-config cluster_configs/models/deepseek-v3.json --hardware h200 --ep 32
    dcut simulate --trace runs/train.trace --batch 1,4,16   # a counterfactual trace of `dcut trace`

Writes DIR/results.json (one record per policy × batch) and DIR/tables.md (markdown tables, the
published cells beside the simulated ones).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from dataclasses import dataclass

import numpy as np

from dcut_core.cost_model import preset
from dcut_core.drafting import DraftCost
from dcut_core.hardware import HARDWARE, MODELS, ModelShape
from dcut_core.own_time import MEASURED, OwnTime
from dcut_core.pruning import policy_from_name
from dcut_core.published import (
    BATCHES,
    DENSE_SPEEDUP,
    DENSE_VERIFY_MS,
    EQUAL_BUDGET,
    METHOD_NAMES,
    MOE_SPEEDUP,
    MOE_VERIFY_MS_B64,
    PUBLISHED_TRACE,
    equal_budget,
    fit_dense_ar,
    fit_trace,
)
from dcut_core.simulate import SimConfig, SimResult, simulate
from dcut_core.traces import RecordedTrace

OURS = ("dcut", "oracle")
MOE_DEPLOYMENTS = (("moe-35b-a3b", "h20", 8), ("moe-295b-a21b", "h20", 8), ("moe-295b-a21b", "h20", 32))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), help="model preset (default: reproduce the published results)")
    p.add_argument("--model-config", help="a checkpoint's config.json (or its folder) instead of a preset: the "
                                           "model's shape from it alone (any family `dcut serve` reads)")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h20")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (EP > 8 crosses nodes over RDMA)")
    p.add_argument("--batch", default=",".join(map(str, BATCHES)), help="concurrencies, comma-separated")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--policies", default="full,fixed-4,tetris,dcut-buckets,dcut,oracle")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request (cost-model presets)")
    p.add_argument("--trace", default="published",
                   help="'published' (fitted to the paper's equal-budget experiment), an engine step log, or a "
                        "counterfactual trace of `dcut trace` (then the engine's own decisions are replayed over "
                        "it at each --batch, beside the hindsight oracle)")
    p.add_argument("--refit", action="store_true", help="fit the published trace again (about a minute)")
    p.add_argument("--draft-ms", default="0,0,0", help="drafting cost: per call, per request, per draft (ms)")
    p.add_argument("--steps", type=int, help="steps per run (default: about 40 000 request-steps)")
    p.add_argument("--coordinator-times", help="results.json of benchmarks/coordinator.py: the engine's own time "
                                                "per step to add to every simulated step (default: the times "
                                                "measured on the project's CPU machine, dcut_core/own_time.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/simulate")


def _trace(args: argparse.Namespace):
    if args.trace != "published":
        from actors.engine.steplog import read_steps  # msgpack reader; no Ray involved

        return RecordedTrace.from_steps(read_steps(args.trace))
    if not args.refit:
        return PUBLISHED_TRACE
    trace, err = fit_trace()
    print(f"refitted trace: {trace} (worst equal-budget error {100 * err:.1f} %)")
    return trace


def _preset_costs(model: str | ModelShape, hardware: str, ep: int, context: int):
    cm = preset(model, hardware, ep)
    return (lambda b: cm.verify_curve(b, b * context)), (
        lambda b: float(cm.verify_curve(b, b * context).seconds(np.array([b]))[0]))


@dataclass(frozen=True)
class Simulated:
    """What one table simulates: a name, the acceptance trace, and the deployment's verify-step
    and plain-decoding-step costs (`simulate`'s arguments)."""

    label: str
    trace: object
    verify: object
    ar: object


def _run(sim: Simulated, policies, batches, block, args) -> list[SimResult]:
    a, b, c = (float(x) * 1e-3 for x in args.draft_ms.split(","))
    out = []
    for pol in policies:
        for batch in batches:
            cfg = SimConfig(batch, block, steps=args.steps, draft_cost=DraftCost(a, b, c), seed=args.seed)
            r = simulate(policy_from_name(pol, block), cfg, sim.trace, sim.verify, sim.ar)
            print(f"{sim.label:>28} {pol:>13} B={batch:<3} speedup {r.speedup:5.2f}  MAT {r.mat:5.2f}  "
                  f"keep {r.keep_ratio:4.2f}")
            out.append(r)
    return out


def _cells(results: list[SimResult], policy: str, block: int) -> list[SimResult]:
    return [r for r in results if r.policy == policy and r.block == block]


def _speedup_table(results, rows, published: dict | None) -> list[str]:
    lines = ["| method | " + " | ".join(f"B={b}" for b in BATCHES) + " |", "|---" * (len(BATCHES) + 1) + "|"]
    for pol, block in rows:
        sim = _cells(results, pol, block)
        name = f"{METHOD_NAMES.get(pol, 'ours: ' + pol)}-B{block}"
        pub = (published or {}).get((pol, block))
        if pub:
            cells = [f"{r.speedup:.2f} ({p:.2f}, {100 * (r.speedup / p - 1):+.0f} %)"
                     for r, p in zip(sim, pub, strict=True)]
        else:
            cells = [f"{r.speedup:.2f} (keep {r.keep_ratio:.2f})" for r in sim]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def reproduce(args: argparse.Namespace) -> tuple[list[SimResult], list[str]]:
    trace = _trace(args)
    glob, depth = equal_budget(trace, steps=1000, seed=args.seed)
    md = ["## Equal budget, B = 32, 512 slots (trace fit)", "",
          "| kept slots | global top-K: sim (published) | same depth: sim (published) |", "|---|---|---|"]
    for k, g, d, pg, pd in zip(EQUAL_BUDGET.kept, glob, depth, EQUAL_BUDGET.global_topk, EQUAL_BUDGET.same_depth,
                               strict=True):
        md.append(f"| {k} | {g:.1f} ({pg}) | {d:.1f} ({pd}) |")
    ar = fit_dense_ar(trace, args.steps, args.seed)
    md += ["", f"Trace: {trace}. AR step fitted to the DFlash-B16 row: {1e3 * ar.a:.2f} ms + "
           f"{1e3 * ar.b:.4f} ms × B.", "", "## Dense (Qwen3-8B class, H20, published verify table)", "",
           "Simulated speedup over AR (published, error):", ""]
    rows = [("full", 16), ("dcut-buckets", 16), ("dcut", 16), ("oracle", 16),
            ("full", 8), ("dcut-buckets", 8), ("dcut", 8), ("oracle", 8)]
    results = []
    for block in (16, 8):
        pols = [p for p, b in rows if b == block]
        results += _run(Simulated(f"dense table B{block}", trace, DENSE_VERIFY_MS.curve, ar), pols, BATCHES, block,
                        args)
    md += _speedup_table(results, rows, DENSE_SPEEDUP)
    md += ["", "## MoE presets (cost model from hardware and model presets, same trace)", ""]
    for model, hw, ep in MOE_DEPLOYMENTS:
        verify, ar_moe = _preset_costs(model, hw, ep, args.context)
        curve = verify(64).seconds(np.array([64 * n for n in (4, 8, 12, 16)])) * 1e3
        res = _run(Simulated(f"{model} {hw} EP{ep}", trace, verify, ar_moe), ["full", "dcut-buckets", "dcut", "oracle"],
                   BATCHES, 16, args)
        results += res
        md += [f"### {model}, {hw}, EP {ep}", "",
               f"Verify ms at B = 64, 25/50/75/100 % kept: {' / '.join(f'{x:.1f}' for x in curve)} "
               f"(100 %/25 % = {curve[-1] / curve[0]:.2f}; published Qwen3.5-35B-A3B TP2: "
               f"{' / '.join(map(str, MOE_VERIFY_MS_B64))}, {MOE_VERIFY_MS_B64[-1] / MOE_VERIFY_MS_B64[0]:.2f}; "
               f"dense table: {DENSE_VERIFY_MS.ms[-1][-1] / DENSE_VERIFY_MS.ms[-1][0]:.2f})", ""]
        md += _speedup_table(res, [("full", 16), ("dcut-buckets", 16), ("dcut", 16), ("oracle", 16)], None)
        pub = MOE_SPEEDUP.get(model, {})
        md += ["", "Published for this model class (TP, its own drafter and traffic): "
               + "; ".join(f"{METHOD_NAMES[p]}-B{b}: {' / '.join(map(str, v))}" for (p, b), v in pub.items()
                           if b == 16), ""]
    return results, md


def _own_time(args: argparse.Namespace) -> OwnTime:
    if not args.coordinator_times:
        return MEASURED
    return OwnTime.from_records(json.loads(pathlib.Path(args.coordinator_times).read_text()), args.coordinator_times)


def coordinator_share(results: list[SimResult], own: OwnTime) -> list[str]:
    """Markdown: per policy and batch, the simulated step, the coordinator's own time at that
    many requests, its share of the step, and the speed-up over plain decoding without and with
    both policies' own times added (plain decoding pays `ar`'s)."""
    md = ["", "### The coordinator's share of a step", "",
          f"Own time per step: {own.source}. Speed-up over plain decoding without / with every step's own time.",
          "", "| policy | B | step ms | coordinator ms | share | speed-up | with own time |",
          "|---|---|---|---|---|---|---|"]
    for batch in dict.fromkeys(r.batch for r in results):  # plain decoding's, once per batch
        ar_s = next(r.ar_seconds for r in results if r.batch == batch)
        mine = own.ms("ar", batch) * 1e-3
        md.append(f"| ar | {batch} | {1e3 * ar_s:.2f} | {1e3 * mine:.2f} | {mine / (ar_s + mine):.1%} | 1.00 | 1.00 |")
    for r in results:
        step = r.seconds / r.steps
        mine, plain = own.ms(r.policy, r.batch) * 1e-3, own.ms("ar", r.batch) * 1e-3
        with_own = (r.tokens / (r.seconds + r.steps * mine)) / (r.batch / (r.ar_seconds + plain))
        md.append(f"| {r.policy} | {r.batch} | {1e3 * step:.2f} | {1e3 * mine:.2f} | {mine / (step + mine):.1%} | "
                  f"{r.speedup:.2f} | {with_own:.2f} |")
    return md


def run(args: argparse.Namespace) -> int:
    from deployments.trace_command import is_trace
    from deployments.trace_command import simulate as simulate_trace

    if args.trace != "published" and is_trace(args.trace):
        return simulate_trace(args.trace, [int(b) for b in args.batch.split(",")], args.out)
    t0 = time.time()
    model = args.model
    if args.model_config:
        from actors.target.config import model_shape

        model = model_shape(args.model_config)
        print(f"{model.name}: {model.total_params / 1e9:.1f} B parameters, {model.active_params / 1e9:.1f} B active, "
              f"{model.layers * model.kv_per_token * model.act_bytes / 1024:.1f} KiB of KV per token")
    if model is None:
        results, md = reproduce(args)
    else:
        label = model if isinstance(model, str) else model.name
        verify, ar = _preset_costs(model, args.hardware, args.ep, args.context)
        batches = [int(b) for b in args.batch.split(",")]
        policies = [p for p in args.policies.split(",") if p]
        results = _run(Simulated(f"{label} {args.hardware} EP{args.ep}", _trace(args), verify, ar), policies, batches,
                       args.block, args)
        md = [f"## {label}, {args.hardware}, EP {args.ep}, block {args.block}", "",
              "| policy | " + " | ".join(f"B={b}" for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
        for pol in policies:
            cells = [r for r in results if r.policy == policy_from_name(pol, args.block).name]
            md.append(f"| {pol} | " + " | ".join(f"{r.speedup:.2f} (keep {r.keep_ratio:.2f})" for r in cells) + " |")
        md += coordinator_share(results, _own_time(args))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps([r.record() for r in results], indent=1))
    (out / "tables.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'results.json'} and {out / 'tables.md'} in {time.time() - t0:.0f} s")
    return 0
