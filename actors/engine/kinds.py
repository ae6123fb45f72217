"""What the engine keeps per drafter kind (block, MTP, n-gram; one kind is K = 1): the drafting
cost each kind learns from its own time, and the counters /metrics shows."""

from __future__ import annotations

import numpy as np

from actors.engine.stages import Drafts, Step
from dcut_core.learners import DraftCostLearner


def learn_kind_costs(learner: DraftCostLearner, outs: dict, drafts: Drafts) -> None:
    """Each kind's cost learns from its own time in each replica (its catch-up on context and its
    pass); the stage's time beyond the slowest replica's kinds is the call's shared cost."""
    counts, which = drafts.counts, drafts.kinds
    for idx, out in outs.values():
        idx = np.asarray(idx, dtype=np.int64)
        for kind, own in out.kind_s.items():
            mine = idx[(which[idx] == kind) & (counts[idx] > 0)]
            learner.observe_kind(kind, len(mine), int(counts[mine].sum()), own, out.kind_context.get(kind, 0),
                                 int(counts[mine].max(initial=0)))
    learner.observe_call(drafts.seconds - max(sum(out.kind_s.values()) for _, out in outs.values()))


def count_kinds(counters: dict[str, dict[str, int]], kinds: tuple[str, ...], st: Step) -> None:
    """Per drafter kind: request-steps it drafted for, drafts made, kept and accepted (one
    bincount each: a dict update a request had been 0.2 ms a step at 1,024 requests)."""
    drafted = st.drafts.counts
    idx = drafted.nonzero()[0]
    if not len(idx):
        return
    which = st.drafts.kinds[idx]
    k = len(kinds)
    sums = {"chosen": np.bincount(which, minlength=k), "drafted": np.bincount(which, drafted[idx], k),
            "kept": np.bincount(which, np.asarray(st.pruned.kept)[idx], k),
            "accepted": np.bincount(which, np.asarray(st.accepted.counts)[idx], k)}
    for j in np.flatnonzero(sums["chosen"]).tolist():  # the kinds present, as `ragged.groups` reads them
        c = counters[kinds[j]]
        for name, total in sums.items():
            c[name] += int(total[j])
