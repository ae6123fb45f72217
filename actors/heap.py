"""The serving process's Python heap and the cyclic garbage collector's pauses.

A serving process holds a few hundred thousand long-lived objects once Ray, torch, the model and
the engine are up (365,000 in the engine's process on the bundled model). CPython's collector
scans every one of them in a full (generation-2) collection — 135–190 ms on this machine for the
replay engine's 246,000 — stopping the step loop mid-step: on a GPU several decode steps lost at
once, a latency spike every request in flight feels. How often depends on how many objects the
requests keep alive: over three waves of 1,024 requests (`dcut`, the replay engine) ten full
collections took 1.5–1.6 s of a 4–5 s run (docs/benchmarks.md, "Garbage-collection pauses").

`freeze` moves everything alive at the end of start-up into the permanent generation
(`gc.freeze`; vLLM freezes its heap after warm-up the same way, SGLang offers it), so a full
collection scans only what serving made since, and raises the young generation's threshold, so
the objects a step makes and drops do not set off collections that find nothing. Reference
counting still frees frozen objects; only a cycle among them is never collected — so whatever
lets go of a structure with cycles on purpose (a closed rank and its guests, which hold device
memory) calls `collect_everything` first.

`Pauses` counts the collector's pauses of one process (`gc.callbacks`) for /metrics and the
benchmarks.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

YOUNG = 50_000  # the youngest generation's threshold while frozen (CPython's default: 700)
# The collector's thresholds before the first `freeze` (None: not raised), for `thaw`: process-wide,
# as the collector is — two engines in one process (tests) must not leave each other's behind.
_before: tuple[int, int, int] | None = None


def freeze(young: int = YOUNG) -> None:
    """Collect, then freeze every object alive now (the end of a process's start-up), and let
    `young` more container objects than died be made before a young collection (a step at 1,024
    requests makes and drops tens of thousands; at 700 they set off collections that find almost
    nothing, and push the older generations into theirs)."""
    global _before
    if _before is None:
        _before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(young, _before[0]), *_before[1:])


def collect_everything() -> None:
    """A full collection that reaches frozen objects too (frozen again after, less what it
    freed, if any were): before memory held by cycles must be handed back."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()


def thaw() -> None:
    """Frozen objects become collectable again, and the thresholds the first `freeze` found are
    back (a process letting its engine go)."""
    global _before
    gc.unfreeze()
    if _before is not None:
        gc.set_threshold(*_before)
        _before = None


@dataclass
class Pauses:
    """The collector's pauses in this process while installed: count and seconds per generation,
    and the longest."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: float = 0.0
    _started: float | None = None

    def install(self) -> Pauses:
        if self._on not in gc.callbacks:
            gc.callbacks.append(self._on)
        return self

    def remove(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            s = time.perf_counter() - self._started
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += s
            self.longest_s = max(self.longest_s, s)
            self._started = None

    def stats(self) -> dict:
        """For /metrics: collections and seconds paused since install, the longest pause, and
        the objects frozen."""
        return {"gc_collections": sum(self.count), "gc_full_collections": self.count[2],
                "gc_pause_s": sum(self.seconds), "gc_longest_pause_s": self.longest_s,
                "gc_frozen_objects": gc.get_freeze_count()}
