"""What the engine remembers of its steps: the last few records, and running totals since start.

A serving engine runs forever: at 100 steps a second an ever-growing list of records would hold
~140 MB an hour. So recent steps live in a ring (for /metrics' windowed figures) and everything
else is a running sum. A caller that wants every record of a run (the bench) collects what
`Engine.step()` returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from actors.engine.stages import StepRecord


@dataclass
class StepTotals:
    """Sums over every step since the engine started."""

    steps: int = 0
    requests: int = 0
    drafted: int = 0
    kept: int = 0
    accepted: int = 0
    verify_tokens: int = 0
    prefill_tokens: int = 0
    graph_captures: int = 0
    step_s: float = 0.0
    measured_verify_s: float = 0.0

    def add(self, rec: StepRecord) -> None:
        """One more step: every other field is the sum of the StepRecord field of its name
        (written out: a loop over the fields was 27 calls a step)."""
        self.steps += 1
        self.requests += rec.requests
        self.drafted += rec.drafted
        self.kept += rec.kept
        self.accepted += rec.accepted
        self.verify_tokens += rec.verify_tokens
        self.prefill_tokens += rec.prefill_tokens
        self.graph_captures += rec.graph_captures
        self.step_s += rec.step_s
        self.measured_verify_s += rec.measured_verify_s


class StepHistory:
    """The last `keep` step records and the totals of all of them."""

    def __init__(self, keep: int = 256) -> None:
        self.recent: deque[StepRecord] = deque(maxlen=keep)
        self.totals = StepTotals()

    def append(self, rec: StepRecord) -> None:
        self.recent.append(rec)
        self.totals.add(rec)

    @property
    def steps(self) -> int:
        return self.totals.steps
