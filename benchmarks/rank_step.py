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
from actors.target.graphs import StepGraphs
from actors.target.host import upload
from actors.target.model import ForwardBatch, Prepared

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
        return self.model.forward(self.prepare(chunks, ids), self.cache)

    def prepare(self, chunks: list[list[int]], ids: list[int] | None = None) -> Prepared:
        b = ForwardBatch.from_lists(ids or self.ids, chunks, "all")
        batch = ForwardBatch(b.request_ids, upload(b.tokens, self.device), b.cu, upload(b.logit_index, self.device))
        return self.model.prepare(batch, self.cache, b.tokens.numpy())

    def chunks(self, q: int) -> list[list[int]]:
        return [self.rng.integers(0, self.vocab, q).tolist() for _ in self.ids]

    def rollback(self) -> None:
        self.cache.truncate_all(dict.fromkeys(self.ids, self.context))

    def step(self, q: int) -> float:
        """One forward of q tokens per request; the host seconds until the call returned."""
        chunks = self.chunks(q)
        t0 = time.perf_counter()
        self._forward(chunks)
        host = time.perf_counter() - t0
        self.sync()
        self.rollback()
        return host

    def sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()


def measure_graph(rig: StepRig, q: int, steps: int) -> dict:
    """The step as the rank runs it on a GPU (`actors/target/graphs.py`: padded to its bucket,
    replayed as a CUDA graph) against the eager one: wall ms of a whole step (plan, copies,
    replay), of the replay alone, and the largest logit difference on the same inputs (the
    padded shapes may round differently)."""
    if not rig.device.startswith("cuda"):
        return {"graph_error": f"CUDA graphs need a CUDA device, not {rig.device}"}
    if not StepGraphs.wanted("auto", rig.model, 1, str(rig.model.lm_head.weight.device)):
        return {"graph_error": "a step here waits for the host (experts without a grouped kernel in this dtype)"}
    graphs = StepGraphs(rig.model, rig.cache, "auto")
    chunks = rig.chunks(q)
    eager = rig._forward(chunks)[0].float()
    rig.sync()
    rig.rollback()
    diff = float((graphs.forward(rig.prepare(chunks))[0].float() - eager).abs().max())
    rig.sync()
    rig.rollback()
    walls = []
    for _ in range(steps):
        chunks = rig.chunks(q)
        t0 = time.perf_counter()
        graphs.forward(rig.prepare(chunks))
        rig.sync()
        walls.append(time.perf_counter() - t0)
        rig.rollback()
    (graph,) = graphs.captured()
    replays = []
    for _ in range(steps):
        t0 = time.perf_counter()
        graph.replay()
        rig.sync()
        replays.append(time.perf_counter() - t0)
    return {"graph_wall_ms": 1e3 * statistics.median(walls), "graph_replay_ms": 1e3 * statistics.median(replays),
            "graph_max_diff": diff, "graph_capture_s": graphs.capture_s}


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
            rig._forward(rig.chunks(q))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    rig.sync()
    rig.rollback()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites: dict[str, int] = {}
    for w in syncs:
        site = f"{pathlib.Path(w.filename).name}:{w.lineno}"
        sites[site] = sites.get(site, 0) + 1
    return len(syncs), sites


def measure(rig: StepRig, q: int, steps: int, graphs: bool = False) -> dict:
    for _ in range(3):
        rig.step(q)
    walls, hosts = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        hosts.append(rig.step(q))
        walls.append(time.perf_counter() - t0)
    busy, kernels, top = profile_step(rig, q)
    syncs, sites = count_syncs(rig, q)
    block = rig.model.moe_blocks()[0] if rig.model.moe_blocks() else None
    probe = torch.zeros(1, device=rig.device, dtype=rig.model.lm_head.weight.dtype)
    row = {"wall_ms": 1e3 * statistics.median(walls), "host_ms": 1e3 * statistics.median(hosts),
           "busy_ms": busy, "kernels": kernels, "syncs": syncs, "sync_sites": sites, "top_ops": top,
           "experts": "grouped" if block is not None and block.experts.uses_grouped(probe) else "loop"}
    if graphs:
        row |= measure_graph(rig, q, steps)
    return row


def graph_cells(row: dict) -> str:
    if "graph_error" in row:
        return " — | — | — | — |"
    speedup = row["wall_ms"] / row["graph_wall_ms"]
    return f" {row['graph_wall_ms']:.2f} | {row['graph_replay_ms']:.2f} | {speedup:.1f} | {row['graph_max_diff']:.2g} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--requests", default="1,16,64,256")
    ap.add_argument("--tokens", default="1,8", help="tokens per request in a step (1: plain decoding)")
    ap.add_argument("--context", default="128", help="tokens of context per request, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model-dir", default=str(BUNDLED))
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                    help="also the step captured as a CUDA graph (auto: on a CUDA device)")
    ap.add_argument("--out", default="runs/rank_step")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    graphs = args.graphs == "on" or (args.graphs == "auto" and args.device.startswith("cuda"))
    lines = ["| dtype | context | R | q | experts | wall ms | host ms | busy ms | busy / wall | kernels | syncs |"
             + (" graphed wall ms | replay ms | eager / graphed | max logit diff |" if graphs else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if graphs else "")]
    cells = [(d, c, r) for d in args.dtypes.split(",") for c in map(int, args.context.split(","))
             for r in map(int, args.requests.split(","))]
    for dtype_name, context, r in cells:
        rig = StepRig(args.model_dir, args.device, getattr(torch, dtype_name), r, context)
        for q in map(int, args.tokens.split(",")):
            row = {"device": args.device, "dtype": dtype_name, "context": context, "requests": r, "tokens": q}
            row |= measure(rig, q, args.steps, graphs)
            rows.append(row)
            lines.append(f"| {dtype_name} | {context} | {r} | {q} | {row['experts']} | {row['wall_ms']:.2f} | "
                         f"{row['host_ms']:.2f} | {row['busy_ms']:.2f} | {row['busy_ms'] / row['wall_ms']:.2f} | "
                         f"{row['kernels']} | {row['syncs']} |" + (graph_cells(row) if graphs else ""))
            print(lines[-1], flush=True)
        del rig
        if args.device != "cpu":
            torch.cuda.empty_cache()
    top = rows[len(rows) // 2]["top_ops"] if rows else []
    footer = len(lines)
    lines += ["", f"Top host ops of one forward ({rows[len(rows) // 2]['dtype']}, R = "
              f"{rows[len(rows) // 2]['requests']}, q = {rows[len(rows) // 2]['tokens']}): self ms, calls", ""]
    lines += [f"- {name}: {ms:.3f} ms, {n}" for name, ms, n in top]
    sites = {f"{r['dtype']}, {r['experts']} experts": r["sync_sites"] for r in rows if r["sync_sites"]}
    if sites:
        lines += ["", "Host waits in one forward, by Python line (first cell of each dtype):", ""]
        lines += [f"- {k}: " + ", ".join(f"{site} × {n}" for site, n in v.items()) for k, v in sites.items()]
    errors = {f"{r['dtype']}, R = {r['requests']}, q = {r['tokens']}": r["graph_error"] for r in rows
              if "graph_error" in r}
    if errors:
        lines += ["", "Not captured as a CUDA graph:", ""] + [f"- {k}: {v}" for k, v in errors.items()]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines[footer:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
