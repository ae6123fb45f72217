"""Non-negative least squares (Lawson–Hanson active set), numpy only.

The cost model's coefficients are fitted with it: non-negative coefficients on non-decreasing
features make the fitted step time monotone in tokens, which the pruning scan relies on.
"""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None, tol: float = 1e-12) -> np.ndarray:
    """argmin_x ||a x - b||_2 subject to x >= 0. a: [M, P], b: [M] -> x: [P]."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, p = a.shape
    if b.shape != (m,):
        raise ValueError(f"b must have shape ({m},), got {b.shape}")
    max_iter = 3 * p if max_iter is None else max_iter
    x = np.zeros(p)
    passive = np.zeros(p, dtype=bool)
    scale = tol * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(b).max(initial=0.0)))
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)  # [P] negative gradient
        candidates = ~passive & (w > scale)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, w, -np.inf)))] = True
        while True:
            z = np.zeros(p)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back toward x until the first passive coefficient hits zero, then drop it.
            shrink = passive & (z <= 0)
            gap = x[shrink] - z[shrink]
            alpha = float(np.min(np.divide(x[shrink], gap, out=np.zeros_like(gap), where=gap > 0)))
            x = x + alpha * (z - x)
            passive &= x > scale
            x[~passive] = 0.0
    return x
