"""What the drafting gate reads and learns: drafting costs (`DraftCost`, `DraftingCosts`), each
request's predicted acceptance under each kind (`Predicted`) and its survival (`Survival`), the
acceptance trackers that make the predictions (`AcceptanceTracker`) from verifications
(`Verified`), and exploration's schedule (`Exploration`). The plan made from them — how many
drafts each request gets — is dcut_core/planning.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dcut_core import ragged


@dataclass(frozen=True)
class DraftCost:
    """Seconds one drafting pass costs: a call, each drafting request, each drafted position, each
    context token caught up on, and each step of its chain — a chained drafter (MTP) runs one
    pass per draft position, so its time grows with the longest request's drafts (`passes`),
    whatever the others ask for."""

    fixed: float = 0.0
    per_request: float = 0.0
    per_position: float = 0.0
    per_context: float = 0.0  # each context token a drafter catches up on before drafting
    per_pass: float = 0.0  # each draft position of the longest request (a chain's sequential passes)

    def seconds(self, requests: np.ndarray | int, positions: np.ndarray | int,
                context: np.ndarray | int = 0, passes: np.ndarray | int = 0) -> np.ndarray:
        r, p = np.asarray(requests, dtype=np.float64), np.asarray(positions, dtype=np.float64)
        c, n = np.asarray(context, dtype=np.float64), np.asarray(passes, dtype=np.float64)
        return np.where(p > 0, self.fixed + self.per_request * r + self.per_position * p + self.per_context * c
                        + self.per_pass * n, 0.0)


@dataclass(frozen=True)
class DraftingCosts:
    """What drafting costs this step: each kind's pass (`DraftCost`, one per kind: one kind is a
    list of one); what any drafting step costs beyond the passes (`shared_fixed`: the step's own
    time a drafting step adds); and what the call to the drafter replicas costs beyond their
    kinds' passes (`call`), paid once when any kind that drafts there (`remote` [K]; None: every
    kind) drafts — the n-gram kind, drafted in the coordinator, never pays it."""

    draft: list[DraftCost]
    shared_fixed: float = 0.0
    call: float = 0.0
    remote: np.ndarray | None = None

    @cached_property
    def table(self) -> np.ndarray:
        """[K, 5]: each kind's fixed, per-request, per-position, per-context and per-pass seconds
        (built once: the gate reads it several times a step)."""
        table = np.array([[c.fixed, c.per_request, c.per_position, c.per_context, c.per_pass] for c in self.draft])
        table.setflags(write=False)
        return table

    @cached_property
    def calling(self) -> np.ndarray:
        """[K] bool: the kinds whose drafting calls the replicas."""
        calling = np.ones(len(self.draft), dtype=bool) if self.remote is None else np.array(self.remote, dtype=bool)
        calling.setflags(write=False)
        return calling


@dataclass(frozen=True)
class Survival:
    """Each request's predicted survival by draft position: running products of its conditional
    acceptance clipped to [0, 1], zeros past its row's end (`matrix` [R, w], w the longest row),
    and its row's length (`lengths` [R])."""

    matrix: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, predicted: list[np.ndarray] | np.ndarray) -> Survival:
        """From conditional acceptance rows (ragged, or [R, n])."""
        if isinstance(predicted, np.ndarray) and predicted.ndim == 2:
            rates = np.clip(predicted, 0.0, 1.0)
            return cls(np.cumprod(rates, axis=1), np.full(len(rates), rates.shape[1], dtype=np.int64))
        lens = np.fromiter((len(p) for p in predicted), dtype=np.int64, count=len(predicted))
        rates = np.zeros((len(lens), int(lens.max(initial=0))))
        if rates.size:
            rates[np.arange(rates.shape[1]) < lens[:, None]] = np.clip(np.concatenate(predicted), 0.0, 1.0)
        return cls(np.cumprod(rates, axis=1), lens)

    def expected(self) -> np.ndarray:
        """[R] drafts each request is expected to have accepted if it drafts its whole row."""
        return self.matrix.sum(axis=1)


