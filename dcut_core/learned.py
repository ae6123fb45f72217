"""What an engine has learned that outlives a process: per drafter kind, the confidence
calibration and the acceptance tracker's global rates; the drafting costs; the step's own time;
the cost model's online correction; the gate's exploration counter; the payoff check's recent
outcomes by load band.

Saved beside the cost-model cache and reloaded at start, or taken from the bundle's prior (made
from traces of training prompts, `dcut trace --prior`), so a new replica starts warm: its gate
does not explore every step until it has seen enough verifications, and drafts only where
drafting pays from its first step. Per-request state (a request's own factor, which kinds it
tried) is not kept: requests do not outlive the process.

Kinds are matched by name, so a state saved by a unit hosting block, mtp and ngram warms one
hosting only ngram; positions past a saved block keep their priors, and a state saved at one block
warms an engine of another (the calibration's position weight rescaled to it).

A bundle's prior also names the kinds `--drafter tuned` hosts (`tuned`): the set of two or more
kinds whose per-request choice replays fastest over the model's training traces
(`dcut_core.trace_sim.choose_hosted`, `dcut prior`); empty, `tuned` hosts every kind the bundle
holds, as `--drafter auto` always does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core.acceptance import Calibrator
from dcut_core.drafting import AcceptanceTracker, DraftCost, Exploration
from dcut_core.payoff import PayoffCheck

VERSION = 1


@dataclass(frozen=True)
class KindState:
    """One drafter kind: its calibration weights and the tracker's decayed counts by position."""

    weights: tuple[float, ...]
    calibrated: int  # judged drafts the calibration has seen
    accepted: tuple[float, ...]
    judged: tuple[float, ...]
    observations: int
    draft: DraftCost | None = None  # its drafting cost, when known

    @classmethod
    def of(cls, cal: Calibrator, tracker: AcceptanceTracker, draft: DraftCost | None = None) -> KindState:
        return cls(tuple(map(float, cal.weights)), int(cal.observed), tuple(map(float, tracker.accepted)),
                   tuple(map(float, tracker.judged)), int(tracker.observations), draft)

    def restore(self, cal: Calibrator, tracker: AcceptanceTracker) -> None:
        """Into a calibrator and tracker of any block: the calibration's position term is position
        / block, so its weight is rescaled to the estimator's block (the saved block is its
        tracker's width) and every draft's estimate stays what it was — a prior fitted at block 8
        read as-is by a block-16 engine had halved the position's effect."""
        cal.weights = np.array(self.weights, dtype=np.float64)
        if self.accepted and len(self.accepted) != cal.block:
            cal.weights[3] *= cal.block / len(self.accepted)
        cal.observed = self.calibrated
        n = min(len(self.accepted), tracker.block)
        tracker.accepted[:n] = self.accepted[:n]
        tracker.judged[:n] = self.judged[:n]
        tracker.observations = self.observations


@dataclass(frozen=True)
class LearnedState:
    kinds: dict[str, KindState]
    shared: float = 0.0  # what any drafting call costs beyond its kinds' passes
    overhead: dict[str, float] = field(default_factory=dict)  # "plain", "drafting": the step's own time
    cost_log_ratio: float = 0.0  # the verify cost model's online correction (log measured / predicted)
    explored: int = 0  # the gate's exploration counter
    tuned: tuple[str, ...] = ()  # a prior's kinds for `--drafter tuned` (empty: every kind the bundle holds)
    payoff: dict = field(default_factory=dict)  # the payoff check's recent outcomes by band (`PayoffCheck.as_dict`)

    def as_dict(self) -> dict:
        def kind(k: KindState) -> dict:
            d = {"weights": list(k.weights), "calibrated": k.calibrated, "accepted": list(k.accepted),
                 "judged": list(k.judged), "observations": k.observations}
            if k.draft is not None:
                d["draft"] = [k.draft.fixed, k.draft.per_request, k.draft.per_position, k.draft.per_context,
                              k.draft.per_pass]
            return d

        return {"version": VERSION, "kinds": {n: kind(k) for n, k in self.kinds.items()}, "shared": self.shared,
                "overhead": dict(self.overhead), "cost_log_ratio": self.cost_log_ratio, "explored": self.explored,
                "tuned": list(self.tuned), "payoff": self.payoff}

    @classmethod
    def from_dict(cls, d: dict) -> LearnedState:
        if d.get("version") != VERSION:
            raise ValueError(f"unsupported learned-state version {d.get('version')!r}")
        kinds = {}
        for name, k in d["kinds"].items():
            draft = DraftCost(*map(float, k["draft"])) if k.get("draft") else None
            kinds[name] = KindState(tuple(map(float, k["weights"])), int(k["calibrated"]),
                                    tuple(map(float, k["accepted"])), tuple(map(float, k["judged"])),
                                    int(k["observations"]), draft)
        payoff = dict(d.get("payoff") or {})
        PayoffCheck().restore(payoff)  # checked now: a bad entry makes the file unreadable, not the start
        return cls(kinds, float(d.get("shared", 0.0)), {k: float(v) for k, v in (d.get("overhead") or {}).items()},
                   float(d.get("cost_log_ratio", 0.0)), int(d.get("explored", 0)), tuple(d.get("tuned") or ()),
                   payoff)

    def restore(self, names: tuple[str, ...], calibrators: list[Calibrator], trackers: list[AcceptanceTracker],
                exploration: Exploration) -> list[str]:
        """Warm the estimators of the kinds `names` (in their order) from this state; returns the
        kinds it had nothing for."""
        missing = []
        for name, cal, tracker in zip(names, calibrators, trackers, strict=True):
            k = self.kinds.get(name)
            if k is None:
                missing.append(name)
            else:
                k.restore(cal, tracker)
        exploration.steps = self.explored
        return missing
