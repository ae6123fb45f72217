"""Whether speculation pays at this load, measured rather than predicted (`PayoffCheck`).

The drafting gate decides from predictions: acceptance from its trackers, time from the cost
model. Where the time is priced wrong the gate can draft at a loss while predicting a gain: on
this machine's CPU the real target's drafted token costs 1.2–1.4 × what its start-up profile
says at 16–64 requests, and the replay target given that price (`benchmarks/replay_ab.py
--forward-split 0.85,1.6`) ran the default at 0.89–0.91 × plain decoding there, its own online
correction notwithstanding (docs/benchmarks.md, session 38). D-Cut's promise is never to lose to
the best static choice; plain decoding is one, so it is measured beside the gate's.

Two arms per load band (requests decoding, bands doubling in width: `band_of`): steps the gate
decides (the *drafting* arm) and plain steps that skip the look-ahead and the gate (the *plain*
arm). Each step's outcome is its tokens a request and its wall time (its own Python included: a
plain step pays `ar`'s) over what the cost model predicts a plain step of its shape takes
(`plain_s`), so a band's steps compare across their request counts and contexts. Only steps that
feed no prompt chunk are measured: the profile's error on a mixed step is not a plain step's, and
the arms, probed at fixed counts, would sample different mixes (at 64 requests in a closed loop a
probe-time plain step had been a decode-only one and the gate's mostly mixed: a lead of 1.8 where
end to end the two were level); a mixed step plays the band's leader.
An arm's rate is a ratio of sums over its recent outcomes — tokens over time, as throughput is:
a median of each step's ratio would judge drafting at one request by its typical step, which
accepts little, and not by the long accepted runs that make its throughput. A band lets the gate
decide unless plain decoding's rate leads the drafting arm's by `confidence` standard errors
(one request's steps scatter widely — a run of eight accepted drafts, then none — so at low load
only a clear loss counts; a batch's steps scatter little, and a loss of a few percent shows in a
few dozen steps). The arm not played is probed every `probe` steps of the band (every `sure`
steps once the leader leads by `margin` and by the evidence), so a change of load or of the
machine's phase is seen. Below `least_requests` requests the gate decides alone. A band starts
on the drafting arm, with a plain probe every `warm` steps until each arm has `least` outcomes.
Deterministic (counters, no random draws): an engine's and the trace simulator's choices replay
exactly.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Band:
    """One load band's recent outcomes of each arm, (tokens a request, seconds over a plain
    step's predicted), and its step counter."""

    drafting: deque = field(default_factory=deque)
    plain: deque = field(default_factory=deque)
    steps: int = 0  # steps of this band so far
    judged: tuple | None = None  # (lead, evidence) of the outcomes as they are; None: not yet worked out

    def outcomes(self, drafts: bool) -> deque:
        return self.drafting if drafts else self.plain

    @staticmethod
    def rate(outcomes: deque) -> float:
        """Tokens a request per plain step's time, over the outcomes together."""
        return sum(t for t, _ in outcomes) / sum(s for _, s in outcomes)

    @staticmethod
    def variance(outcomes: deque) -> float:
        """The variance of `rate` as an estimate (a ratio of sums, to first order): what one
        request's bursts of accepted drafts make large and a batch's steps small."""
        n = len(outcomes)
        if n < 2:
            return math.inf
        r, total = Band.rate(outcomes), sum(s for _, s in outcomes)
        return sum((t - r * s) ** 2 for t, s in outcomes) / total ** 2 * n / (n - 1)


