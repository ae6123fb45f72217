"""The drafting gate's own time, on its own (issue #24: `auto`'s gap at C = 1 is the unit's own
time; issue #26: the coordinator's time per step).

`DraftingGate.decide` with one and three drafter kinds at R requests (warm trackers, every kind
allowed, an n-gram-like kind whose look-ahead found 0–7 drafts), and one tracker learning a
step's J verifications (`AcceptanceTracker.learn`, the `Verified` batch built inside). Medians of
many calls, microseconds; a checkout of another commit runs the same file for an A/B.

    .venv/bin/python benchmarks/gate_time.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path.cwd()))

from dcut_core.drafting import AcceptanceTracker, DraftCost, DraftingCosts, Exploration, Verified
from dcut_core.gate import DraftingGate, GateInput, KindReach
from dcut_core.pruning import StepCost


def median_us(call, n: int, skip: int = 50) -> float:
    times = []
    for _ in range(n + skip):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times[skip:])


def gate_input(k: int, r: int, seed: int = 0) -> tuple[DraftingGate, GateInput]:
    rng = np.random.default_rng(seed)
    gate = DraftingGate([AcceptanceTracker(block=8) for _ in range(k)], Exploration(50, 4, 0))
    for _ in range(200):
        for j in range(k):
            gate.trackers[j].observe(int(rng.integers(r)), 7, int(rng.integers(0, 8)))
    costs = [DraftCost(3e-4, 1e-4, 2e-4, 1e-6, 5e-4 * (j == 1)) for j in range(k)]  # kind 1 chains
    verify = StepCost(lambda n: 0.006 + 2e-4 * n, 0.0)
    available = np.full((r, k), -1)
    available[:, -1] = rng.integers(0, 8, r)
    return gate, GateInput.capture(list(range(r)), np.full(r, 7), np.full(r, 40),
                                   KindReach(np.zeros((r, k)), available=available), verify,
                                   DraftingCosts(costs, 1e-4))


def time_decide(k: int, r: int) -> float:
    gate, g = gate_input(k, r)
    return median_us(lambda: gate.decide(g), 500)


def time_learn(j: int, rng: np.random.Generator) -> float:
    tracker = AcceptanceTracker(block=8)
    kept = rng.integers(1, 8, j)
    accepted = [int(rng.integers(0, n + 1)) for n in kept]
    beyond = [rng.uniform(0, 1, 8 - n) for n in kept]
    return median_us(lambda: tracker.learn(Verified.of(list(range(j)), np.zeros(j), kept, accepted, beyond)), 300)


def main() -> int:
    for k in (1, 3):
        for r in (1, 4, 16, 64):
            print(f"decide, {k} kind{'s' if k > 1 else ''}, R = {r}: {time_decide(k, r):.0f} µs")
    rng = np.random.default_rng(0)
    for j in (1, 16, 64):
        print(f"tracker learns J = {j}: {time_learn(j, rng):.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
