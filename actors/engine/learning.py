"""What a committed step leaves behind: the estimators learn from it (`learn`) and it is recorded
(`record`: the bounded history, the overhead the gate charges drafting for, the msgpack step log)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from actors.engine.history import StepHistory
from actors.engine.stages import Step, StepRecord
from dcut_core import ragged
from dcut_core.acceptance import IN_TURN_REQUESTS, Calibrator, judged_drafts
from dcut_core.cost_model import StepShape
from dcut_core.drafting import Verified
from dcut_core.gate import DraftingGate
from dcut_core.learners import StepOverhead
from dcut_core.payoff import PLAIN


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
    if plain(st):
        return _learn_cost(st, cost, {**Verified.of([], [], [], []).as_dict(), "empty": []} if log else None)
    counts, kinds = drafts.counts, drafts.kinds
    if drafts.cu[-1]:  # else nothing judged, nothing verified: the look-ahead alone teaches (a plain step)
        idx, ok, pos = judged_drafts(drafts.cu, kept, accepted)
        if len(idx):
            conf, margin = drafts.confidence[idx], drafts.margin[idx]
            for k, m in ragged.groups(np.repeat(kinds, counts)[idx]):
                calibrators[k].observe(conf[m], margin[m], pos[m], ok[m])
    # The trackers learn the step as one batch: the requests that drafted (one that drafted
    # nothing teaches nothing), then the look-ahead judged in hindsight, then the kinds asked
    # that drafted nothing (failed tries: the gate decides whether they teach).
    verified = drafted(st).then(hindsight(st)) if drafts.cu[-1] else hindsight(st)
    tried = ((st.plan.lengths > 0) & (counts == 0)).nonzero()[0]
    empty = list(zip(st.rids[tried].tolist(), kinds[tried].tolist(), strict=True))
    gate.learn(verified, empty)
    observed_now = {**verified.as_dict(), "empty": empty} if log else None  # for `dcut_core.gate.replay`
    return _learn_cost(st, cost, observed_now)


def plain(st: Step) -> bool:
    """Nothing drafted, asked for or looked ahead: the trackers and calibrators have nothing to
    learn from the step (the cost model's correction still does)."""
    return st.drafts.cu[-1] == 0 and st.lookahead is None and not st.plan.lengths.any()


def _learn_cost(st: Step, cost, observed: dict | None) -> Learnt:
    """The cost model's correction learns the step's forward (verification steps only, and not
    one whose rank captured a CUDA graph: the capture's 70–100 ms is no step's cost)."""
    if cost is None:
        return Learnt(float("nan"), observed)
    if st.feeding or any(r.graph_captures for r in st.out.rank_stats):
        return Learnt(cost.predict(shape(st)), observed)
    return Learnt(cost.observe(shape(st), st.out.wall_s), observed)


def drafted(st: Step) -> Verified:
    """The verifications of the requests that drafted this step, with the calibrated estimates
    of their drafts past the kept ones (when pruning made them)."""
    drafts, kept = st.drafts, st.pruned.kept
    if len(kept) <= IN_TURN_REQUESTS:
        return _drafted_in_turn(st)
    idx = drafts.counts.nonzero()[0]
    rids = st.rids[idx]
    accepted = np.asarray(st.accepted.counts, dtype=np.int64)[idx]
    estimate = st.pruned.estimate
    if estimate is None:
        return Verified(rids, drafts.kinds[idx], np.asarray(kept, dtype=np.int64)[idx], accepted)
    starts, ends = drafts.cu[idx] + kept[idx], drafts.cu[idx + 1]
    cu = np.zeros(len(idx) + 1, dtype=np.int64)
    (ends - starts).cumsum(out=cu[1:])
    beyond = np.asarray(estimate, dtype=np.float64)[np.repeat(starts - cu[:-1], ends - starts) + np.arange(cu[-1])]
    return Verified(rids, drafts.kinds[idx], np.asarray(kept, dtype=np.int64)[idx], accepted, beyond, cu)


def _drafted_in_turn(st: Step) -> Verified:
    """`drafted` walking a few requests in plain Python (the same entries and estimates)."""
    drafts, estimate = st.drafts, st.pruned.estimate
    cu = drafts.cu.tolist()
    rows = [(i, k, a) for i, (k, a) in enumerate(zip(np.asarray(st.pruned.kept).tolist(), st.accepted.counts,
                                                     strict=True)) if cu[i + 1] > cu[i]]
    rids, kinds = st.rids.tolist(), drafts.kinds.tolist()
    entries = (np.array([rids[i] for i, _, _ in rows], dtype=np.int64),
               np.array([kinds[i] for i, _, _ in rows], dtype=np.int64),
               np.array([k for _, k, _ in rows], dtype=np.int64), np.array([a for _, _, a in rows], dtype=np.int64))
    if estimate is None:
        return Verified(*entries)
    beyond, ends = [], [0]
    for i, k, _ in rows:  # each entry's estimates past its kept drafts
        beyond.extend(range(cu[i] + k, cu[i + 1]))
        ends.append(len(beyond))
    return Verified(*entries, np.asarray(estimate, dtype=np.float64)[beyond], np.array(ends, dtype=np.int64))


def hindsight(st: Step) -> Verified:
    """The n-gram look-ahead the step did not draft with, judged against the tokens each request
    emitted (request, kind, judged, accepted): the kind learns from every step."""
    la = st.lookahead
    if la is None:
        return Verified.of([], [], [], [])
    idx, judged, accepted = la.hindsight(st.drafts.counts, st.drafts.kinds, st.accepted.emitted)
    return Verified.of(st.rids[idx], np.full(len(idx), la.kind), judged, accepted)


def shape(st: Step) -> StepShape:
    """The step's forward as the cost model sees it: requests, tokens, context."""
    return StepShape(len(st.batch) + len(st.feeding), st.verify_tokens + st.prefill_tokens,
                     st.context + sum(f.start for f in st.feeding))


def predicted_s(st: Step, cost) -> float:
    """The verify time the cost model predicts for the step's forward (before it learns from it:
    what `learn` then records as `Learnt.predicted_s`)."""
    return float("nan") if cost is None else cost.predict(shape(st))


def record(st: Step, predicted: float, history: StepHistory, overhead: StepOverhead) -> StepRecord:
    """The step's `StepRecord`, into the bounded history; the overhead the gate charges drafting
    for learns from it."""
    drafts, pruned, out = st.drafts, st.pruned, st.out
    rec = StepRecord(len(st.batch), int(drafts.cu[-1]), int(pruned.kept.sum()), int(sum(st.accepted.counts)),
                     st.verify_tokens, predicted, out.wall_s, drafts.seconds, pruned.seconds,
                     pruned.probe_seconds, step_s=time.perf_counter() - st.started,
                     target_compute_s=max((r.total_s for r in out.rank_stats), default=0.0),
                     draft_compute_s=drafts.compute_seconds + (st.lookahead.seconds if st.lookahead else 0.0),
                     prefill_tokens=st.prefill_tokens,
                     rank_compute_s=tuple(r.total_s for r in out.rank_stats),
                     graph_captures=sum(r.graph_captures for r in out.rank_stats))
    history.append(rec)
    # What drafting adds outside the passes, among the steps the gate decided (prefill chunks would
    # blur it; the payoff check's plain steps skip the look-ahead and the gate, which a step the
    # gate leaves plain pays).
    if not st.feeding and st.arm != PLAIN:
        overhead.observe(rec.drafted > 0, rec.step_s - rec.target_compute_s - rec.draft_s)
    return rec
