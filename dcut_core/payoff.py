"""Whether speculation pays at this load, measured rather than predicted (`PayoffCheck`).

The drafting gate decides from predictions: acceptance from its trackers, time from the cost
model. Where the time is priced wrong the gate can draft at a loss while predicting a gain: on
this machine's CPU the real target's drafted token costs 1.2–1.4 × what its start-up profile
says at 16–64 requests, and the replay target given that price (`benchmarks/replay_ab.py
--forward-split 0.85,1.6`) ran the default at 0.89–0.91 × plain decoding there, its own online
correction notwithstanding (docs/benchmarks.md, session 38). D-Cut's promise is never to lose to
the best static choice; plain decoding is one, so it is measured beside the gate's.

Two arms per load band (requests decoding, in powers of two): steps the gate decides (the
*drafting* arm) and plain steps that skip the look-ahead and the gate (the *plain* arm). Each
step's outcome is its tokens a request and its wall time (its own Python included: a plain step
pays `ar`'s) over what the cost model predicts a plain step of its shape takes (`plain_s`), so a
band's steps compare across their request counts, contexts and prefill chunks. An arm's rate is
a ratio of sums over its recent outcomes — tokens over time, as throughput is: a median of each
step's ratio would judge drafting at one request by its typical step, which accepts little,
and not by the long accepted runs that make its throughput. A band drafts while the drafting
arm's rate is at least the plain arm's, and decodes plainly otherwise; the arm not played is
probed every `probe` steps of the band (every `sure` steps once the leader leads by `margin`),
so a change of load or of the machine's phase is seen. A band starts on the drafting arm, with
a plain probe every `warm` steps until each arm has `least` outcomes. Deterministic (counters,
no random draws): an engine's and the trace simulator's choices replay exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Band:
    """One load band's recent outcomes of each arm, (tokens a request, seconds over a plain
    step's predicted), and its step counter."""

    drafting: deque = field(default_factory=deque)
    plain: deque = field(default_factory=deque)
    steps: int = 0  # steps of this band so far

    def outcomes(self, drafts: bool) -> deque:
        return self.drafting if drafts else self.plain

    @staticmethod
    def rate(outcomes: deque) -> float:
        """Tokens a request per plain step's time, over the outcomes together."""
        return sum(t for t, _ in outcomes) / sum(s for _, s in outcomes)


@dataclass
class PayoffCheck:
    least: int = 3  # outcomes of each arm before the medians decide
    warm: int = 4  # a plain probe every `warm` steps of a band until then
    probe: int = 16  # the arm not played, probed every `probe` steps of the band
    sure: int = 128  # ... every `sure` steps while the leader leads by `margin`
    margin: float = 0.15
    window: int = 32  # recent outcomes kept per arm and band
    bands: dict[int, Band] = field(default_factory=dict)

    @staticmethod
    def band_of(requests: int) -> int:
        """The load band of a step decoding `requests` requests: 1, 2–3, 4–7, 8–15, ..."""
        return max(1, requests).bit_length() - 1

    def drafts(self, requests: int) -> bool:
        """Whether a step decoding `requests` requests lets the gate decide (True) or decodes
        plainly (False). Counts the step in its band: call once a step."""
        band = self.bands.setdefault(self.band_of(requests), Band())
        band.steps += 1
        lead = self.lead(band)
        if lead is None:  # still learning both arms: the drafting arm, a plain probe now and then
            return band.steps % self.warm != 0 or len(band.plain) >= self.least
        every = self.sure if abs(lead - 1.0) >= self.margin else self.probe
        leader = lead >= 1.0
        return leader if band.steps % every else not leader

    def lead(self, band: Band) -> float | None:
        """The drafting arm's rate over the plain arm's (None: either has fewer than `least`
        outcomes)."""
        if len(band.drafting) < self.least or len(band.plain) < self.least:
            return None
        return Band.rate(band.drafting) / Band.rate(band.plain)

    def observe(self, requests: int, drafts: bool, tokens: float, seconds: float, plain_s: float) -> None:
        """One step's outcome: `tokens` emitted by its `requests` decoding requests in `seconds` of
        wall time, on the arm `drafts`; `plain_s` what the cost model predicts a plain step of its
        shape takes (the scale that makes a band's steps comparable)."""
        if requests <= 0 or seconds <= 0 or plain_s <= 0:
            return
        band = self.bands.setdefault(self.band_of(requests), Band())
        kept = band.outcomes(drafts)
        kept.append((tokens / requests, seconds / plain_s))
        if len(kept) > self.window:
            kept.popleft()

    def leads(self) -> dict[int, float | None]:
        """Each band's lead (its lowest request count -> drafting over plain), for /metrics and
        the benchmarks."""
        return {1 << b: self.lead(band) for b, band in sorted(self.bands.items())}
