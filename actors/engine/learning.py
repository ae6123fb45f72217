"""What a committed step leaves behind: the estimators learn from it (`learn`) and it is recorded
(`record`: the bounded history, the overhead the gate charges drafting for, the msgpack step log)."""

from __future__ import annotations

import time

import numpy as np

from actors.engine.costs import StepOverhead
from actors.engine.history import StepHistory
from actors.engine.stages import Step, StepRecord
from actors.engine.steplog import StepLog, observed
from dcut_core import ragged
from dcut_core.acceptance import Calibrator, verify_outcomes
from dcut_core.cost_model import StepShape
from dcut_core.gate import DraftingGate


def learn(st: Step, calibrators: list[Calibrator], gate: DraftingGate, cost, log: bool = False) -> float:
    """Calibration (judged drafts only; each drafter kind's own), the drafting gate's acceptance
    trackers and the cost model's correction learn from the step; returns the step's predicted
    verify time (made before learning). With `log`, what the trackers learnt is kept on the step
    for the step log."""
    drafts, kept = st.drafts, st.kept
    kinds = drafts.kinds if drafts.kinds is not None else np.zeros(len(st.batch), dtype=np.int64)
    idx, ok = verify_outcomes(drafts.cu, kept, st.accepted)
    if len(idx):
        pos = ragged.positions(drafts.cu)[idx]
        kind = np.repeat(kinds, np.diff(drafts.cu))[idx]
        for k in np.unique(kind):
            m = kind == k
            calibrators[k].observe(drafts.confidence[idx][m], drafts.margin[idx][m], pos[m], ok[m])
    # A request that drafted nothing teaches nothing (no kept draft, nothing beyond): skipped
    # without a call, so a step that drafts for few of 1,024 requests costs the few.
    for i in np.flatnonzero(np.diff(drafts.cu)).tolist():
        beyond = drafts.estimate[drafts.cu[i] + kept[i]:drafts.cu[i + 1]] if drafts.estimate is not None else None
        gate.observe(st.batch[i].rid, int(kinds[i]), int(kept[i]), int(st.accepted[i]), beyond)
    if drafts.kinds is not None:  # several kinds: a kind asked that drafted nothing is a failed try
        st.empty = [(s.rid, int(kinds[i])) for i, s in enumerate(st.batch)
                    if st.lengths[i] > 0 and drafts.cu[i + 1] == drafts.cu[i]]
        for rid, kind in st.empty:
            gate.empty(rid, kind)
    if log:  # what the trackers learnt from, for `dcut_core.gate.replay`
        st.observed = observed(st)
    if cost is None:
        return float("nan")
    if st.feeding:  # the correction learns verification steps only (pruning's curve)
        return cost.predict(shape(st))
    return cost.observe(shape(st), st.out.wall_s)


def shape(st: Step) -> StepShape:
    """The step's forward as the cost model sees it: requests, tokens, context."""
    return StepShape(len(st.batch) + len(st.feeding), st.verify_tokens + st.prefill_tokens,
                     st.context + sum(f.start for f in st.feeding))


def record(st: Step, predicted: float, history: StepHistory, overhead: StepOverhead, step_log: StepLog | None,
           policy: str) -> StepRecord:
    drafts, out = st.drafts, st.out
    rec = StepRecord(len(st.batch), int(drafts.cu[-1]), int(st.kept.sum()), int(np.sum(st.accepted)),
                     st.verify_tokens, predicted, out.wall_s, drafts.seconds, drafts.decision_seconds,
                     drafts.probe_seconds, step_s=time.perf_counter() - st.started,
                     target_compute_s=max((r.total_s for r in out.rank_stats), default=0.0),
                     draft_compute_s=drafts.compute_seconds, prefill_tokens=st.prefill_tokens,
                     rank_compute_s=tuple(r.total_s for r in out.rank_stats))
    history.append(rec)
    if not st.feeding:  # what drafting adds outside the passes (prefill chunks would blur it)
        overhead.observe(rec.drafted > 0, rec.step_s - rec.target_compute_s - rec.draft_s)
    if step_log is not None:
        step_log.write(policy, np.diff(drafts.cu), drafts.survival, st.kept, st.accepted, st.context, predicted,
                       out.wall_s, drafts.seconds, st.gate, st.observed)
    return rec