@dataclass(frozen=True)
class Predicted:
    """Every request's predicted conditional acceptance by draft position under each drafter
    kind, as far as the kind may draft for it: `rates` [R, K, w] in [0, 1], zeros past each
    row's length (`lengths` [R, K])."""

    rates: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, per_kind: list[list[np.ndarray]]) -> Predicted:
        """From ragged rows: per_kind[k][i] request i's rates under kind k (clipped to [0, 1])."""
        lengths = np.array([[len(row) for row in rows] for rows in per_kind], dtype=np.int64).T
        lengths = lengths.reshape(len(per_kind[0]) if per_kind else 0, len(per_kind))
        rates = np.zeros((*lengths.shape, int(lengths.max(initial=0))))
        for k, rows in enumerate(per_kind):
            for i, row in enumerate(rows):
                rates[i, k, :len(row)] = np.clip(row, 0.0, 1.0)
        return cls(rates, lengths)

    def survival(self, kinds: np.ndarray) -> Survival:
        """The survival of each request's drafts under its kind (`kinds` [R])."""
        rows = np.arange(len(kinds))
        return Survival(np.cumprod(self.rates[rows, kinds], axis=1), self.lengths[rows, kinds])


@dataclass(frozen=True)
class Verified:
    """Verification outcomes the acceptance trackers learn from, in the order they are learnt:
    per entry the request, its drafter kind, the drafts kept and how many of them passed, and
    (ragged by `beyond_cu`) the calibrated estimates of the drafts past the kept ones (None:
    none known). One step's are learnt as one batch (`AcceptanceTracker.learn`)."""

    rids: np.ndarray  # [J] int64
    kinds: np.ndarray  # [J] int64
    kept: np.ndarray  # [J] int64
    accepted: np.ndarray  # [J] int64
    beyond: np.ndarray | None = None  # [B] float64
    beyond_cu: np.ndarray | None = None  # [J + 1] int64

    @classmethod
    def of(cls, rids, kinds, kept, accepted, beyond: list[np.ndarray] | None = None) -> Verified:
        """From per-entry values; beyond[j] the estimates past entry j's kept drafts."""
        ints = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (rids, kinds, kept, accepted)]
        if beyond is None:
            return cls(*ints)
        cu = np.zeros(len(beyond) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in beyond], out=cu[1:])
        flat = np.concatenate([np.asarray(b, dtype=np.float64) for b in beyond]) if beyond else np.zeros(0)
        return cls(*ints, flat, cu)

    def __len__(self) -> int:
        return len(self.rids)

    def as_dict(self) -> dict:
        return {"rids": self.rids.tolist(), "kinds": self.kinds.tolist(), "kept": self.kept.tolist(),
                "accepted": self.accepted.tolist(), "beyond": None if self.beyond is None else self.beyond.tolist(),
                "beyond_cu": None if self.beyond_cu is None else self.beyond_cu.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> Verified:
        """Also reads step logs of one kind (no `kinds`) and of requests that drafted nothing."""
        n = len(d["rids"])
        kinds = d.get("kinds") or [0] * n
        cu = d.get("beyond_cu")
        ints = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (d["rids"], kinds, d["kept"], d["accepted"])]
        if cu is None:
            return cls(*ints)
        return cls(*ints, np.asarray(d["beyond"], dtype=np.float64), np.asarray(cu, dtype=np.int64))

    def then(self, other: Verified) -> Verified:
        """These entries, then `other`'s (an entry without estimates has none past its kept)."""
        if not len(other):
            return self
        if not len(self):
            return other
        cu = [x.beyond_cu if x.beyond is not None else np.zeros(len(x) + 1, dtype=np.int64) for x in (self, other)]
        flat = [x.beyond if x.beyond is not None else np.zeros(0) for x in (self, other)]
        beyond = None if self.beyond is None and other.beyond is None else np.concatenate(flat)
        return Verified(*(np.concatenate([getattr(self, f), getattr(other, f)]) for f in ("rids", "kinds", "kept",
                                                                                          "accepted")),
                        beyond, None if beyond is None else np.concatenate([cu[0], cu[1][1:] + cu[0][-1]]))

    def of_kind(self, kind: int) -> Verified:
        """The entries of one drafter kind, in order."""
        idx = (self.kinds == kind).nonzero()[0]
        if len(idx) == len(self):
            return self
        if self.beyond is None:
            return Verified(self.rids[idx], self.kinds[idx], self.kept[idx], self.accepted[idx])
        starts, ends = self.beyond_cu[idx], self.beyond_cu[idx + 1]
        cu = np.zeros(len(idx) + 1, dtype=np.int64)
        (ends - starts).cumsum(out=cu[1:])
        flat = self.beyond[np.repeat(starts - cu[:-1], ends - starts) + np.arange(cu[-1])]
        return Verified(self.rids[idx], self.kinds[idx], self.kept[idx], self.accepted[idx], flat, cu)


