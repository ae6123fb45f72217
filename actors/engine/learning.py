"""What a committed step leaves behind: the estimators learn from it (`learn`) and it is recorded
(`record`: the bounded history, the overhead the gate charges drafting for, the msgpack step log)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from actors.engine.history import StepHistory
from actors.engine.stages import Step, StepRecord
from actors.engine.steplog import StepLog, observed
from dcut_core import ragged
from dcut_core.acceptance import Calibrator, verify_outcomes
from dcut_core.cost_model import StepShape
from dcut_core.gate import DraftingGate
from dcut_core.learners import StepOverhead


@dataclass(frozen=True)
class Learnt:
    """What the estimators took from a step: the verify time predicted for it (made before
    learning), and for the step log what the trackers learnt from (`observed`)."""

    predicted_s: float
    observed: dict | None = None


def learn(st: Step, calibrators: list[Calibrator], gate: DraftingGate, cost, log: bool = False) -> Learnt:
    """Calibration (judged drafts only; each drafter kind's own), the drafting gate's acceptance
    trackers and the cost model's correction learn from the step."""
    drafts, kept, accepted = st.drafts, st.pruned.kept, st.accepted.counts
    counts, kinds = drafts.counts, drafts.kinds
    idx, ok = verify_outcomes(drafts.cu, kept, accepted)
    if len(idx):
        pos = ragged.positions(drafts.cu)[idx]
        conf, margin = drafts.confidence[idx], drafts.margin[idx]
        for k, m in ragged.groups(np.repeat(kinds, counts)[idx]):
            calibrators[k].observe(conf[m], margin[m], pos[m], ok[m])
    # A request that drafted nothing teaches nothing (no kept draft, nothing beyond): skipped
    # without a call, so a step that drafts for few of 1,024 requests costs the few.
    estimate, cu = st.pruned.estimate, drafts.cu
    for i in np.flatnonzero(counts).tolist():
        beyond = estimate[cu[i] + kept[i]:cu[i + 1]] if estimate is not None else None
        gate.observe(st.batch[i].rid, int(kinds[i]), int(kept[i]), int(accepted[i]), beyond)
    # A kind asked that drafted nothing is a failed try (the gate decides whether that teaches).
    empty = [(st.batch[i].rid, int(kinds[i])) for i in np.flatnonzero((st.plan.lengths > 0) & (counts == 0)).tolist()]
    for rid, kind in empty:
        gate.empty(rid, kind)
    shadow = hindsight(st)
    for rid, kind, n, a in shadow:
        gate.observe(rid, kind, n, a)
    observed_now = observed(st, empty, shadow) if log else None  # for `dcut_core.gate.replay`
    if cost is None:
        return Learnt(float("nan"), observed_now)
    if st.feeding:  # the correction learns verification steps only (pruning's curve)
        return Learnt(cost.predict(shape(st)), observed_now)
    return Learnt(cost.observe(shape(st), st.out.wall_s), observed_now)


def hindsight(st: Step) -> list[tuple[int, int, int, int]]:
    """(request, kind, judged, accepted) of the n-gram look-ahead the step did not draft with,
    judged against the tokens each request emitted: the kind learns from every step."""
    la = st.lookahead
    if la is None:
        return []
    idx, judged, accepted = la.hindsight(st.drafts.counts, st.drafts.kinds, st.accepted.emitted)
    rids = [st.batch[i].rid for i in idx.tolist()]
    return [(rid, la.kind, n, a) for rid, n, a in zip(rids, judged.tolist(), accepted.tolist(), strict=True)]


def shape(st: Step) -> StepShape:
    """The step's forward as the cost model sees it: requests, tokens, context."""
    return StepShape(len(st.batch) + len(st.feeding), st.verify_tokens + st.prefill_tokens,
                     st.context + sum(f.start for f in st.feeding))


def record(st: Step, learnt: Learnt, history: StepHistory, overhead: StepOverhead, step_log: StepLog | None,
           policy: str) -> StepRecord:
    drafts, pruned, out = st.drafts, st.pruned, st.out
    rec = StepRecord(len(st.batch), int(drafts.cu[-1]), int(pruned.kept.sum()), int(sum(st.accepted.counts)),
                     st.verify_tokens, learnt.predicted_s, out.wall_s, drafts.seconds, pruned.seconds,
                     pruned.probe_seconds, step_s=time.perf_counter() - st.started,
                     target_compute_s=max((r.total_s for r in out.rank_stats), default=0.0),
                     draft_compute_s=drafts.compute_seconds + (st.lookahead.seconds if st.lookahead else 0.0),
                     prefill_tokens=st.prefill_tokens,
                     rank_compute_s=tuple(r.total_s for r in out.rank_stats))
    history.append(rec)
    if not st.feeding:  # what drafting adds outside the passes (prefill chunks would blur it)
        overhead.observe(rec.drafted > 0, rec.step_s - rec.target_compute_s - rec.draft_s)
    if step_log is not None:
        step_log.write(policy, st, learnt)
    return rec
