"""What the engine keeps per drafter kind when one unit hosts several (block, MTP, n-gram): the
drafting cost each kind learns from its own time, and the counters /metrics shows."""

from __future__ import annotations

import numpy as np

from actors.engine.costs import KindCostLearner
from actors.engine.stages import Step


def learn_kind_costs(learner: KindCostLearner, pool, batch: list, outs: dict, counts: np.ndarray, which: np.ndarray,
                     seconds: float) -> None:
    """Each kind's cost learns from its own time in each replica (its pass and its catch-up on
    the context held back from it); the call's time beyond the slowest replica's kinds is the
    shared cost. The pool notes how much of each drafting request's context its kind has now
    seen (what a later switch of kind would cost). counts [R]: drafts per request; which [R]:
    the kind that drafted each; seconds: the drafting stage's wall time."""
    for idx, out in outs.values():
        for kind, own in (out.kind_s or {}).items():
            mine = [i for i in idx if which[i] == kind and counts[i] > 0]
            learner.observe_kind(kind, len(mine), int(counts[mine].sum()), own, (out.kind_context or {}).get(kind, 0),
                                 int(counts[mine].max(initial=0)))
    learner.observe_call(seconds - max(sum((out.kind_s or {}).values()) for _, out in outs.values()))
    for i, s in enumerate(batch):
        if counts[i]:
            pool.saw(s.rid, int(which[i]), s.cached)


def count_kinds(counters: dict[str, dict[str, int]], kinds: tuple[str, ...], st: Step) -> None:
    """Per drafter kind: request-steps it drafted for, drafts made, kept and accepted."""
    drafted = np.diff(st.drafts.cu)
    which = st.drafts.kinds if st.drafts.kinds is not None else np.zeros(len(st.batch), dtype=np.int64)
    for i, k in enumerate(which):
        if drafted[i]:
            c = counters[kinds[k]]
            c["chosen"] += 1
            c["drafted"] += int(drafted[i])
            c["kept"] += int(st.kept[i])
            c["accepted"] += int(st.accepted[i])
