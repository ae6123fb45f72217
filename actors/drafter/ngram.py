"""`NgramDrafter`: prompt-lookup drafting, no model.

For a request's token history, find earlier occurrences of its last n tokens (longest n first,
`max_n` down to `min_n`) and propose what followed the most recent one. Confidence of draft j
comes from the match statistics: of the occurrences found, the share whose continuation agrees
with the draft up to j, smoothed toward a prior that grows with n. The top-2 margin is the
share of the most common next token minus the runner-up, among occurrences agreeing so far.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from actors.drafter.base import DraftOutput


class NgramDrafter:
    """Prompt-lookup drafts with match-statistics confidences; owns each request's history."""

    def __init__(self, max_n: int = 4, min_n: int = 1, block_size: int = 16, prior_strength: float = 1.0) -> None:
        self.max_n, self.min_n, self.block = max_n, min_n, block_size
        self.prior_strength = prior_strength
        self._history: dict[int, list[int]] = {}

    def commit(self, request_ids: list[int], tokens: list[list[int]], hidden=None) -> None:
        """Append newly committed tokens (prompt included) to each request's history."""
        for rid, toks in zip(request_ids, tokens, strict=True):
            self._history.setdefault(rid, []).extend(int(t) for t in toks)

    def truncate(self, lengths: dict[int, int]) -> None:
        for rid, n in lengths.items():
            del self._history[rid][n:]

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)

    def draft(self, request_ids: list[int], last_tokens: list[int], lengths: list[int], temperature: float = 0.0,
              rng: np.random.Generator | None = None) -> DraftOutput:
        """Drafts follow each request's history, whose last token must be last_tokens[i]."""
        toks, confs, margins, counts = [], [], [], []
        for rid, last, want in zip(request_ids, last_tokens, lengths, strict=True):
            history = self._history.get(rid, [])
            if not history or history[-1] != last:
                raise ValueError(f"request {rid}: last token {last} is not the end of its committed history")
            d, c, m = self._lookup(np.asarray(history, dtype=np.int64), min(want, self.block - 1))
            toks += d
            confs += c
            margins += m
            counts.append(len(d))
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        return DraftOutput(np.asarray(toks, dtype=np.int64), cu, np.asarray(confs, dtype=np.float64),
                           np.asarray(margins, dtype=np.float64))

    def _lookup(self, h: np.ndarray, want: int) -> tuple[list[int], list[float], list[float]]:
        if want <= 0:
            return [], [], []
        for n in range(min(self.max_n, len(h) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(h[:-1], n)  # earlier n-grams (each has a successor)
            starts = np.nonzero((windows == h[-n:]).all(axis=1))[0]
            if len(starts) == 0:
                continue
            starts = starts[::-1]  # most recent first
            follow = [h[s + n: s + n + want] for s in starts]
            draft = follow[0].tolist()
            prior = n / (n + 1.0)  # longer matches deserve more trust before any evidence
            confs, margins = [], []
            alive = follow
            for j, tok in enumerate(draft):
                nexts = Counter(int(f[j]) for f in alive if len(f) > j)
                top = nexts.most_common(2)
                total = sum(nexts.values())
                agree = nexts.get(tok, 0)
                confs.append((agree + self.prior_strength * prior) / (total + self.prior_strength))
                margins.append((top[0][1] - (top[1][1] if len(top) > 1 else 0)) / total)
                alive = [f for f in alive if len(f) > j and f[j] == tok]
            # Each confidence is conditional on the drafts before it (only agreeing matches count).
            return draft, confs, margins
        return [], [], []
