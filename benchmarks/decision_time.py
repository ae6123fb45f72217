"""Micro-benchmark: how long one D-Cut decision takes (sort, scan, cost curve, kept counts).

    .venv/bin/python benchmarks/decision_time.py [--repeats N] [--out DIR]

Prints a markdown table and writes DIR/decision_time.json. The cost curve is the CPU preset
of the demo-sized MoE target, evaluated at every budget as the engine does each step; the
public call (`choose_kept`) gets the same curve as a callable and a 2-D array of survivals.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import numpy as np

from dcut_core.acceptance import survival
from dcut_core.cost_model import preset
from dcut_core.decision import choose_kept
from dcut_core.hardware import ModelShape
from dcut_core.pruning import Dcut, DraftBatch, Full, Tetris
from dcut_core.ragged import offsets_from_lengths

DEMO = ModelShape("demo-moe", 6, 256, 4, 2, 64, 4096, 0, experts=8, top_k=2,
                  expert_intermediate=512, moe_layers=6, param_bytes=4, act_bytes=4)
SHAPES = ((64, 16), (1024, 32), (4096, 16))  # the last: one wide-EP unit


def make_batch(rng: np.random.Generator, requests: int, drafts: int) -> DraftBatch:
    cu = offsets_from_lengths(np.full(requests, drafts))
    p = rng.beta(4.0, 1.5, requests * drafts)  # per-draft acceptance estimates, mean ≈ 0.73
    return DraftBatch(survival(p, cu), cu)


def time_policy(policy, batch: DraftBatch, cost_model, repeats: int) -> np.ndarray:
    r = batch.num_requests
    out = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        cost = cost_model.verify_curve(r, r * 512)  # built per step: R and context change
        policy.choose(batch, cost)
        out[i] = time.perf_counter() - t0
    return out


def time_choose_kept(batch: DraftBatch, drafts: int, cost_model, repeats: int) -> np.ndarray:
    """The public call (`choose_kept`) with a 2-D array of survivals and the same curve as a
    vectorisable callable."""
    r = batch.num_requests
    rows = batch.survival.reshape(r, drafts)
    out = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        curve = cost_model.verify_curve(r, r * 512)
        choose_kept(rows, curve.verify_seconds, curve.fixed_seconds, min_step=curve.min_marginal)
        out[i] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cm = preset(DEMO, "cpu", ep=2)
    rows = []
    for requests, drafts in SHAPES:
        batch = make_batch(rng, requests, drafts)
        for policy in (Dcut(), Tetris(drafts // 2), Full()):
            time_policy(policy, batch, cm, 10)  # warm up
            t = time_policy(policy, batch, cm, args.repeats) * 1e3
            rows.append({"policy": policy.name, "requests": requests, "drafts": drafts,
                         "ms_p50": float(np.median(t)), "ms_p90": float(np.percentile(t, 90)),
                         "repeats": args.repeats})
        time_choose_kept(batch, drafts, cm, 10)
        t = time_choose_kept(batch, drafts, cm, args.repeats) * 1e3
        rows.append({"policy": "choose_kept (2-D array)", "requests": requests, "drafts": drafts,
                     "ms_p50": float(np.median(t)), "ms_p90": float(np.percentile(t, 90)), "repeats": args.repeats})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine()}
    (out / "decision_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("| policy | requests × drafts | median ms | p90 ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['requests']} × {r['drafts']} | {r['ms_p50']:.3f} | {r['ms_p90']:.3f} |")


if __name__ == "__main__":
    main()
