"""Render `dcut bench` results (results.json) as the markdown tables of docs/benchmarks.md.

    .venv/bin/python benchmarks/render_e2e.py runs/bench_e2e/results.json

With `--repeats`, the bench also writes results_runs.json (every round); the goals table then
takes, for each ratio, the median over rounds of the ratio within a round.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

BREAKDOWN_POLICIES = ("ar", "full", "dcut")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=pathlib.Path)
    path = p.parse_args().results
    rows = json.loads(path.read_text())
    runs_path = path.with_name("results_runs.json")
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else [r | {"repeat": 0} for r in rows]
    print(throughput_table(rows), goals_table(runs), breakdown_table(rows), sep="\n\n")


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


def goals_table(runs: list[dict]) -> str:
    """Each ratio is taken within a round (runs minutes apart), then the median over rounds."""
    levels = sorted({r["concurrency"] for r in runs})
    rounds = sorted({r["repeat"] for r in runs})
    at = {(r["policy"], r["concurrency"], r["repeat"]): r["output_tok_s"] for r in runs}

    def mark(ok: bool) -> str:
        return "✓" if ok else "**✗**"

    def ratio(p: str, c: int) -> float:
        return statistics.median(at[("dcut", c, k)] / at[(p, c, k)] for k in rounds)

    def best_fixed(c: int) -> tuple[float, str]:
        per_round = []
        for k in rounds:
            name, tok = max(((p, v) for (p, cc, kk), v in at.items() if cc == c and kk == k and p.startswith("fixed-")),
                            key=lambda kv: kv[1])
            per_round.append((at[("dcut", c, k)] / tok, name))
        per_round.sort()
        return per_round[(len(per_round) - 1) // 2]

    ar, fixed, full, oracle, buckets = [], [], [], [], []
    for c in levels:
        ar.append(f"{ratio('ar', c):.2f} {mark(ratio('ar', c) >= 1.0)}")
        f, name = best_fixed(c)
        fixed.append(f"{f:.2f} × {name} {mark(f >= 0.98)}")
        full.append(f"{ratio('full', c):.2f}" + (f" {mark(ratio('full', c) >= 1.3)}" if c == 64 else ""))
        oracle.append(f"{100 * ratio('oracle', c):.0f} %")
        buckets.append(f"{ratio('dcut-buckets', c):.2f}")
    head = "| goal | " + " | ".join(f"C = {c}" for c in levels) + " |"
    lines = [head, "|---|" + "---|" * len(levels),
             "| `dcut` / `ar` (goal ≥ 1) | " + " | ".join(ar) + " |",
             "| `dcut` / best `fixed-K` (goal ≥ 0.98) | " + " | ".join(fixed) + " |",
             "| `dcut` / `full` (goal ≥ 1.3 at 64) | " + " | ".join(full) + " |",
             "| `dcut` / `oracle` | " + " | ".join(oracle) + " |",
             "| `dcut` / `dcut-buckets` | " + " | ".join(buckets) + " |"]
    if len(rounds) > 1:
        lines.append(f"\nMedians over {len(rounds)} rounds; each ratio within one round.")
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
