"""`benchmarks/trace_experiments.py`'s experiments 6 and 7 on a hand-made trace: the target's
confidence is bucketed where the drafts it should sort are (a kind that passes only where the
target is sure reads 0 in the low buckets and 3 in the high ones, a kind that passes alike reads
flat), and a unit that hosts every kind but never drafts with the neural ones drafts with them
less than `auto` does, also where the n-gram kind has nothing to draft."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

from dcut_core.cost_model import CostModel
from dcut_core.counterfactual import RequestTrace, Trace, TraceCosts
from dcut_core.drafting import DraftCost
from dcut_core.hardware import ModelShape
from dcut_core.learned import LearnedState
from deployments.bundle import BUNDLED

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_experiments as tx

KINDS = ("block", "mtp", "ngram")
SHAPE = ModelShape("tiny", layers=2, hidden=8, heads=2, kv_heads=2, head_dim=4, vocab=32, intermediate=16)


def trace(seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    width, requests = 7, []
    for _ in range(6):
        t = 40
        sure = rng.random(t).astype(np.float32)
        sure[0] = 0.0
        accepted = np.zeros((3, t), dtype=np.int64)
        accepted[0, 1:] = 1  # block: one draft passes everywhere
        accepted[1, 1:] = np.where(sure[1:] > 0.5, width, 0)  # MTP: all where the target is sure, none elsewhere
        accepted[2, 1:] = 2  # n-gram: two everywhere
        count = np.full((3, t), width, dtype=np.int64)
        count[2, ::3] = 0  # the n-gram kind finds no match at every third position: another kind or none
        accepted[2, ::3] = 0
        count[:, 0] = 0
        conf = np.full((3, t, width), 0.9, np.float32)
        requests.append(RequestTrace(12, np.arange(t, dtype=np.int64), count, accepted, conf,
                                     np.full((3, t, width), 0.5, np.float32), np.zeros((3, t, width), np.int64), sure))
    model = CostModel(SHAPE, 1, {"fixed": 0.010, "dense": 0.0005})
    costs = TraceCosts(model, 1.0, (DraftCost(1e-4, 0.0, 1e-5),) * 2 + (DraftCost(0.0, 0.0, 0.0),),  # drafts ~free
                       own=(0.0005, 0.0), own_policy=(0.0003, 2e-5), own_drafting=(0.0002, 3e-5),
                       own_one=((0.0002, 1e-5), (0.0001, 2e-5)), choose=(0.0002, 1e-5))
    return Trace(KINDS, 8, 40, tuple(requests), costs)


def test_the_target_confidence_sorts_the_kind_it_predicts_and_not_the_others():
    res = tx.target_signal(trace(1), trace(2))
    mtp, ngram = res["first3"]["held-out"]["mtp"], res["first3"]["held-out"]["ngram"]
    assert mtp[0] == 0.0 and mtp[-1] == 3.0  # quintiles: the lowest all below 0.5, the highest all above
    assert ngram == [2.0] * tx.SURE_BUCKETS  # where it drafts, two pass in every bucket alike
    assert set(res["runs"]) == {"mtp", "mtp+ngram", "block+mtp+ngram", "ngram"}
    assert all(np.isfinite(x) and x > 0 for rows in res["runs"].values() for row in rows.values() for x in row)


def test_a_unit_that_never_drafts_neural_drafts_with_them_less_than_auto():
    """From the bundle's prior (the same three kinds), as served: its trackers know the neural
    kinds, so `auto` drafts with them where the n-gram kind finds nothing; the unit that never
    may not."""
    prior = LearnedState.from_dict(json.loads((BUNDLED / "prior.json").read_text()))
    res = tx.hosting(trace(3), prior)
    auto, never = res["auto"], res["never the neural kinds"]
    assert sum(auto["neural_steps"]) > 0 and never["neural_steps"] == [0] * len(tx.LEVELS)
    assert all(np.isfinite(x) and x > 0 for row in res.values() for x in row["ratio"])
