"""What the engine remembers of its steps: the last few records, and running totals since start.

A serving engine runs forever: at 100 steps a second an ever-growing list of records would hold
~140 MB an hour. So recent steps live in a ring (for /metrics' windowed figures) and everything
else is a running sum. A caller that wants every record of a run (the bench) collects what
`Engine.step()` returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

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
        self.steps += 1
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(rec, name))


_SUMMED = tuple(f.name for f in fields(StepTotals) if f.name != "steps")  # StepRecord's fields of the same names


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