@dataclass
class PayoffCheck:
    least: int = 3  # outcomes of each arm before their rates decide
    warm: int = 4  # a plain probe every `warm` steps of a band until then
    probe: int = 16  # the arm not played, probed every `probe` steps of the band
    sure: int = 128  # ... every `sure` steps while the leader leads by `margin`
    margin: float = 0.15
    confidence: float = 1.0  # standard errors by which plain decoding must lead before it is played
    window: int = 32  # recent outcomes kept per arm and band
    # Fewer requests than this: the gate alone. One request's text moves between stretches that
    # repeat (drafting 2-4 x plain decoding) and stretches that do not (the gate's own time makes
    # its steps ~10 % slower than plain ones): the look-ahead tells the gate which stretch it is in
    # now, the check only what the last dozens of steps were — on the replay target it decoded
    # plainly in a third of a one-request run's steps and cost 4-9 % (docs/benchmarks.md,
    # session 38). A batch's steps mix many requests' stretches.
    least_requests: int = 6
    bands: dict[int, Band] = field(default_factory=dict)

    @staticmethod
    def band_of(requests: int) -> int:
        """The load band of a step decoding `requests` requests: 1, 2, 3–5, 6–11, 12–23, 24–47,
        48–95, ... — powers of two from 4 on lie inside a band, not at its edge: in a closed loop at
        16 a step decodes 15 requests while a newcomer's prompt is fed, and bands cut at 16 had
        measured one load as two, one of them mixed with the run's tail."""
        return (max(1, requests) * 4 // 3).bit_length() - 1

    @staticmethod
    def lowest(band: int) -> int:
        """The fewest requests of a band."""
        return -(-3 * (1 << band) // 4)

    def drafts(self, requests: int, measured: bool = True) -> bool:
        """Whether a step decoding `requests` requests lets the gate decide (True) or decodes
        plainly (False). A `measured` step (one whose outcome `observe` will be told) counts in
        its band and may be a probe: call once a step. One that is not — a step that also feeds
        prompt chunks — plays the band's leader and changes nothing."""
        if requests < self.least_requests:
            return True
        band = self.bands.get(self.band_of(requests))
        if not measured:
            lead, z = (None, 0.0) if band is None else self._judge(band)
            return lead is None or z >= -self.confidence
        if band is None:
            band = self.bands[self.band_of(requests)] = Band()
        band.steps += 1
        lead, z = self._judge(band)
        if lead is None:  # still learning both arms: the drafting arm, a plain probe now and then
            return band.steps % self.warm != 0 or len(band.plain) >= self.least
        leader = z >= -self.confidence  # the gate's arm unless plain decoding is shown to deliver more
        sure = abs(lead - 1.0) >= self.margin and abs(z) >= self.confidence
        return leader if band.steps % (self.sure if sure else self.probe) else not leader

    def _judge(self, band: Band) -> tuple[float | None, float]:
        """(lead, evidence) of a band, worked out once per new outcome (a step asks every time:
        six passes over its windows cost ~18 µs)."""
        if band.judged is None:
            lead = self.lead(band)
            band.judged = (lead, 0.0 if lead is None else self.evidence(band))
        return band.judged

    def lead(self, band: Band) -> float | None:
        """The drafting arm's rate over the plain arm's (None: either has fewer than `least`
        outcomes)."""
        if len(band.drafting) < self.least or len(band.plain) < self.least:
            return None
        return Band.rate(band.drafting) / Band.rate(band.plain)

    def evidence(self, band: Band) -> float:
        """How many standard errors the drafting arm's rate lies above the plain arm's (negative:
        below; infinite where both arms' outcomes are exact)."""
        diff = Band.rate(band.drafting) - Band.rate(band.plain)
        se = math.sqrt(Band.variance(band.drafting) + Band.variance(band.plain))
        if se == 0.0 or not math.isfinite(se):
            return 0.0 if diff == 0.0 or not math.isfinite(se) else math.copysign(math.inf, diff)
        return diff / se

    def observe(self, requests: int, drafts: bool, tokens: float, seconds: float, plain_s: float) -> None:
        """One step's outcome: `tokens` emitted by its `requests` decoding requests in `seconds` of
        wall time, on the arm `drafts`; `plain_s` what the cost model predicts a plain step of its
        shape takes (the scale that makes a band's steps comparable)."""
        if requests < max(1, self.least_requests) or seconds <= 0 or plain_s <= 0:
            return
        band = self.bands.setdefault(self.band_of(requests), Band())
        kept = band.outcomes(drafts)
        band.judged = None
        kept.append((tokens / requests, seconds / plain_s))
        if len(kept) > self.window:
            kept.popleft()

    def as_dict(self) -> dict:
        """Each band's recent outcomes, for the learned state a restarted engine starts from
        (`dcut_core/learned.py`)."""
        return {str(b): {"drafting": [list(o) for o in band.drafting], "plain": [list(o) for o in band.plain]}
                for b, band in sorted(self.bands.items())}

    def restore(self, d: dict) -> None:
        """The bands' outcomes as `as_dict` wrote them (ValueError on anything else): a band whose
        arms both have `least` outcomes is decided from its first step, and probes on schedule."""
        bands = {}
        for b, arms in d.items():
            band = bands[int(b)] = Band()
            for drafts in (True, False):
                for tokens, seconds in arms["drafting" if drafts else "plain"][-self.window:]:
                    if not (float(tokens) >= 0 and float(seconds) > 0):  # NaN fails too
                        raise ValueError(f"a payoff outcome needs tokens >= 0 and seconds > 0: {tokens}, {seconds}")
                    band.outcomes(drafts).append((float(tokens), float(seconds)))
        self.bands = bands

    def leads(self) -> dict[int, float | None]:
        """Each band's lead (its lowest request count -> drafting over plain), for /metrics and
        the benchmarks."""
        return {self.lowest(b): self.lead(band) for b, band in sorted(self.bands.items())}
