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
    min_step: float | None = None,
) -> np.ndarray:
    """Exact D-Cut decision for plain inputs: kept counts [R] (int64).

    survival: one 1-D array per request, non-increasing (or a 2-D array: requests × drafts,
    which skips the per-row conversion). verify_cost: total verify tokens (R + Σ kept) ->
    seconds; asked with one int64 array of counts when it answers an array of the same shape
    (numpy arithmetic does), otherwise once per count with a Python int. No guard and no step
    filling: this is the bare optimum of the objective, the smallest budget among equals.

    What one more token costs at least bounds which drafts could ever be kept, so the rest are
    dropped before the sort, as the engine's own cost model lets it (`Dcut._floor`). `min_step`:
    that bound, when the caller knows it (a per-token coefficient; it must hold between any two
    neighbouring counts): the cost is then asked only at the counts the decision reaches. Without
    it the cost is asked at every count from R to R + N (R + max_budget) at once — what a scan
    without a bound asks for anyway — and its least step between neighbours is the bound
    (4,096 × 16 drafts with a linear cost: 6.9 → ~0.6 ms, session 46).
    """
    batch = DraftBatch.from_rows(survival)
    batch.validate()
    policy = Dcut(max_budget=max_budget, fill_step=False, guard_threshold=0.0)
    if min_step is not None:
        return policy.choose(batch, StepCost(_as_curve(verify_cost), fixed_cost, max(0.0, float(min_step)))).kept
    r, n = batch.num_requests, len(batch.survival)
    top = n if max_budget is None else min(n, max(0, max_budget))
    # The step's seconds (the fixed cost in: the bound is on what the decision compares) at every
    # count it can reach, checked once; `StepCost.tabulated` does the same with a pass or two more
    # over the table, which at 65,537 counts cost more than the decision.
    seconds = fixed_cost + _ask(verify_cost, r + np.arange(top + 1, dtype=np.int64))[0]
    if not (float(seconds.min()) > 0 and np.isfinite(float(seconds.max()))):  # a NaN fails `> 0`
        raise ValueError("step cost must be finite and positive for every budget")
    step = float((seconds[1:] - seconds[:-1]).min()) if top else 0.0

    def curve(tokens: np.ndarray) -> np.ndarray:
        at = np.asarray(tokens, dtype=np.int64) - r
        if at.size and (at.min() < 0 or at.max() > top):  # a count past the decision's reach
            return fixed_cost + _ask(verify_cost, np.asarray(tokens, dtype=np.int64))[0]
        return seconds[at]

    return policy.choose(batch, StepCost(curve, 0.0, max(0.0, step), checked=True)).kept


def _ask(verify_cost: Callable, tokens: np.ndarray, arrays: bool = True) -> tuple[np.ndarray, bool]:
    """(the cost at each of `tokens`, whether it took the array): one call if it takes arrays
    (`arrays`: worth trying), else one call per count."""
    if arrays:
        try:
            out = np.asarray(verify_cost(tokens), dtype=np.float64)
            if out.shape == tokens.shape:
                return out, True
        except (TypeError, ValueError, IndexError):  # math on ints only: ask count by count
            pass
    return np.array([float(verify_cost(int(n))) for n in tokens], dtype=np.float64), False


def _as_curve(verify_cost: Callable) -> Callable[[np.ndarray], np.ndarray]:
    """A cost of one count as a cost of an array of counts (`_ask`, settling at the first call
    whether it takes arrays). Dcut asks each count once (the decision's own seconds come from its
    scan), so nothing is kept between calls."""
    takes_arrays = [True]

    def curve(tokens: np.ndarray) -> np.ndarray:
        out, takes_arrays[0] = _ask(verify_cost, tokens, takes_arrays[0])
        return out

    return curve
