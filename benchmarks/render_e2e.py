"""Render `dcut bench` results (results.json) as the markdown tables of docs/benchmarks.md.

    .venv/bin/python benchmarks/render_e2e.py runs/bench_e2e/results.json
"""

from __future__ import annotations

import argparse
import json
import pathlib

BREAKDOWN_POLICIES = ("ar", "full", "dcut")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=pathlib.Path)
    rows = json.loads(p.parse_args().results.read_text())
    print(throughput_table(rows), goals_table(rows), breakdown_table(rows), sep="\n\n")


def throughput_table(rows: list[dict]) -> str:
    out = ["| policy | C | output tok/s | speed-up vs ar | MAT | verify tokens/step | keep ratio "
           "| TPOT p50 / p99 ms | TTFT p50 ms | overhead % | lossless |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['policy']} | {r['concurrency']} | {r['output_tok_s']:.0f} | {r['speedup_vs_ar']:.2f} "
                   f"| {r['mat']:.2f} | {r['verify_tokens_per_step']:.1f} | {r['keep_ratio']:.2f} "
                   f"| {r['tpot_ms_p50']:.0f} / {r['tpot_ms_p99']:.0f} | {r['ttft_ms_p50']:.0f} "
                   f"| {100 * r['overhead_frac']:.0f} | {'yes' if r['lossless'] else '**no**'} |")
    return "\n".join(out)


def goals_table(rows: list[dict]) -> str:
    levels = sorted({r["concurrency"] for r in rows})
    at = {(r["policy"], r["concurrency"]): r["output_tok_s"] for r in rows}

    def mark(ok: bool) -> str:
        return "✓" if ok else "**✗**"

    ar, fixed, full, oracle, buckets = [], [], [], [], []
    for c in levels:
        d = at.get(("dcut", c))
        best_k, best = max(((p, v) for (p, cc), v in at.items() if cc == c and p.startswith("fixed-")),
                           key=lambda kv: kv[1])
        ar.append(f"{d / at[('ar', c)]:.2f} {mark(d >= at[('ar', c)])}")
        fixed.append(f"{d / best:.2f} × {best_k} {mark(d >= 0.98 * best)}")
        full.append(f"{d / at[('full', c)]:.2f}" + (f" {mark(d >= 1.3 * at[('full', c)])}" if c == 64 else ""))
        oracle.append(f"{100 * d / at[('oracle', c)]:.0f} %")
        buckets.append(f"{d / at[('dcut-buckets', c)]:.2f}")
    head = "| goal | " + " | ".join(f"C = {c}" for c in levels) + " |"
    lines = [head, "|---|" + "---|" * len(levels),
             "| `dcut` ≥ `ar` | " + " | ".join(ar) + " |",
             "| `dcut` ≥ 0.98 × best `fixed-K` | " + " | ".join(fixed) + " |",
             "| `dcut` / `full` (goal ≥ 1.3 at 64) | " + " | ".join(full) + " |",
             "| `dcut` / `oracle` | " + " | ".join(oracle) + " |",
             "| `dcut` / `dcut-buckets` | " + " | ".join(buckets) + " |"]
    return "\n".join(lines)


def breakdown_table(rows: list[dict]) -> str:
    out = ["| policy | C | step ms | target forward ms | drafter forward ms | overhead ms | overhead % "
           "| decision ms | cost-model error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["policy"] not in BREAKDOWN_POLICIES:
            continue
        over = r["step_ms_mean"] - r["target_compute_ms_mean"] - r["draft_compute_ms_mean"]
        out.append(f"| {r['policy']} | {r['concurrency']} | {r['step_ms_mean']:.1f} "
                   f"| {r['target_compute_ms_mean']:.1f} "
                   f"| {r['draft_compute_ms_mean']:.1f} | {max(0.0, over):.1f} | {100 * r['overhead_frac']:.0f} "
                   f"| {r['decision_ms_mean']:.2f} | {r['cost_model_error']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
