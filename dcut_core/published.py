"""Published figures (../shared/PUBLISHED.md) and the procedure that reproduces them in simulation.

The D-Cut paper's dense setting (Qwen3-8B, H20, TP1, temperature 0) publishes three things that
together pin a simulation down without free knobs per cell:

1. the verification step time against kept slots of a 16-slot block at B = 4, 16, 64
   (`DENSE_VERIFY_MS`) — the cost source, used as is (`TableCost`);
2. an equal-budget experiment at B = 32 (`EQUAL_BUDGET`): accepted tokens when the same number of
   slots is kept as the global top-K versus the same depth for every request — this fixes the
   acceptance trace (mean acceptance, spread between requests and drafts, confidence noise);
3. the speedups over AR (`DENSE_SPEEDUP`). AR runs on a faster path than verification, so its
   step time is not in the table; two numbers (a + b·B) are fitted to the DFlash-B16 row only.

Everything else — DFlash-B8 and both D-Cut rows, 15 cells — is then a prediction. Slots count
verify tokens per request (the bonus position plus kept drafts), so a 16-slot block is 15 drafts,
and "accepted" counts committed tokens (accepted drafts plus the bonus token).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from dcut_core.pruning import FixedK, Tetris
from dcut_core.simulate import LinearAr, SimConfig, TableCost, fit_ar, simulate
from dcut_core.traces import SyntheticTrace

BATCHES = (4, 8, 16, 32, 64)

DENSE_VERIFY_MS = TableCost(
    batches=(4, 16, 64),
    per_request=(4.0, 8.0, 12.0, 16.0),  # 25 / 50 / 75 / 100 % of a 16-slot block
    ms=((8.2, 8.7, 9.7, 10.9), (16.0, 22.7, 29.8, 35.8), (55.2, 82.2, 107.9, 133.9)),
)

# (method, block) -> speedup over AR at BATCHES; Qwen3-8B dense, 8×H20, temperature 0.
DENSE_SPEEDUP: dict[tuple[str, int], tuple[float, ...]] = {
    ("full", 8): (3.27, 2.43, 1.57, 1.12, 0.91),  # DFlash-B8
    ("dcut-buckets", 8): (3.16, 2.53, 1.76, 1.31, 1.07),  # D-Cut-B8
    ("full", 16): (3.16, 1.87, 1.16, 0.80, 0.65),  # DFlash-B16
    ("dcut-buckets", 16): (3.50, 2.52, 1.67, 1.21, 0.98),  # D-Cut-B16
}
METHOD_NAMES = {"full": "DFlash", "dcut-buckets": "D-Cut"}

# Qwen3.5-35B-A3B (MoE, TP4) and Hy3-295B-A21B (MoE, TP8): the same four rows.
MOE_SPEEDUP: dict[str, dict[tuple[str, int], tuple[float, ...]]] = {
    "moe-35b-a3b": {
        ("full", 8): (1.74, 1.88, 2.09, 2.35, 2.34), ("dcut-buckets", 8): (1.60, 1.86, 2.12, 2.32, 2.27),
        ("full", 16): (1.78, 1.90, 2.16, 2.36, 2.20), ("dcut-buckets", 16): (1.91, 1.94, 2.28, 2.50, 2.46),
    },
    "moe-295b-a21b": {
        ("full", 8): (2.05, 2.06, 2.21, 2.33, 1.90), ("dcut-buckets", 8): (2.11, 2.11, 2.37, 2.40, 2.27),
        ("full", 16): (1.86, 2.10, 2.18, 1.83, 1.56), ("dcut-buckets", 16): (2.19, 2.35, 2.38, 2.48, 2.08),
    },
}
# Qwen3.5-35B-A3B, H20, TP2, B = 64: verify ms at 25/50/75/100 % kept — the MoE curve is flat.
MOE_VERIFY_MS_B64 = (79.9, 85.4, 86.1, 90.6)


@dataclass(frozen=True)
class EqualBudget:
    """B = 32, 512 slots: committed tokens with `kept` slots, global top-K versus same depth."""

    batch: int = 32
    block: int = 16
    kept: tuple[int, ...] = (128, 256)
    global_topk: tuple[float, ...] = (124.6, 190.8)
    same_depth: tuple[float, ...] = (101.4, 152.9)


EQUAL_BUDGET = EqualBudget()

# `fit_trace()` on the figures above (2026-11-29; about 40 s). The fit lands on a wide spread
# between requests and drafts and on confidences that carry the true probability without noise:
# the published global top-K gains (+23 %, +25 %) need both.
PUBLISHED_TRACE = SyntheticTrace(mean=0.927, concentration=1.0, token_noise=3.0, conf_noise=0.0)


def equal_budget(trace: SyntheticTrace, eb: EqualBudget = EQUAL_BUDGET, steps: int = 300,
                 seed: int = 0) -> tuple[list[float], list[float]]:
    """Simulated committed tokens per step: (global top-K, same depth) at each budget of `eb`."""
    flat = TableCost((1, 2), (1.0, 2.0), ((1.0, 1.0), (1.0, 1.0)))  # cost is irrelevant here
    glob, depth = [], []
    for slots in eb.kept:
        per_req = slots // eb.batch - 1  # drafts per request besides the bonus slot
        cfg = SimConfig(eb.batch, eb.block, steps=steps, seed=seed)
        for policy, out in ((Tetris(per_req), glob), (FixedK(per_req), depth)):
            r = simulate(policy, cfg, trace, flat.curve, lambda b: 1.0)
            out.append(r.mat * eb.batch)
    return glob, depth


def _rel_error(sim: list[float], pub: tuple[float, ...]) -> float:
    return float(np.max(np.abs(np.asarray(sim) / np.asarray(pub) - 1.0)))


def fit_trace(eb: EqualBudget = EQUAL_BUDGET, steps: int = 200) -> tuple[SyntheticTrace, float]:
    """Synthetic trace whose equal-budget outcome matches the published one; (trace, max rel. error).

    For each spread setting, `mean` is bisected so the same-depth result at the first budget
    matches; the setting with the smallest worst error over all four numbers wins.
    """
    best: tuple[float, SyntheticTrace] | None = None
    for conc, tok, conf in itertools.product((1.0, 2.0, 4.0), (1.0, 2.0, 3.0), (0.0, 0.2, 0.5)):
        base = SyntheticTrace(concentration=conc, token_noise=tok, conf_noise=conf)
        lo, hi = 0.3, 0.99
        for _ in range(10):
            mid = 0.5 * (lo + hi)
            _, depth = equal_budget(replace(base, mean=mid), replace(eb, kept=eb.kept[:1]), steps)
            lo, hi = (mid, hi) if depth[0] < eb.same_depth[0] else (lo, mid)
        trace = replace(base, mean=0.5 * (lo + hi))
        glob, depth = equal_budget(trace, eb, steps)
        err = max(_rel_error(glob, eb.global_topk), _rel_error(depth, eb.same_depth))
        if best is None or err < best[0]:
            best = (err, trace)
    assert best is not None
    return best[1], best[0]


def fit_dense_ar(trace: SyntheticTrace, steps: int | None = None, seed: int = 0) -> LinearAr:
    """AR step time a + b·B implied by the DFlash-B16 row: T_ar = speedup · step / MAT."""
    from dcut_core.pruning import Full

    implied = []
    for b, s in zip(BATCHES, DENSE_SPEEDUP[("full", 16)], strict=True):
        r = simulate(Full(), SimConfig(b, 16, steps=steps, seed=seed), trace, DENSE_VERIFY_MS.curve,
                     lambda _: 1.0)
        implied.append(s * (r.seconds / r.steps) / r.mat)
    return fit_ar(BATCHES, implied)
