"""Where a chained drafter stops (MTP: one sequential pass per draft position).

The gate plans each request's drafts from predictions made before drafting. A chained drafter
learns more as it drafts: each pass gives its draft's confidence, and the kind's calibrator turns
confidences into the draft's chance to pass given the ones before it. So the chain is cut while
it runs, pass by pass:

- a request stops at a draft whose survival (the product of the calibrated chances up to and
  including it) is below `per_draft`: the tokens the step would make, at plain decoding's rate,
  in the time verifying one more token takes. That draft is not worth its verification, nor is
  any later one (survival only falls), so it is dropped and the request drafts no further —
  except a first draft, which stays: the gate chose to draft the request and its pass is paid,
  pruning still decides whether it is verified, and a request left with none would call its
  fallback kind and teach the trackers a rejection no verification saw;
- the chain stops after a pass when the survivals of the requests still drafting sum below
  `per_pass`: the tokens that rate makes in one more pass of the chain — the next pass's drafts
  (no likelier than these) cannot pay for it.

Exact replays of the engine's decisions over counterfactual traces put this at +0.10 × `ar` for
MTP at C = 1 and up to +0.06 for `auto`; end to end on this CPU it does not pay (MTP 0.86–0.89 ×
uncut at C = 4 and 16): reading each pass's confidences costs 30 µs at one request and 175 µs at
16, 10–15 % of an MTP pass here, which the simulator does not charge (docs/benchmarks.md, session
24). So `EngineConfig.chain_stop` is off by default; it only drafts less: what is verified stays
the target's call, and output is unchanged either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcut_core.acceptance import Calibrator
from dcut_core.pruning import StepCost


@dataclass(frozen=True)
class ChainStop:
    """The rule one chained kind's drafter applies this step: its calibration (`Calibrator`'s
    weights and block) and the two prices above, in tokens."""

    weights: tuple[float, ...]
    block: int
    per_draft: float
    per_pass: float

    @classmethod
    def of(cls, calibrator: Calibrator, verify: StepCost, requests: int, pass_seconds: float) -> ChainStop:
        """The step's rule: plain decoding's rate is `requests` tokens in the verify time of
        `requests` tokens; a draft costs one more token's verify time, a pass `pass_seconds`."""
        base, more = (float(x) for x in verify.seconds(np.array([requests, requests + 1])))
        rate = requests / base if base > 0 else 0.0
        return cls(tuple(float(w) for w in calibrator.weights), calibrator.block, rate * (more - base),
                   rate * pass_seconds)

    def chances(self, confidence: np.ndarray, margin: np.ndarray, position: int) -> np.ndarray:
        """Calibrated chance of each draft at `position` (0-based) to pass, its prefix passed."""
        c = np.asarray(confidence, dtype=np.float64)
        cal = Calibrator(block=self.block, weights=np.asarray(self.weights, dtype=np.float64))
        return cal.estimate(c, margin, np.full(len(c), position))


class ChainCut:
    """One chain's cut as its passes run: `after_pass` reads each pass's confidences and says
    whether to run another; `lengths` is then how many drafts each request keeps."""

    def __init__(self, rule: ChainStop | None, wanted: np.ndarray) -> None:
        self.rule = rule
        self.lengths = np.asarray(wanted, dtype=np.int64).copy()
        self.survival = np.ones(len(self.lengths))
        self.passes = 0

    def after_pass(self, confidence: np.ndarray, margin: np.ndarray) -> bool:
        """Pass `passes` made every row's draft at that position (rows past their length are
        ignored); cut the rows whose draft is not worth verifying, and answer whether the chain
        runs another pass."""
        s = self.passes
        self.passes += 1
        live = self.lengths > s
        if self.rule is None:
            return bool((self.lengths > s + 1).any())
        self.survival = np.where(live, self.survival * self.rule.chances(confidence, margin, s), self.survival)
        cut = live & (self.survival < self.rule.per_draft)  # no later draft of theirs is worth it either
        self.lengths[cut] = max(s, 1)  # the first draft stays (see the module)
        live &= ~cut
        if not (self.lengths[live] > s + 1).any():
            return False
        if float(self.survival[live].sum()) < self.rule.per_pass:
            self.lengths[live] = s + 1  # the chain stops here: no request keeps a draft past this pass
            return False
        return True


def cut_lengths(rule: ChainStop | None, wanted: np.ndarray, confidence: np.ndarray,
                margin: np.ndarray) -> tuple[np.ndarray, int]:
    """(drafts each request keeps, passes run) of a chain whose drafts are known in full
    (confidence, margin [R, n] by position; the simulator's and the tests' way in)."""
    cut = ChainCut(rule, wanted)
    if not len(cut.lengths) or cut.lengths.max(initial=0) <= 0:
        return cut.lengths, 0
    while cut.after_pass(confidence[:, cut.passes], margin[:, cut.passes]):
        pass
    return cut.lengths, cut.passes
