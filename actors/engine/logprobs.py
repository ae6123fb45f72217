"""Log-probabilities of the target for the tokens a request commits (and, with `echo`, for its
prompt): taken from the rows of the very forward that verified them, so they are exact whatever
the policy, the drafter or the EP size did — a speculative step's row t is the target's
distribution for the token at output position t, as in plain decoding.

The values are the log-softmax of the target's raw logits (before temperature and top-p), as
vLLM's default reports them; the sampling controls decide which token is drawn, not its
reported probability.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAX_TOP = 20  # the most alternatives per token a request may ask for (OpenAI's limit)


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `k` most likely tokens at this position, best first


def entries(rows: np.ndarray, tokens: list[int], k: int) -> list[TokenLogprob]:
    """One entry per token: tokens[t]'s log-probability in rows[t] ([n, V] log-softmax rows) and
    the k most likely tokens of that row (ties: lower id first)."""
    n = len(tokens)
    if n == 0:
        return []
    rows = np.asarray(rows[:n])
    chosen = rows[np.arange(n), tokens]
    tops: list[tuple[tuple[int, float], ...]] = [()] * n
    if k > 0:
        part = np.argpartition(-rows, min(k, rows.shape[1] - 1), axis=1)[:, :k] if k < rows.shape[1] \
            else np.tile(np.arange(rows.shape[1]), (n, 1))
        for t in range(n):
            ids = part[t][np.lexsort((part[t], -rows[t, part[t]]))]
            tops[t] = tuple((int(i), float(rows[t, i])) for i in ids)
    return [TokenLogprob(int(tok), float(lp), top) for tok, lp, top in zip(tokens, chosen, tops, strict=True)]