# A batch of entries × block positions at least this large is learnt with whole-array operations
# (`AcceptanceTracker._counts_whole`), a smaller one entry by entry: the two cost the same near
# here (docs/benchmarks.md, session 43).
WHOLE_BATCH_CELLS = 512


def _factor(a: float, e: float, n: int, shrink: float) -> float:
    """A request's own factor from its decayed sums (accepted a, expected e, verifications n):
    accepted over expected, each with c tokens more at the global rate, c = 0.5 + shrink / (1 +
    verifications seen): a factor learnt from a verification or two stays near 1, and one learnt
    from many is the request's own. The chooser picks a request's kind by the largest estimate,
    so a kind's lucky first steps would otherwise win it steps its acceptance does not earn: on
    the training traces, with c = 0.5 throughout, the block drafter's predictions ran 0.3–0.7
    tokens above what it then accepted wherever it was chosen (docs/benchmarks.md). (A c that
    does not fade would hold every factor near 1 for good: the sums forget at 0.7 a
    verification, so they never hold more than ~3 of them.)"""
    c = 0.5 + shrink / (1.0 + n)
    r = (a + c) / (e + c)
    return 3.0 if r > 3.0 else 0.05 if r < 0.05 else r  # (min and max: a third of the learn loop at 1,024)


@dataclass
class AcceptanceTracker:
    """Predicts a request's conditional acceptance by draft position from past verifications.

    Global part: exponentially weighted accepted / judged counts per position. Request part: a
    multiplier, the request's own recent accepted drafts over what the global rates predicted
    (requests differ: repetitive code accepts far more than prose).
    """

    block: int
    halflife_steps: float = 20.0
    prior: float = 0.5
    shrink: float = 4.0  # tokens of evidence at the global rate behind a request's first factor (fading)
    accepted: np.ndarray = field(init=False)
    judged: np.ndarray = field(init=False)
    factor: dict[int, float] = field(default_factory=dict)
    observations: int = 0  # verifications seen (requests × steps with kept drafts)
    # per request: decayed accepted, decayed expected, verifications seen
    _sums: dict[int, tuple[float, float, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.accepted = np.full(self.block, self.prior)  # one pseudo-observation at the prior
        self.judged = np.ones(self.block)
        self._decay = 0.5 ** (1.0 / self.halflife_steps)

    @property
    def global_rate(self) -> np.ndarray:
        return self.accepted / self.judged

    def predict(self, rid: int, n: int) -> np.ndarray:
        """Conditional acceptance [n] of request rid's next n draft positions.

        The request's factor is its accepted drafts over what the global rates expected, so it
        scales the expected number accepted — the survivals — not every conditional rate (which
        compounds: a factor of 0.7 on each of 15 positions predicts a third as many, not 70 %).
        Scaling the survivals by f is scaling the first position's rate; where that would pass
        0.99 it stops there (an underestimate for the best requests, which draft anyway)."""
        rate = np.minimum(np.maximum(self.global_rate[:n], 0.0), 0.99)
        if n:
            rate[0] = min(0.99, rate[0] * self.factor.get(rid, 1.0))
        return rate

    def rates(self, width: int) -> np.ndarray:
        """[width]: the global conditional rates `predict` starts from (clipped to [0, 0.99]),
        zeros past the block."""
        out = np.zeros(width)
        n = min(width, self.block)
        out[:n] = np.minimum(np.maximum(self.global_rate[:n], 0.0), 0.99)
        return out

    def factors(self, rids: list[int]) -> np.ndarray:
        """[R]: each request's own factor (1 for a request it has not seen)."""
        return np.fromiter((self.factor.get(rid, 1.0) for rid in rids), dtype=np.float64, count=len(rids))

    def observe(self, rid: int, kept: int, accepted: int, beyond: np.ndarray | None = None) -> None:
        """One verification of request rid (`learn` of one)."""
        b = None if beyond is None else np.asarray(beyond, dtype=np.float64)
        self.learn(Verified.of([rid], [0], [kept], [accepted], None if b is None else [b]))

    def learn(self, v: Verified) -> None:
        """A step's verifications (every entry this tracker's kind), entry after entry: entry j's
        kept drafts, of which the first `accepted` passed.

        Global rates: each entry's judged positions — up to its first rejection (censoring as in
        acceptance.py), a prefix; of those, the first `accepted` passed — decay their counts and
        add the outcome. `beyond`: calibrated conditional acceptance of the positions drafted
        past the kept ones. Pruning keeps confident drafts, so outcomes alone overrate deep
        positions; when every kept draft passed, those positions were reached and count softly
        (reached with the product of the estimates before them, accepted with that times their
        own), so the rates describe all drafts. An entry whose drafts were all pruned still
        teaches. Then each request's factor: its accepted drafts against what the step's updated
        rates expected of its kept ones (`_factor`).

        The counts are added entry by entry in plain Python for a batch of a few requests and as
        whole-array operations for a large one (`WHOLE_BATCH_CELLS`; the same sums, to rounding):
        the loop had cost ~1 ms a step at 1,024 requests × 15 drafts (docs/benchmarks.md, session 43)."""
        counts = self._counts_whole if len(v) * self.block >= WHOLE_BATCH_CELLS else self._counts_in_turn
        acc, jud, seen = counts(v)
        if not seen:
            return
        self.observations += seen
        self.accepted, self.judged = np.asarray(acc, dtype=np.float64), np.asarray(jud, dtype=np.float64)
        # What the rates now expect of each entry's kept drafts; decayed sums, then their ratio
        # (an average of per-step ratios would be pulled to 1 by the smoothing every step needs).
        cum, survive, total = [0.0], 1.0, 0.0
        for x, y in zip(self.accepted.tolist(), self.judged.tolist(), strict=True):
            survive *= x / y
            total += survive
            cum.append(total)
        sums, factor, shrink, get, new = self._sums, self.factor, self.shrink, self._sums.get, (0.0, 0.0, 0)
        for rid, k, a in zip(v.rids.tolist(), v.kept.tolist(), v.accepted.tolist(), strict=True):
            if k > 0:
                s_a, s_e, n = get(rid, new)
                s_a, s_e, n = 0.7 * s_a + a, 0.7 * s_e + cum[k], n + 1
                sums[rid] = (s_a, s_e, n)
                factor[rid] = _factor(s_a, s_e, n, shrink)

    def _counts_in_turn(self, v: Verified) -> tuple[list[float], list[float], int]:
        """(accepted, judged, entries that taught) after `v`, entry after entry: plain Python on
        lists of at most `block` floats, for a batch of a few requests (numpy's per-call cost on
        arrays this small had been what the sequential per-request slices paid: 1.7 ms a step at
        64 requests; docs/benchmarks.md)."""
        d, block = self._decay, self.block
        acc, jud = self.accepted.tolist(), self.judged.tolist()
        kept, accepted = v.kept.tolist(), v.accepted.tolist()
        cu = None if v.beyond is None else v.beyond_cu.tolist()
        beyond = None if v.beyond is None else v.beyond.tolist()
        seen = 0
        for j, (k, a) in enumerate(zip(kept, accepted, strict=True)):
            touched = k > 0
            for p in range(min(a + 1, k)):
                acc[p] = acc[p] * d + (1.0 if p < a else 0.0)
                jud[p] = jud[p] * d + 1.0
            if cu is not None and a >= k and k < block:
                reach = 1.0
                for q in range(cu[j], min(cu[j + 1], cu[j] + block - k)):
                    x, p = beyond[q], k + q - cu[j]
                    acc[p] = d * acc[p] + reach * x
                    jud[p] = d * jud[p] + reach
                    reach *= x
                    touched = True
            seen += touched
        return acc, jud, seen

    def _counts_whole(self, v: Verified) -> tuple[np.ndarray, np.ndarray, int]:
        """`_counts_in_turn` as whole-array operations on [entries, block], for a large batch.
        An entry touches each position at most once, so position p's count after the batch is
        its count before times d^(touches of p) plus each touch's amount times d^(touches of p
        by the entries after it)."""
        n, block = len(v), self.block
        cols = np.arange(block)
        kept, accepted = v.kept, v.accepted
        touched = cols < np.minimum(accepted + 1, kept)[:, None]  # judged: up to the first rejection
        add_acc = ((cols < accepted[:, None]) & touched).astype(np.float64)
        add_jud = touched.astype(np.float64)
        if v.beyond is not None:  # past every kept draft that passed: reached softly (see `learn`)
            cu = v.beyond_cu
            soft = np.where((accepted >= kept) & (kept < block), np.minimum(ragged.lengths(cu), block - kept), 0)
            if soft.any():
                rows = np.repeat(np.arange(n), soft)
                q = ragged.positions(ragged.offsets_from_lengths(soft))
                cells = (rows, kept[rows] + q)
                x = np.ones((n, block))
                x[cells] = v.beyond[cu[rows] + q]
                reach = np.ones((n, block))  # the product of the estimates before each position
                np.cumprod(x[:, :-1], axis=1, out=reach[:, 1:])
                add_acc[cells] = reach[cells] * x[cells]
                add_jud[cells] = reach[cells]
                touched[cells] = True
        after = np.cumsum(touched[::-1], axis=0)[::-1]  # touches by this entry and the ones after it
        total = touched.sum(axis=0)
        after -= touched
        power = self._decay ** np.arange(n + 1)
        weight = power[after]
        return (power[total] * self.accepted + (add_acc * weight).sum(axis=0),
                power[total] * self.judged + (add_jud * weight).sum(axis=0), int(touched.any(axis=1).sum()))

    def skipped(self, rids, halflife_steps: float = 4.0) -> None:
        """These requests drafted nothing this step: each one's factor drifts back toward 1
        (the global rate). Without this a request whose factor fell after a few misses predicts
        too little to ever draft again, and so is never observed again — it stays in plain
        decoding. Called for a whole step's requests at once (plain Python: scalars, per request)."""
        keep = 0.5 ** (1.0 / halflife_steps)
        sums = self._sums
        for rid in rids:
            if rid in sums:
                a, e, n = sums[rid]
                a = e + (a - e) * keep
                sums[rid] = (a, e, n)
                self.factor[rid] = _factor(a, e, n, self.shrink)

    def verifications(self, rid: int) -> int:
        """Verifications request rid's own factor rests on (decayed sums' count)."""
        entry = self._sums.get(rid)
        return 0 if entry is None else entry[2]

    def forget(self, rid: int) -> None:
        self._sums.pop(rid, None)
        self.factor.pop(rid, None)

    def held(self) -> int:
        """Requests it keeps a record of (none once each is forgotten)."""
        return len(self._sums.keys() | self.factor.keys())


@dataclass
class Exploration:
    """When the gate rates drafting not worth it, still draft now and then so it keeps learning
    what drafting costs and yields: every `every`-th decision (and every one while `warming`),
    for `requests` requests of the batch, in turn. A whole batch of full drafts would cost
    several steps' worth. Counts its own decisions (`steps`): nothing else's counter drives it."""

    every: int = 50
    requests: int = 4
    warmup: int = 64  # observations the tracker needs before the schedule thins out
    steps: int = 0

    def probe(self, batch: int, warming: bool) -> np.ndarray | None:
        """A 0/1 mask [batch] of the requests to draft for this time, or None (not this time)."""
        step, self.steps = self.steps, self.steps + 1
        if batch == 0 or not (warming or step % self.every == 0):
            return None
        k = min(batch, self.requests)
        start = (step // self.every * k) % batch
        mask = np.zeros(batch, dtype=np.int64)
        mask[(start + np.arange(k)) % batch] = 1
        return mask
