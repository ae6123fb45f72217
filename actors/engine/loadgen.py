"""Closed-loop load on an in-process engine: keep C requests in flight, measure per request.

Time stamps are taken between steps, so TTFT and TPOT have step granularity — which is what a
client of this engine sees, since tokens leave the engine once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams


@dataclass
class RunResult:
    policy: str
    concurrency: int
    wall_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    records: list = field(default_factory=list)


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                temperature: float = 0.0) -> RunResult:
    """Run every prompt, at most `concurrency` at a time, refilling as requests finish."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0 if temperature else None)
    first_record = len(engine.records)
    pending = list(range(len(prompts)))
    started: dict[int, tuple[int, float]] = {}  # rid -> (prompt index, start time)
    first: dict[int, float] = {}
    last: dict[int, tuple[float, int]] = {}
    gaps: list[float] = []
    outputs: dict[int, list[int]] = {}
    ttft, tpot = [], []
    t0 = time.perf_counter()
    while pending or started:
        while pending and len(started) < concurrency:
            i = pending.pop(0)
            started[engine.add(prompts[i], params)] = (i, time.perf_counter())
        engine.step()
        now = time.perf_counter()
        for seq in engine.scheduler.running + [engine.scheduler.finished[r] for r in list(engine.scheduler.finished)
                                               if r in started]:
            n = len(seq.output)
            if n and seq.rid not in first:
                first[seq.rid] = now
                ttft.append(now - started[seq.rid][1])
            if seq.rid in last and n > last[seq.rid][1]:
                gaps.append((now - last[seq.rid][0]) / (n - last[seq.rid][1]))
            if n:
                last[seq.rid] = (now, n)
        for rid in [r for r in list(engine.scheduler.finished) if r in started]:
            seq = engine.scheduler.finished.pop(rid)
            i, _ = started.pop(rid)
            outputs[i] = seq.output
            if len(seq.output) > 1:
                tpot.append((last[rid][0] - first[rid]) / (len(seq.output) - 1))
    wall = time.perf_counter() - t0
    return RunResult("", concurrency, wall, sum(len(o) for o in outputs.values()), ttft, tpot, gaps,
                     [outputs[i] for i in range(len(prompts))], engine.records[first_record:])


def summarize(run: RunResult, ar_tok_s: float | None = None) -> dict:
    recs = run.records
    steps = len(recs)
    drafted = sum(r.drafted for r in recs)
    reqs = sum(r.requests for r in recs)
    errors = [abs(r.predicted_verify_s - r.measured_verify_s) / r.measured_verify_s for r in recs
              if r.measured_verify_s > 0 and np.isfinite(r.predicted_verify_s)]
    pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    # The oracle learns true acceptance with an extra verification pass; a real system has no
    # such pass, so it is taken out of its wall time (its latency percentiles still include it).
    wall = run.wall_s - sum(r.probe_s for r in recs)
    out = {
        "policy": run.policy, "concurrency": run.concurrency, "requests": len(run.outputs),
        "output_tokens": run.output_tokens, "wall_s": wall,
        "output_tok_s": run.output_tokens / wall,
        "mat": (sum(r.accepted for r in recs) + reqs) / reqs if reqs else float("nan"),
        "verify_tokens_per_step": sum(r.verify_tokens for r in recs) / steps if steps else float("nan"),
        "keep_ratio": sum(r.kept for r in recs) / drafted if drafted else 0.0,
        "drafted_per_step": drafted / steps if steps else 0.0,
        "tpot_ms_p50": pct(run.tpot_s, 50), "tpot_ms_p99": pct(run.tpot_s, 99),
        "ttft_ms_p50": pct(run.ttft_s, 50), "ttft_ms_p99": pct(run.ttft_s, 99),
        "itl_ms_p50": pct(run.itl_s, 50), "itl_ms_p99": pct(run.itl_s, 99),
        "decision_ms_mean": 1e3 * float(np.mean([r.decision_s for r in recs])) if recs else 0.0,
        "draft_ms_mean": 1e3 * float(np.mean([r.draft_s for r in recs])) if recs else 0.0,
        "verify_ms_mean": 1e3 * float(np.mean([r.measured_verify_s for r in recs])) if recs else 0.0,
        "cost_model_error": float(np.median(errors)) if errors else float("nan"),
        "steps": steps,
    }
    if ar_tok_s:
        out["speedup_vs_ar"] = out["output_tok_s"] / ar_tok_s
    return out
