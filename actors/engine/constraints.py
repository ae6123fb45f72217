"""What constrains a request's tokens beyond the policy: its grammar's verdict on its drafts
(before pruning) and its per-row controls for the target (`sampling.RequestControls`: sampling
controls and grammar masks), built per step from the request's state."""

from __future__ import annotations

import numpy as np

from actors.engine.sequence import Sequence
from actors.engine.stages import Feed, Step
from actors.target.sampling import NEUTRAL, RequestControls
from dcut_core import ragged


def grammar_allowed(st: Step) -> np.ndarray | None:
    """Per request of step `st`, how many of its drafts its grammar allows (None: no request has
    one)."""
    batch, drafts = st.batch, st.drafts
    if not st.census.controls or not any([s.grammar is not None for s in batch]):
        return None
    n = ragged.lengths(drafts.cu)
    return np.array([n[i] if s.grammar is None else s.grammar.valid_prefix(drafts.tokens[drafts.cu[i]:
                                                                                          drafts.cu[i + 1]])
                     for i, s in enumerate(batch)], dtype=np.int64)


def request_controls(s: Sequence, drafts: list[int] | None = None,
                     feed: Feed | None = None) -> RequestControls | None:
    """What the target applies to this request's rows this step: its sampling controls, and
    its grammar's masks — one per verified row after the committed tokens and the drafts
    before it (decoding), or for the row that draws a fresh prompt's first token (prefill)."""
    if s.controls is None and s.grammar is None:
        return None
    allowed = None
    if s.grammar is not None and drafts is not None:
        allowed = s.grammar.masks(np.asarray(drafts, dtype=np.int64))
    elif s.grammar is not None and feed.logit_rows:
        allowed = np.full((len(feed.logit_rows), (s.grammar.vocab_size + 31) // 32), -1, dtype=np.int32)
        if feed.start + len(feed.tokens) == s.feed_len and not s.output:
            allowed[-1] = s.grammar.masks(np.zeros(0, dtype=np.int64))[0]
    history = s.feed[:feed.start] if feed is not None else [*s.prompt, *s.output[:-1]]
    return RequestControls(s.controls or NEUTRAL, np.asarray(history, dtype=np.int64), len(s.prompt), allowed)
