"""The engine's per-kind counters (`count_kinds`, /metrics): each kind's request-steps, drafts,
kept and accepted, as a request-by-request count would make them."""

from __future__ import annotations

import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.kinds import count_kinds

KINDS = ("block", "mtp", "ngram")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)),
                         max_size=9), min_size=1, max_size=4))
def test_each_kinds_counters_are_its_requests_sums(steps):
    counters = {k: dict.fromkeys(("chosen", "drafted", "kept", "accepted"), 0) for k in KINDS}
    want = {k: dict.fromkeys(("chosen", "drafted", "kept", "accepted"), 0) for k in KINDS}
    for rows in steps:
        kinds = np.array([k for k, *_ in rows], dtype=np.int64)
        drafted = np.array([d for _, d, _, _ in rows], dtype=np.int64)
        kept = np.minimum([k for *_, k, _ in rows], drafted)
        accepted = np.minimum([a for *_, a in rows], kept).tolist()
        count_kinds(counters, KINDS, types.SimpleNamespace(
            drafts=types.SimpleNamespace(counts=drafted, kinds=kinds), pruned=types.SimpleNamespace(kept=kept),
            accepted=types.SimpleNamespace(counts=accepted)))
        for i in range(len(rows)):
            if drafted[i]:  # a request the step drafted nothing for counts for no kind
                c = want[KINDS[kinds[i]]]
                c["chosen"] += 1
                c["drafted"] += int(drafted[i])
                c["kept"] += int(kept[i])
                c["accepted"] += accepted[i]
    assert counters == want
    assert all(type(v) is int for c in counters.values() for v in c.values())  # JSON and /metrics take them
