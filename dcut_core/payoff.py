"""Whether speculation pays at this load, measured rather than predicted (`PayoffCheck`).

The drafting gate decides from predictions: acceptance from its trackers, time from the cost
model. Where the time is priced wrong the gate can draft at a loss while predicting a gain: on
this machine's CPU the real target's drafted token costs 1.2–1.4 × what its start-up profile
says at 16–64 requests, and the replay target given that price (`benchmarks/replay_ab.py
--forward-split 0.85,1.6`) ran the default at 0.89–0.91 × plain decoding there, its own online
correction notwithstanding (docs/benchmarks.md, session 38). D-Cut's promise is never to lose to
the best static choice; plain decoding is one, so it is measured beside the gate's.

Arms per load band (requests decoding, bands doubling in width: `band_of`): steps the gate decides
(the *drafting* arm), plain steps that skip the look-ahead and the gate (the *plain* arm), and, in
an engine hosting several drafter kinds, steps whose gate may choose only one kind (an arm per
kind: per-request choice among kinds had measured 0.86–0.91 × the best single kind at 16 requests,
the chooser's own time and the passes of kinds drafting for a few requests each among the causes —
docs/benchmarks.md, sessions 34 and 38; the single kind is a static choice the promise must not
lose to either). Each step's outcome is its tokens a request and its wall time (its own Python
included: a plain step pays `ar`'s) over what the cost model predicts a plain step of its shape
takes (`plain_s`), so a band's steps compare across their request counts and contexts. Only steps
that feed no prompt chunk are measured: the profile's error on a mixed step is not a plain step's,
and the arms, probed at fixed counts, would sample different mixes (at 64 requests in a closed
loop a probe-time plain step had been a decode-only one and the gate's mostly mixed: a lead of 1.8
where end to end the two were level); a mixed step plays the band's leader.
An arm's rate is a ratio of sums over its recent outcomes — tokens over time, as throughput is: a
median of each step's ratio would judge drafting at one request by its typical step, which accepts
little, and not by the long accepted runs that make its throughput. A band plays the drafting arm
unless another arm's rate leads it by `confidence` standard errors (then the best such arm): one
request's steps scatter widely — a run of eight accepted drafts, then none — so at low load only a
clear loss counts; a batch's steps scatter little, and a loss of a few percent shows in a few
dozen steps. An arm not played is probed every `probe` steps of the band — every other probe the
one most likely to lead (its rate's upper bound highest), the others in turn; one that the leader
leads by `margin` and by the evidence only every `sure` steps — so a change of load or of the
machine's phase is seen; and while the most likely arm's upper bound passes the leader's rate, it
is probed every `warm` steps besides (an arm that may lead is measured until it is known whether
it does: it costs in proportion to how far behind it is, and that is little while it may lead).
Below `least_requests` requests the gate decides alone; below `plain_requests` the arms are the
gate's and each kind's, not plain decoding's (`Band.plain`). A band starts on the drafting arm,
probing the others in turn every `warm` steps until plain decoding's arm has `least` outcomes and
each kind's arm `least_kind` (one: it is then chased as an arm that may lead). Deterministic
(counters, no random draws): an engine's and the trace simulator's choices replay exactly.

Between the gate over every kind and one kind's arm the tie goes to the one kind
(`kind_confidence` below 0): its steps run no chooser and pass no other kind (~0.2 ms a step
less of own time at 16 requests, session 39), and in hindsight the gate's per-request choice
among this model's kinds is worth nothing over the n-gram kind's own depth from 4 requests on
(session 41). In exact replays of two training traces (384 requests, 5 orders, C = 1–64) the
kinds' arms from 3 requests and the tie to the single kind took `auto` 1.184 → 1.199 × plain
decoding (geometric mean; n-gram alone 1.223), most at C = 4 (1.306 → 1.388 and 1.233 → 1.261
on the two traces) and C = 8–32 (+1–2 %); kinds' arms at 1–2 requests lost up to 4 %
(docs/benchmarks.md, session 42).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PLAIN, DRAFTING = 0, 1  # the arms every check has; an engine of several kinds adds one per kind


def kind_arm(kind: str) -> str:
    """The name of the arm whose gate may choose only `kind`."""
    return f"kind:{kind}"


def arms_of(kinds, per_kind: bool = True) -> tuple[str, ...]:
    """The arms of an engine hosting `kinds`: plain, the gate over every kind, and with several
    kinds (and `per_kind`) the gate over each alone."""
    return ("plain", "drafting", *(kind_arm(k) for k in kinds)) if per_kind and len(kinds) > 1 \
        else ("plain", "drafting")


def kind_of(arm: int) -> int | None:
    """The kind (its index among the engine's, in `arms_of`'s order) an arm restricts the gate to;
    None for plain decoding and the gate over every kind."""
    return arm - DRAFTING - 1 if arm > DRAFTING else None


def _z(rate_a: float, var_a: float, rate_b: float, var_b: float) -> float:
    """Standard errors by which rate a lies above rate b (negative: below; infinite where both are
    exact; 0 where either is unknown)."""
    diff, se = rate_a - rate_b, math.sqrt(var_a + var_b)
    if se == 0.0 or not math.isfinite(se):
        return 0.0 if diff == 0.0 or not math.isfinite(se) else math.copysign(math.inf, diff)
    return diff / se


@dataclass
class Band:
    """One load band's recent outcomes of each arm, (tokens a request, seconds over a plain
    step's predicted), and its counters."""

    outcomes: list[deque]  # per arm
    plain: bool = True  # the plain arm is in play (the band's requests reach `plain_requests`)
    steps: int = 0  # measured steps of this band so far
    probes: int = 0  # probes so far (whose turn is next among the arms due)
    # (leader, unsure, behind, the most promising, whether it may lead) as the outcomes are; None: not worked out yet
    # (a step asks every time; the passes over the windows cost ~18 µs), False: still learning
    judged: tuple | bool | None = None

    @classmethod
    def of(cls, arms: int, plain: bool = True) -> Band:
        return cls([deque() for _ in range(arms)], plain)

    def probe(self, arms: list[int]) -> int:
        """The next of `arms` in turn."""
        self.probes += 1
        return arms[(self.probes - 1) % len(arms)]

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
    arms: tuple[str, ...] = ("plain", "drafting")  # PLAIN and DRAFTING first (`arms_of`)
    least: int = 3  # outcomes of the plain and drafting arms before their rates decide
    # ... and of each kind's arm. One: an arm of one outcome has no variance yet, so it can neither
    # lead nor be behind — it is the likeliest to lead (an unbounded upper bound) and probed every
    # `warm` steps until its evidence says — while the plain and drafting arms' judgement plays
    # meanwhile. At `least` each, five arms besides drafting had taken 60 measured steps to warm up,
    # and at 32–64 requests, where a closed loop's steps mostly feed prompts, a band seldom left its
    # warm-up (exact replays: docs/benchmarks.md, session 40).
    least_kind: int = 1
    warm: int = 4  # a probe every `warm` steps of a band until then, and of an arm that may lead
    probe: int = 16  # the arms not played, probed every `probe` steps of the band (`arm` says which)
    sure: int = 128  # ... every `sure` steps while the leader leads it by `margin` and the evidence
    margin: float = 0.15
    confidence: float = 1.0  # standard errors by which plain decoding must lead the drafting arm to be played
    kind_confidence: float = -0.5  # ... and a kind's arm (below 0: played unless it trails by more)
    window: int = 32  # recent outcomes kept per arm and band
    # Fewer requests than `plain_requests`: plain decoding is not weighed. One request's text moves
    # between stretches that repeat (drafting 2-4 x plain decoding) and stretches that do not (the
    # gate's own time makes its steps ~10 % slower than plain ones): the look-ahead tells the gate
    # which stretch it is in now, the check only what the last dozens of steps were — on the
    # replay target it decoded plainly in a third of a one-request run's steps and cost 4-9 %
    # (docs/benchmarks.md, session 38). A batch's steps mix many requests' stretches.
    # Fewer than `least_requests`: the gate alone. Between kinds the choice is which drafts to
    # verify, not whether to, and three to five requests already show which kind's steps deliver
    # more (exact replays at C = 4: +2–6 %; kinds' arms at 1–2 requests: up to −4 %).
    least_requests: int = 3
    plain_requests: int = 6
    bands: dict[int, Band] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arms = tuple(self.arms)
        if self.arms[:2] != ("plain", "drafting") or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"a payoff check's arms are plain, drafting, then others, each once: {self.arms}")
        # outcomes each arm needs before a judgement: `least` for plain and drafting, `least_kind` for a kind's
        self.least_of = tuple(self.least if a <= DRAFTING else self.least_kind for a in range(len(self.arms)))

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

    def arm(self, requests: int, measured: bool = True) -> int:
        """The arm a step decoding `requests` requests plays (an index into `arms`: PLAIN decodes
        plainly, DRAFTING lets the gate decide, another restricts the gate to its kind). A
        `measured` step (one whose outcome `observe` will be told) counts in its band and may be
        a probe: call once a step. One that is not — a step that also feeds prompt chunks — plays
        the band's leader and changes nothing."""
        if not self.measures(requests):
            return DRAFTING
        key = self.band_of(requests)
        band = self.bands.get(key)
        if not measured:
            judged = False if band is None else self._judge(band)
            return judged[0] if judged else DRAFTING
        if band is None:
            band = self.bands[key] = self._band(key)
        band.steps += 1
        judged = self._judge(band)
        if not judged:  # still learning the arms: the drafting arm, the others probed in turn
            lacking = [a for a in self._arms(band) if a != DRAFTING and len(band.outcomes[a]) < self.least_of[a]]
            return band.probe(lacking) if lacking and band.steps % self.warm == 0 else DRAFTING
        leader, unsure, behind, promising, chasing = judged
        if chasing and band.steps % self.warm == 0:  # it may lead: measured until it is known whether it does
            return promising
        if behind and band.steps % self.sure == 0:
            return band.probe(behind)
        if unsure and band.steps % self.probe == 0:
            # Every other probe the arm most likely to lead (the highest upper bound: an arm a few
            # percent ahead needs a dozen outcomes to show it), the others in turn (none left stale).
            return promising if (band.steps // self.probe) % 2 else band.probe(unsure)
        return leader

    def measures(self, requests: int) -> bool:
        """Whether a step of `requests` decoding requests has arms to choose between (from
        `least_requests` with several kinds, from `plain_requests` with one)."""
        least = self.least_requests if len(self.arms) > 2 else max(self.least_requests, self.plain_requests)
        return requests >= max(1, least)

    def _band(self, key: int) -> Band:
        return Band.of(len(self.arms), plain=self.lowest(key) >= self.plain_requests)

    def _arms(self, band: Band) -> range | list[int]:
        """The arms in play in a band."""
        return range(len(self.arms)) if band.plain else range(DRAFTING, len(self.arms))

    def _judge(self, band: Band) -> tuple | bool:
        """(leader, arms unsure, arms behind, the unsure arm of the highest upper bound, whether
        that bound passes the leader's rate) of a band, or False while an arm has fewer than
        `least` outcomes; worked out once per new outcome."""
        if band.judged is None:
            band.judged = self._judged(band)
        return band.judged

    def _judged(self, band: Band) -> tuple | bool:
        arms = self._arms(band)
        if any(len(band.outcomes[a]) < self.least_of[a] for a in arms):
            return False
        # each window read once a judgement (the step loop's); an arm out of play never leads
        rates = [Band.rate(o) if len(o) else 0.0 for o in band.outcomes]
        var = [Band.variance(o) for o in band.outcomes]

        def z(a: int, b: int) -> float:
            return _z(rates[a], var[a], rates[b], var[b])

        # An arm of one outcome has no variance yet (`_z` 0: no evidence either way): a kind's leads
        # if that outcome is no worse than the gate's rate (played, it soon has a second), and
        # plain decoding needs `least` outcomes anyway.
        ahead = [a for a in arms if a != DRAFTING and (math.isfinite(var[a]) or rates[a] >= rates[DRAFTING])
                 and z(a, DRAFTING) > (self.confidence if a == PLAIN else self.kind_confidence)]
        leader = max(ahead, key=rates.__getitem__) if ahead else DRAFTING
        others = [a for a in arms if a != leader]
        behind = [a for a in others if rates[leader] >= (1 + self.margin) * rates[a]
                  and z(leader, a) >= self.confidence]
        unsure = [a for a in others if a not in behind]
        bound = [r + self.confidence * math.sqrt(v) for r, v in zip(rates, var, strict=True)]
        promising = max(unsure, key=bound.__getitem__, default=None)
        return leader, unsure, behind, promising, promising is not None and bound[promising] > rates[leader]

    def lead(self, band: Band, arm: int = DRAFTING, over: int = PLAIN) -> float | None:
        """One arm's rate over another's, by default the drafting arm's over plain decoding's
        (None: either has fewer outcomes than its arm needs, `least_of`)."""
        a, b = band.outcomes[arm], band.outcomes[over]
        if len(a) < self.least_of[arm] or len(b) < self.least_of[over]:
            return None
        return Band.rate(a) / Band.rate(b)

    def evidence(self, band: Band, arm: int = DRAFTING, over: int | None = None) -> float:
        """How many standard errors one arm's rate lies above another's (negative: below; infinite
        where both arms' outcomes are exact): by default the drafting arm over plain decoding,
        another arm over the drafting arm."""
        over = (PLAIN if arm == DRAFTING else DRAFTING) if over is None else over
        a, b = band.outcomes[arm], band.outcomes[over]
        return _z(Band.rate(a), Band.variance(a), Band.rate(b), Band.variance(b))

    def observe(self, requests: int, arm: int, tokens: float, seconds: float, plain_s: float) -> None:
        """One step's outcome: `tokens` emitted by its `requests` decoding requests in `seconds` of
        wall time, on `arm`; `plain_s` what the cost model predicts a plain step of its shape
        takes (the scale that makes a band's steps comparable)."""
        if not self.measures(requests) or seconds <= 0 or plain_s <= 0:
            return
        key = self.band_of(requests)
        band = self.bands.get(key) or self.bands.setdefault(key, self._band(key))
        kept = band.outcomes[arm]
        band.judged = None
        kept.append((tokens / requests, seconds / plain_s))
        if len(kept) > self.window:
            kept.popleft()

    def as_dict(self) -> dict:
        """Each band's recent outcomes by arm, for the learned state a restarted engine starts
        from (`dcut_core/learned.py`)."""
        return {str(b): {name: [list(o) for o in band.outcomes[a]] for a, name in enumerate(self.arms)}
                for b, band in sorted(self.bands.items())}

    def restore(self, d: dict) -> None:
        """The bands' outcomes as `as_dict` wrote them (ValueError on anything else): a band whose
        arms all have `least` outcomes is decided from its first step, and probes on schedule.
        Every saved arm is checked; those this check does not have (a state saved by an engine
        of other kinds) are left out, and an arm not saved starts empty."""
        bands = {}
        for b, arms in d.items():
            band = bands[int(b)] = self._band(int(b))
            if not {"drafting", "plain"} <= set(arms):
                raise ValueError(f"a saved payoff band has the drafting and plain arms: {sorted(arms)}")
            for name, outcomes in arms.items():
                kept = [(float(t), float(s)) for t, s in outcomes[-self.window:]]
                if not all(t >= 0 and s > 0 for t, s in kept):  # NaN fails too
                    raise ValueError(f"a payoff outcome needs tokens >= 0 and seconds > 0: {outcomes}")
                if name in self.arms:
                    band.outcomes[self.arms.index(name)].extend(kept)
        self.bands = bands

    def leads(self) -> dict[int, float | None]:
        """Each band's lead (its lowest request count -> drafting over plain), for /metrics and
        the benchmarks."""
        return {self.lowest(b): self.lead(band) for b, band in sorted(self.bands.items())}

    def rates(self) -> dict[int, dict[str, float | None]]:
        """Each band's rate of each arm (its lowest request count -> arm -> tokens a request per
        plain step's time; None: fewer outcomes than the arm needs, `least_of`), for the benchmarks."""
        return {self.lowest(b): {name: Band.rate(o) if len(o) >= n else None
                                 for name, o, n in zip(self.arms, band.outcomes, self.least_of, strict=True)}
                for b, band in sorted(self.bands.items())}

    def leaders(self) -> dict[int, str | None]:
        """Each band's leader (its lowest request count -> the arm played; None while learning)."""
        return {self.lowest(b): (self.arms[j[0]] if j else None)
                for b, band in sorted(self.bands.items()) for j in [self._judge(band)]}
