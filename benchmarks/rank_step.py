"""Where one decode step of the target's rank goes on a device: host time, GPU-busy time, kernel
launches and host synchronisations per forward (issue #26; the first GPU run showed a 15 M-
parameter forward taking 5–12 ms on an H200, about what this machine's CPU takes).

For each dtype, batch R and tokens per request q: R requests prefilled with `--context` tokens,
then `--steps` forwards of q tokens each (the KV cache rolled back after each, so every step sees
the same context), as `TargetRank.forward` calls the model (`prepare` with the host tokens, then
`forward`). Per forward:

- wall ms: the call and a device synchronisation after it (median);
- host ms: the call alone, returning while the device may still run (median) — on a GPU the
  Python and launch cost, plus whatever waits inside for the device;
- busy ms: the sum of the device's kernel times in one profiled forward (torch.profiler);
- kernels: kernels launched in that forward; syncs: host waits for the device in it
  (`torch.cuda.set_sync_debug_mode`).

wall ≫ busy says the step is bound by the host (Python, launches, waits), which CUDA graphs or
fewer, larger kernels would remove; wall ≈ busy says the device itself is the cost.

    python benchmarks/rank_step.py --device cuda --dtypes float16,float32 --out runs/rank_step
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from actors.target.checkpoint import load_model
from actors.target.host import upload
from actors.target.model import ForwardBatch

BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "models" / "demo" / "target"


class StepRig:
    """One model on one device with R requests prefilled; runs a q-token step and rolls it back."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype, requests: int, context: int) -> None:
        self.device = device
        self.model = load_model(model_dir).to(device, dtype).eval()
        self.cache = self.model.new_cache((context + 64) * requests)
        self.ids = list(range(requests))
        rng = np.random.default_rng(0)
        vocab = self.model.cfg.vocab_size
        self.rng, self.vocab, self.context = rng, vocab, context
        for start in range(0, requests, 64):  # prefill in slices: one huge prefill is not what is measured
            part = self.ids[start:start + 64]
            self._forward([rng.integers(0, vocab, context).tolist() for _ in part], part)
        self.sync()

    def _forward(self, chunks: list[list[int]], ids: list[int] | None = None):
        b = ForwardBatch.from_lists(ids or self.ids, chunks, "all")
        batch = ForwardBatch(b.request_ids, upload(b.tokens, self.device), b.cu, upload(b.logit_index, self.device))
        return self.model.forward(self.model.prepare(batch, self.cache, b.tokens.numpy()), self.cache)

    def step(self, q: int) -> float:
        """One forward of q tokens per request; the host seconds until the call returned."""
        chunks = [self.rng.integers(0, self.vocab, q).tolist() for _ in self.ids]
        t0 = time.perf_counter()
        self._forward(chunks)
        host = time.perf_counter() - t0
        self.sync()
        self.cache.truncate_all(dict.fromkeys(self.ids, self.context))
        return host

    def sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()


def profile_step(rig: StepRig, q: int) -> tuple[float, int, list[tuple[str, float, int]]]:
    """(device-busy ms, kernels, top ops by host time) of one forward."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rig.device != "cpu" else [])
    with profile(activities=acts) as prof:
        rig.step(q)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 if kernels else float("nan")
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return busy_ms, len(kernels), [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in top]


def count_syncs(rig: StepRig, q: int) -> tuple[int, dict[str, int]]:
    """Host waits for the device in one forward, and where in Python each was asked for."""
    if rig.device == "cpu":
        return 0, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            chunks = [rig.rng.integers(0, rig.vocab, q).tolist() for _ in rig.ids]
            rig._forward(chunks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    rig.sync()
    rig.cache.truncate_all(dict.fromkeys(rig.ids, rig.context))
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites: dict[str, int] = {}
    for w in syncs:
        site = f"{pathlib.Path(w.filename).name}:{w.lineno}"
        sites[site] = sites.get(site, 0) + 1
    return len(syncs), sites


def measure(rig: StepRig, q: int, steps: int) -> dict:
    for _ in range(3):
        rig.step(q)
    walls, hosts = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        hosts.append(rig.step(q))
        walls.append(time.perf_counter() - t0)
    busy, kernels, top = profile_step(rig, q)
    syncs, sites = count_syncs(rig, q)
    return {"wall_ms": 1e3 * statistics.median(walls), "host_ms": 1e3 * statistics.median(hosts),
            "busy_ms": busy, "kernels": kernels, "syncs": syncs, "sync_sites": sites, "top_ops": top}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--requests", default="1,16,64,256")
    ap.add_argument("--tokens", default="1,8", help="tokens per request in a step (1: plain decoding)")
    ap.add_argument("--context", default="128", help="tokens of context per request, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model-dir", default=str(BUNDLED))
    ap.add_argument("--out", default="runs/rank_step")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    lines = ["| dtype | context | R | q | wall ms | host ms | busy ms | busy / wall | kernels | syncs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cells = [(d, c, r) for d in args.dtypes.split(",") for c in map(int, args.context.split(","))
             for r in map(int, args.requests.split(","))]
    for dtype_name, context, r in cells:
        rig = StepRig(args.model_dir, args.device, getattr(torch, dtype_name), r, context)
        for q in map(int, args.tokens.split(",")):
            row = {"device": args.device, "dtype": dtype_name, "context": context, "requests": r, "tokens": q}
            row |= measure(rig, q, args.steps)
            rows.append(row)
            lines.append(f"| {dtype_name} | {context} | {r} | {q} | {row['wall_ms']:.2f} | {row['host_ms']:.2f} | "
                         f"{row['busy_ms']:.2f} | {row['busy_ms'] / row['wall_ms']:.2f} | {row['kernels']} | "
                         f"{row['syncs']} |")
            print(lines[-1], flush=True)
        del rig
        if args.device != "cpu":
            torch.cuda.empty_cache()
    top = rows[len(rows) // 2]["top_ops"] if rows else []
    lines += ["", f"Top host ops of one forward ({rows[len(rows) // 2]['dtype']}, R = "
              f"{rows[len(rows) // 2]['requests']}, q = {rows[len(rows) // 2]['tokens']}): self ms, calls", ""]
    lines += [f"- {name}: {ms:.3f} ms, {n}" for name, ms, n in top]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines[-len(top) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
