"""`choose_kept`: the exact D-Cut decision as one plain library call (numpy in, kept counts out),
for callers outside the engine. The engine itself calls a `Policy` with its cost model's curve."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dcut_core.pruning import Dcut, DraftBatch, StepCost


def choose_kept(
    survival: Sequence[Sequence[float] | np.ndarray],
    verify_cost: Callable[[int], float],
    fixed_cost: float = 0.0,
    max_budget: int | None = None,
) -> np.ndarray:
    """Exact D-Cut decision for plain inputs: kept counts [R] (int64).

    survival: one 1-D array per request, non-increasing (or a 2-D array: requests × drafts,
    which skips the per-row conversion). verify_cost: total verify tokens
    (R + Σ kept) -> seconds. It is called once with an int64 array of every count the scan
    needs when it answers one with an array of the same shape (numpy arithmetic does), and
    otherwise once per count with a Python int. No guard and no step filling: this is the bare
    optimum of the objective, the smallest budget among equals.
    """
    batch = DraftBatch.from_rows(survival)
    batch.validate()
    policy = Dcut(max_budget=max_budget, fill_step=False, guard_threshold=0.0)
    return policy.choose(batch, StepCost(_as_curve(verify_cost), fixed_cost)).kept


def _as_curve(verify_cost: Callable) -> Callable[[np.ndarray], np.ndarray]:
    """A cost of one count as a cost of an array of counts: one call if it takes arrays, and
    counts the previous call covered are answered from it (the decision asks for its own again)."""
    takes_arrays = [True]
    last = [np.zeros(0, dtype=np.int64), np.zeros(0)]  # counts (sorted: the scan asks in order), seconds

    def ask(tokens: np.ndarray) -> np.ndarray:
        if takes_arrays[0]:
            try:
                out = np.asarray(verify_cost(tokens), dtype=np.float64)
                if out.shape == tokens.shape:
                    return out
            except (TypeError, ValueError, IndexError):  # math on ints only: ask count by count
                pass
            takes_arrays[0] = False
        return np.array([float(verify_cost(int(n))) for n in tokens], dtype=np.float64)

    def curve(tokens: np.ndarray) -> np.ndarray:
        counts, seconds = last
        at = np.minimum(np.searchsorted(counts, tokens), max(0, len(counts) - 1))
        if len(counts) and np.array_equal(counts[at], tokens):
            return seconds[at]
        out = ask(tokens)
        if np.all(np.diff(tokens) > 0):
            last[:] = [np.asarray(tokens, dtype=np.int64), out]
        return out

    return curve
