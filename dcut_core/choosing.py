"""Which drafter kind drafts for each request (a unit hosting several: block, MTP, n-gram).

No drafting structure wins everywhere (AngelSpec): a block drafter shines on predictable code,
an MTP chain on open text, n-gram lookup on text that repeats its context. So each step, before
the drafting gate plans, every request picks a kind from what the engine has learned: each
kind's acceptance tracker predicts the request's survivals under that kind (global rates times
the request's own factor for it), and each kind's measured cost prices its drafts. The value of
kind k for request i is its best expected net gain in tokens,

    v_ik = max_n [ Σ_{j<n} S_ikj − ρ · (d_request,k + n · (d_position,k + τ)) ],

where ρ is a rate (tokens a second) and τ the verify cost of one more token: a draft is worth
its survival minus the tokens the step would have made in the time it costs (ρ starts at plain
decoding's rate and is refined to the choice's own, see `choose`).
The choice explores only where the estimates are unsure (UCB over the unit, not the request):
v_ik plus `bonus` · sqrt(ln(2 + N) / (1 + n_k)), n_k the verifications kind k's tracker has
learnt from (a warm start's included), N their sum. A kind the unit has seldom verified is
tried; once every kind's global rates are known, each request takes the kind its estimates
favour — its own factor per kind comes from its own verifications, the n-gram kind's from
every step (the look-ahead judged in hindsight). A bonus per request and kind (UCB over each
request's tries) made every request try every kind within its ~20 steps, and `auto` 2–4 %
slower on the training traces (docs/benchmarks.md, session 16). The estimates themselves are doubted
where a request has not verified a kind (`caution`): v_ik less caution / sqrt(1 + m_ik), m_ik the
verifications request i's own factor under kind k rests on. Of several noisy estimates the
largest is the likeliest overestimated (the winner's curse: on the training traces the kind
picked accepted 0.2–0.6 tokens less than predicted), so a request leaves the kind it knows only
for a clear lead; the n-gram kind, taught at every step by its look-ahead, is the one most
requests know (docs/benchmarks.md, session 19). A kind's
pass has a cost of its own whatever it drafts (`fixed`), paid once for all its requests: the set
of kinds in use is chosen for the batch as a whole (`choose`).

The gate then plans how far each request drafts with its kind's predictions and costs, and
D-Cut prunes every request's drafts in one decision, whatever made them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from dcut_core.drafting import DraftingCosts, Predicted
from dcut_core.pruning import StepCost

# Up to this many requests the kinds are chosen in plain Python (`_InTurn`; 86 against 214 µs
# at one request, 151 against 175 at four, 233 against 185 at seven, session 46). Both paths
# agree to the last bit up to seven requests and kinds: numpy adds up to seven terms in turn.
IN_TURN_REQUESTS = 4


@dataclass
class KindChooser:
    kinds: int
    bonus: float = 1.0  # tokens of optimism for a kind the unit has seldom verified
    refine: int = 3  # rounds choosing at the choice's own rate (1: at plain decoding's rate)
    switch: bool = True  # charge the context a kind has not seen (`held`) when given
    fallback: bool = True  # name a kind to stand in when a request's kind drafts nothing
    caution: float = 0.0  # tokens off a kind's value for a request with no verifications of it (fading)

    @property
    def doubts(self) -> bool:
        """Whether `choose` reads each request's evidence (several kinds, caution on)."""
        return self.kinds > 1 and self.caution > 0

    def values(self, q: KindQuestion, rate: float | None = None,
               sharing: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """(v, gain, n) [R, K] and ρ: every request's expected accepted tokens at n drafts under
        each kind (from `q.predicted`), each kind's DraftCost (`q.costs`), ρ the rate a second of
        drafting is charged at (default: plain decoding's). v_ik is the best net gain in tokens,
        at n_ik drafts expected to yield gain_ik accepted. `q.held` [R, K]: context tokens kind k
        has not seen of request i — catching up costs d_context,k per token, charged in the share
        of the request's `q.remaining` output this step may make (as the gate does). sharing [K]:
        requests drafting with each kind this step — a chain's passes run once for all of them,
        so each is charged its share (default 1: the whole chain). Every kind at once: one
        [R, K, n] array, no loop over kinds."""
        return self._values(self._choice(q), rate, sharing)

    def _choice(self, q: KindQuestion) -> Choice:
        return Choice.of(GainTable.of(q.predicted), q.verify, q.costs, q.held if self.switch else None, q.remaining)

    def _values(self, ch: Choice, rate: float | None,
                sharing: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """`values` at rate ρ for one choice's fixed terms (`Choice`, built once for its rounds:
        a round adds only what the rate and the chains' sharing change)."""
        table = ch.table
        r = table.gain.shape[0]
        if not ch.drafts.any():  # nobody may draft: nothing to tell apart
            zero = np.zeros((r, self.kinds))
            return zero, zero, zero, 0.0
        rate = r / ch.base if rate is None else rate
        net = ch.masked - rate * ch.seconds(sharing)
        best = net.argmax(axis=2)  # [R, K]: the first best length of each kind
        at = (*table.grid, best)
        v, gain, n = net[at], table.gain[at], best + 1.0
        if ch.every_kind_drafts:
            return v, gain, n, rate
        drafts = ch.drafts
        return np.where(drafts, v, 0.0), np.where(drafts, gain, 0.0), np.where(drafts, n, 0.0), rate

    def choose(self, q: KindQuestion) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kind [R], exploring [R], fallback [R]): the kind (index) each request drafts with this
        step; whether that choice is the bonus's rather than the estimates' — an exploring request
        must draft to teach anything, even where the estimates alone would not draft (the gate
        sees to it); and the kind to draft with instead if the chosen one makes no drafts (-1:
        none). `q` holds what it reads (`KindQuestion`).

        A kind's pass costs its `fixed` seconds once for all the requests it drafts for, and the
        call to the drafter replicas its `call` once for every kind drafted there, so the kinds
        in use are chosen together: of every set of kinds, the one whose requests' best scores
        (those above 0: the others will not draft) minus ρ × the set's fixed costs (and the call,
        if it holds a kind drafted on the replicas) sum highest; each request takes its best kind
        within it. Time spent drafting is worth the
        tokens the step would otherwise make in it — at the speculative rate, not the plain one
        — so ρ is refined (Dinkelbach): the choice's own predicted tokens per second, then choose
        again, a few times; the round whose choice is predicted fastest stands."""
        r = q.predicted.rates.shape[0]
        if r == 0 or self.kinds == 1:  # nothing to choose: every request drafts with the one kind
            return np.zeros(r, dtype=np.int64), np.zeros(r, dtype=bool), np.full(r, -1, dtype=np.int64)
        bonus, doubt = self._optimism(q)
        if r <= IN_TURN_REQUESTS and self.kinds <= 7 and q.predicted.lengths.any() \
                and (q.held is None or not self.switch or q.remaining is not None):
            return _InTurn(self, q).choose(bonus, doubt)
        return self._choose_whole(q, bonus, doubt)

    def _choose_whole(self, q: KindQuestion, bonus: list[float],
                      doubt: float | list[list[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`choose` as array code (bonus and doubt from `_optimism`)."""
        r = q.predicted.rates.shape[0]
        ch = self._choice(q)  # once for every round
        bonus = np.array(bonus)[None, :]  # [1, K]: the same for all
        doubt = doubt if isinstance(doubt, float) else np.array(doubt)  # 0.0 or [R, K]
        fixed_s, call, calls = ch.costs[0], q.costs.call, q.costs.calling
        rate, sharing = None, np.full(self.kinds, r)  # first as if every request drafted with each kind
        rows = np.arange(r)
        barred = None if q.allowed is None else np.where(q.allowed, 0.0, -np.inf)  # added: −inf where not allowed
        rounds = _Rounds()
        for _ in range(self.refine):
            value, gain, n, rate = self._values(ch, rate, sharing)
            value = np.where(value > 0, value - doubt, value)
            if barred is not None:
                value = value + barred
            score = value + bonus
            kind, use = self._assign(score, rate * fixed_s, rate * call, calls)
            drafts = value[rows, kind] > 0  # the requests whose drafts are predicted to pay
            paying = bool(drafts.any())
            achieved = r / ch.base if ch.base > 0 else 0.0  # plain decoding's, when nobody's drafts pay
            if rate > 0.0 and paying:  # the next round charges each kind its share of a chain
                achieved, sharing = ch.predicted_rate(kind, drafts, gain[rows, kind], n[rows, kind])
            rate = rounds.take(achieved, paying, (kind, use, value, score, rate))
            if rate is None:
                break
        kind, use, value, score, rate = rounds.best
        # Exploring: chosen by the bonus, not by the estimates (the choice without it).
        plain = kind if not self.bonus else self._assign(value, rate * fixed_s, rate * call, calls)[0]
        exploring = (kind != plain) & (score[rows, kind] > 0)
        if not self.fallback:
            return kind, exploring, np.full(r, -1, dtype=np.int64)
        return kind, exploring, self._fallback(value - np.where(use, 0.0, rate * fixed_s)[None, :], kind)

    def _optimism(self, q: KindQuestion) -> tuple[list[float], float | list[list[float]]]:
        """(bonus [K], doubt: 0.0 or [R][K]) in tokens: the unit's optimism for each kind it has
        seldom verified, and each request's doubt of the kinds it has not (a few numbers: plain
        Python, for both paths)."""
        support = Support() if q.support is None else q.support
        obs = [0.0] * self.kinds if support.unit is None else np.asarray(support.unit, dtype=np.float64).tolist()
        log_n = math.log(2.0 + math.fsum(obs))
        bonus = [self.bonus * math.sqrt(log_n / (1.0 + o)) for o in obs]
        if not self.caution or support.request is None:
            return bonus, 0.0
        request = np.asarray(support.request, dtype=np.float64).tolist()
        return bonus, [[self.caution / math.sqrt(1.0 + m) for m in row] for row in request]

    def _fallback(self, value: np.ndarray, kind: np.ndarray) -> np.ndarray:
        """Per request, the kind to draft with if its chosen kind makes no drafts this step (an
        n-gram drafter that finds no match): the best other kind whose estimate pays — its pass
        cost included when no other request uses it — else -1."""
        other = value.copy()
        other[np.arange(len(kind)), kind] = -np.inf
        best = other.argmax(axis=1)
        return np.where(other[np.arange(len(kind)), best] > 0, best, -1).astype(np.int64)

    def _assign(self, score: np.ndarray, fixed: np.ndarray, call: float = 0.0,
                calls: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(kind [R], kinds in use [K]): the set of kinds whose requests' positive scores minus
        their passes' costs and, if it holds a kind of `calls`, the replicas' `call` (tokens)
        sum highest; each request's best kind within it. Every set is scored in one array
        operation ([sets, R, K])."""
        sets, outside = kind_sets(self.kinds), set_masks(self.kinds)
        top = (score[None, :, :] + outside[:, None, :]).max(axis=2)  # [sets, R]: each request's best in each set
        totals = np.maximum(top, 0.0).sum(axis=1) - set_weights(self.kinds) @ fixed
        if call and calls is not None:
            totals = totals - call * calling_sets(tuple(calls.tolist()))
        best_total, best = -np.inf, len(sets) - 1
        for i, total in enumerate(totals.tolist()):
            if total > best_total + 1e-12:  # ties: the set met first (fewer, lower kinds)
                best_total, best = total, i
        kind = (score + outside[best]).argmax(axis=1)
        none = top[best] == -np.inf  # a request allowed no kind of the set: its best of all
        if none.any():
            kind = np.where(none, score.argmax(axis=1), kind)
        return kind, sets[best]


class _Rounds:
    """Dinkelbach's rounds on ρ, for both paths of `KindChooser.choose`: the best round's choice
    so far and the rate the next round charges. A round at a higher rate may pick, by the bonus,
    a kind whose drafts do not pay where an earlier round's did: the best round's choice stands,
    not the last one's."""

    def __init__(self) -> None:
        self.achieved = -np.inf
        self.best: tuple | None = None  # (kind, use, value, score, rate charged) of the best round

    def take(self, achieved: float, paying: bool, choice: tuple) -> float | None:
        """One round's predicted rate and choice; the next round's rate, or None: stop."""
        if self.best is None or achieved > self.achieved * (1 + 1e-6):
            self.achieved, self.best = achieved, choice
        rate = choice[-1]
        if not paying or achieved <= rate * (1 + 1e-6):
            return None
        return achieved


class _InTurn:
    """`KindChooser.choose` in plain Python for a few requests (`IN_TURN_REQUESTS`), where
    numpy's cost per call had been the choice's whole cost: ~150 calls, 190–250 µs at one
    request of a 5–6 ms step (docs/benchmarks.md, session 46). The same choice to the last bit
    (tests/core/test_choosing.py): every sum in the order the array code makes it (numpy adds
    up to seven terms in turn), ties to the first kind, the first best length and set; the
    verify curve and the sets' pass costs are still read through numpy, once a round."""

    def __init__(self, chooser: KindChooser, q: KindQuestion) -> None:
        self.chooser, self.q = chooser, q
        rates, lengths = q.predicted.rates, q.predicted.lengths
        r, k = lengths.shape
        self.r, self.k = r, k
        self.width = lengths.max(axis=0).tolist()
        n_max = max(self.width)
        self.costs = q.costs.table.T.tolist()  # [5][K]
        self.calling = q.costs.calling.tolist()
        self.holds = calling_sets(tuple(self.calling)).tolist()  # the sets holding a kind drafted on the replicas
        # The verify curve at every count a choice can ask about: R + up to each request's longest row.
        self.at = q.verify.seconds(r + np.arange(int(lengths.max(axis=1).sum()) + 1)).tolist()
        self.base, self.tau = self.at[0], self.at[1] - self.at[0]
        c1, c2, c3 = self.costs[1], self.costs[2], self.costs[3]
        held = q.held if chooser.switch else None
        held = None if held is None else np.asarray(held, dtype=np.float64).tolist()
        left = None if held is None else [max(1.0, x) for x in np.asarray(q.remaining, dtype=np.float64).tolist()]
        # Each request's gains and seconds at 1 .. width_k drafts under each kind k (lengths past
        # a kind's width are −inf in the array code: never a best length, left out here).
        gain, unshared = [], []
        for i, row in enumerate(rates[:, :, :n_max].tolist()):
            g_i, u_i = [], []
            for kk, conditional in enumerate(row):
                g, survive, total = [], 1.0, 0.0
                for j, p in enumerate(conditional[:self.width[kk]]):  # a running product, then its running sum
                    survive = p if j == 0 else survive * p
                    total = survive if j == 0 else total + survive
                    g.append(total)
                step = c2[kk] + self.tau
                u = [c1[kk] + (j + 1.0) * step for j in range(len(g))]
                if held is not None:  # the switch charge
                    h = c3[kk] * held[i][kk]
                    u = [x + h * min(1.0, (1.0 + gj) / left[i]) for x, gj in zip(u, g, strict=True)]
                g_i.append(g)
                u_i.append(u)
            gain.append(g_i)
            unshared.append(u_i)
        self.gain, self.unshared = gain, unshared
        self.chained = any(x != 0 for x in self.costs[4])
        self.drafts = [w > 0 for w in self.width]
        self._paid: dict[float, list[float]] = {}  # ρ -> each set's passes at ρ

    def values(self, rate: float | None, sharing: list[int]) -> tuple[list, list, list, float]:
        """`KindChooser._values`: (v, gain, n) [R][K] and ρ."""
        rate = self.r / self.base if rate is None else rate
        per_pass = [p / max(1.0, float(s)) for p, s in zip(self.costs[4], sharing, strict=True)] \
            if self.chained else None
        v, gain, n = [], [], []
        for g_i, u_i in zip(self.gain, self.unshared, strict=True):
            v_i, gain_i, n_i = [], [], []
            for kk, (g, u) in enumerate(zip(g_i, u_i, strict=True)):
                if not g:  # a kind nobody may draft with
                    v_i.append(0.0)
                    gain_i.append(0.0)
                    n_i.append(0.0)
                    continue
                if per_pass is not None:
                    pp = per_pass[kk]
                    u = [x + (j + 1.0) * pp for j, x in enumerate(u)]
                best, top = 0, g[0] - rate * u[0]
                for j in range(1, len(g)):
                    net = g[j] - rate * u[j]
                    if net > top:
                        best, top = j, net
                v_i.append(top)
                gain_i.append(g[best])
                n_i.append(best + 1.0)
            v.append(v_i)
            gain.append(gain_i)
            n.append(n_i)
        return v, gain, n, rate

    def assign(self, score: list[list[float]], rate: float) -> tuple[list[int], np.ndarray]:
        """`KindChooser._assign` at ρ = `rate`: (kind [R], the kinds in use [K])."""
        paid = self._paid.get(rate)
        if paid is None:  # each set's passes, summed as the array code sums them
            paid = self._paid[rate] = (set_weights(self.k) @ (rate * np.asarray(self.costs[0]))).tolist()
        call = rate * self.q.costs.call
        holds = self.holds if call else None
        grown = set_growth(self.k)
        tops = []  # [R][sets]: each request's best score within each set
        for row in score:
            top = []
            for kk, rest in grown:
                x = row[kk]
                if rest >= 0:
                    y = top[rest]
                    x = x if x >= y else y
                top.append(x)
            tops.append(top)
        best_total, best = -np.inf, len(paid) - 1
        for s, cost in enumerate(paid):
            total = None
            for top in tops:
                x = top[s]
                x = x if x >= 0.0 else 0.0
                total = x if total is None else total + x
            total = total - cost
            if holds is not None:
                total = total - (call if holds[s] else 0.0)
            if total > best_total + 1e-12:  # ties: the set met first (fewer, lower kinds)
                best_total, best = total, s
        ks = set_members(self.k)[best]
        kind = []
        for row, top in zip(score, tops, strict=True):
            pick = ks if top[best] != -np.inf else range(self.k)  # allowed no kind of the set: its best of all
            first = pick[0]
            for kk in pick:
                if row[kk] > row[first]:
                    first = kk
            kind.append(first)
        return kind, kind_sets(self.k)[best]

    def predicted_rate(self, kind: list[int], drafts: list[bool], gain: list[float],
                       n: list[float]) -> tuple[float, list[int]]:
        """`Choice.predicted_rate`."""
        c, d, k = self.costs, self.q.costs, self.k
        sharing, weight, longest = [0] * k, [0.0] * k, [0.0] * k
        tokens, got = 0.0, None
        for kk, yes, g, m in zip(kind, drafts, gain, n, strict=True):
            if not yes:
                continue
            sharing[kk] += 1
            weight[kk] += m
            longest[kk] = max(longest[kk], m)
            tokens += m
            got = g if got is None else got + g
        total = None
        for kk in range(k):
            x = c[0][kk] * (1.0 if sharing[kk] else 0.0) + c[1][kk] * float(sharing[kk]) + c[2][kk] * weight[kk]
            if self.chained:
                x = x + c[4][kk] * longest[kk]
            total = x if total is None else total + x
        called = d.call and any(s and yes for s, yes in zip(sharing, self.calling, strict=True))
        t = int(tokens)
        verify = self.at[t] if t < len(self.at) else float(self.q.verify.seconds(np.array([self.r + t]))[0])
        seconds = verify + total + d.shared_fixed + (d.call if called else 0.0)
        return (self.r + (0.0 if got is None else got)) / seconds, sharing

    def choose(self, bonus: list[float], doubt: float | list[list[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`KindChooser.choose`'s rounds (Dinkelbach on ρ), exploration and fallback."""
        chooser, q, r, k = self.chooser, self.q, self.r, self.k
        barred = None if q.allowed is None else np.where(q.allowed, 0.0, -np.inf).tolist()
        rate, sharing = None, [r] * k
        rounds = _Rounds()
        for _ in range(chooser.refine):
            v, gain, n, rate = self.values(rate, sharing)
            value = []
            for i in range(r):
                row = [x - (doubt if isinstance(doubt, float) else doubt[i][kk]) if x > 0 else x
                       for kk, x in enumerate(v[i])]
                if barred is not None:
                    row = [x + b for x, b in zip(row, barred[i], strict=True)]
                value.append(row)
            score = [[x + b for x, b in zip(row, bonus, strict=True)] for row in value]
            kind, use = self.assign(score, rate)
            drafts = [value[i][kind[i]] > 0 for i in range(r)]
            paying = any(drafts)
            achieved = r / self.base if self.base > 0 else 0.0
            if rate > 0.0 and paying:
                achieved, sharing = self.predicted_rate(kind, drafts, [gain[i][kind[i]] for i in range(r)],
                                                        [n[i][kind[i]] for i in range(r)])
            rate = rounds.take(achieved, paying, (kind, use, value, score, rate))
            if rate is None:
                break
        kind, use, value, score, rate = rounds.best
        plain = kind if not chooser.bonus else self.assign(value, rate)[0]
        exploring = [a != b and score[i][a] > 0 for i, (a, b) in enumerate(zip(kind, plain, strict=True))]
        kinds = np.array(kind, dtype=np.int64)
        if not chooser.fallback:
            return kinds, np.array(exploring, dtype=bool), np.full(r, -1, dtype=np.int64)
        unused = [0.0 if u else rate * f for u, f in zip(use.tolist(), self.costs[0], strict=True)]
        fallback = []
        for i in range(r):
            other = [x - c for x, c in zip(value[i], unused, strict=True)]
            other[kind[i]] = -np.inf
            pick = 0
            for kk in range(1, k):
                if other[kk] > other[pick]:
                    pick = kk
            fallback.append(pick if other[pick] > 0 else -1)
        return kinds, np.array(exploring, dtype=bool), np.array(fallback, dtype=np.int64)


class StickyChoice:
    """Each request's kind (and fallback) as the chooser last picked it, kept for up to `steps`
    decisions so the chooser need not run every step: `recall` answers for the whole batch or not
    at all (a choice is made for the batch together: the kinds in use share their passes). A
    choice is dropped when its term ends, when its kind cannot draft for the request now, and when
    evidence says otherwise (`doubt`: a verification under it with nothing accepted)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._kept: dict[int, list[int]] = {}  # rid -> [kind, fallback, decisions left]

    def recall(self, rids: list[int], usable: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
        """(kind [R], fallback [R]) kept for every request of the batch, or None if any has none
        (then the chooser runs for all, and `keep` starts a new term for each)."""
        if self.steps <= 1 or not rids:
            return None
        kept = self._kept
        rows = [kept.get(rid) for rid in rids]
        if any(row is None or row[2] <= 0 for row in rows):
            return None
        kind = np.array([row[0] for row in rows], dtype=np.int64)
        if usable is not None and not usable[np.arange(len(rids)), kind].all():
            return None
        for row in rows:
            row[2] -= 1
        return kind, np.array([row[1] for row in rows], dtype=np.int64)

    def keep(self, rids: list[int], kind: np.ndarray, fallback: np.ndarray) -> None:
        if self.steps <= 1:
            return
        left = self.steps - 1
        for rid, k, f in zip(rids, kind.tolist(), fallback.tolist(), strict=True):
            self._kept[rid] = [k, f, left]

    def doubt(self, rids: np.ndarray, kinds: np.ndarray, accepted: np.ndarray) -> None:
        """Verifications (request, kind, accepted): a request whose kept kind had nothing
        accepted chooses again at its next step."""
        if not self._kept:
            return
        for rid, k, a in zip(rids.tolist(), kinds.tolist(), accepted.tolist(), strict=True):
            row = self._kept.get(rid)
            if row is not None and row[0] == k and a == 0:
                row[2] = 0

    def forget(self, rid: int) -> None:
        self._kept.pop(rid, None)

    def held(self) -> int:
        return len(self._kept)


@dataclass(frozen=True)
class KindQuestion:
    """What one choice of kinds reads (`KindChooser.choose`): each request's conditional
    acceptance by position under each kind, up to its cap (`predicted`); the step's verify cost;
    each kind's drafting costs; the kinds each request may use ([R, K], its own choice; None:
    all); the context each kind has not seen of each request ([R, K]) with the request's
    remaining output — what a switch of kind costs (None: not charged); the verifications the
    estimates rest on (`Support`)."""

    predicted: Predicted
    verify: StepCost
    costs: DraftingCosts
    allowed: np.ndarray | None = None
    held: np.ndarray | None = None
    remaining: np.ndarray | None = None
    support: Support | None = None


@dataclass(frozen=True)
class Support:
    """What the chooser's estimates rest on: the verifications each kind's tracker has learnt
    from (`unit` [K], a warm start's included: the bonus's measure of how sure the unit is) and
    those each request's own factor under each kind rests on (`request` [R, K]: caution's
    measure). None: none."""

    unit: np.ndarray | None = None
    request: np.ndarray | None = None


@dataclass(frozen=True)
class GainTable:
    """Every request's expected accepted tokens at n = 1 .. width_k drafts under each kind k, as
    one [R, K, n_max] array (gain[i, k, n − 1] = Σ_{j<n} S_ikj), from the predictions of
    conditional acceptance; lengths past a kind's longest row are not `valid`."""

    gain: np.ndarray  # [R, K, n_max]
    width: np.ndarray  # [K] the longest prediction of each kind
    valid: np.ndarray  # [K, n_max]
    n: np.ndarray  # [n_max] 1 .. n_max
    grid: tuple[np.ndarray, np.ndarray]  # ([R, 1], [1, K]) indices: a [R, K] pick along n is gain[*grid, pick]

    @classmethod
    def of(cls, predicted: Predicted) -> GainTable:
        """Zeros past each row's end add no gain, so no position past it is ever the best."""
        width = predicted.lengths.max(axis=0, initial=0)
        n_max = int(width.max(initial=0))
        rates = predicted.rates[:, :, :n_max]
        n = np.arange(1, n_max + 1, dtype=np.float64)
        grid = (np.arange(rates.shape[0])[:, None], np.arange(rates.shape[1])[None, :])
        return cls(np.cumsum(np.cumprod(rates, axis=2), axis=2), width, n[None, :] <= width[:, None], n, grid)


@dataclass(frozen=True)
class Choice:
    """What one choice's rounds share: the gains, the verify time of the step's R tokens (`base`)
    and of one more (τ), each kind's costs [5, K], and, made once for every round, the gains with
    −inf past each kind's longest row (`masked`) and each length's seconds but for its chain's
    passes (`unshared`: a request's own and its positions', and what its catch-up charges each
    of its lengths under each kind; the one term a round's sharing changes is left out)."""

    table: GainTable
    base: float
    tau: float
    costs: np.ndarray
    verify: StepCost
    drafting: DraftingCosts
    masked: np.ndarray | None = None  # [R, K, n]
    unshared: np.ndarray | None = None  # [R or 1, K, n]
    drafts: np.ndarray | None = None  # [K] the kinds some request may draft with (a prediction longer than 0)
    every_kind_drafts: bool = False
    chained: bool = False  # some kind runs a chain of passes (its per-pass cost above 0)

    @classmethod
    def of(cls, table: GainTable, verify: StepCost, costs: DraftingCosts, held: np.ndarray | None,
           remaining: np.ndarray | None) -> Choice:
        """held [R, K]: context each kind has not seen of each request, charged d_context,k a
        token in the share of its `remaining` output the step may make."""
        c, drafts = costs.table.T, table.width > 0
        if not drafts.any():  # nobody may draft (a captured verify table may hold R alone)
            return cls(table, 0.0, 0.0, c, verify, costs, drafts=drafts)
        r = table.gain.shape[0]
        base, more = verify.seconds(np.array([r, r + 1])).tolist()
        tau = more - base
        unshared = c[1][None, :, None] + table.n[None, None, :] * (c[2] + tau)[None, :, None]
        if held is not None:  # the switch charge
            left = np.maximum(1.0, np.asarray(remaining, dtype=np.float64))[:, None, None]
            unshared = unshared + c[3][None, :, None] * np.asarray(held, dtype=np.float64)[:, :, None] * np.minimum(
                1.0, (1.0 + table.gain) / left)
        masked = np.where(table.valid[None], table.gain, -np.inf)
        return cls(table, base, tau, c, verify, costs, masked, unshared, drafts, bool(drafts.all()), bool(c[4].any()))

    def seconds(self, sharing: np.ndarray | None) -> np.ndarray:
        """[R or 1, K, n]: what drafting n with kind k costs request i, its chain's passes shared
        by `sharing[k]` requests (None: by one)."""
        if not self.chained:
            return self.unshared
        per_pass = self.costs[4] / (1.0 if sharing is None else np.maximum(1.0, np.asarray(sharing, dtype=np.float64)))
        return self.unshared + self.table.n[None, None, :] * per_pass[None, :, None]

    def predicted_rate(self, kind: np.ndarray, drafts: np.ndarray, gain: np.ndarray,
                       n: np.ndarray) -> tuple[float, np.ndarray]:
        """(tokens a second, requests drafting with each kind [K]) of one assignment: request i
        drafting n[i] drafts with kind[i] where drafts[i], expecting gain[i] of them accepted —
        the step's verify of every token, each kind in use's pass (its chain as long as its
        longest request's) and per-request costs, the drafting call's shared cost and, if any
        kind drafted on the replicas is in use, their call."""
        r, c, d = len(kind), self.costs, self.drafting
        k, m = kind[drafts], n[drafts]
        sharing = np.bincount(k, minlength=c.shape[1])
        used = sharing > 0
        per_kind = c[0] * used + c[1] * sharing + c[2] * np.bincount(k, weights=m, minlength=c.shape[1])
        if self.chained:
            longest = np.zeros(c.shape[1])
            np.maximum.at(longest, k, m)
            per_kind += c[4] * longest
        seconds = (float(self.verify.seconds(np.array([r + int(m.sum())]))[0]) + float(per_kind.sum())
                   + d.shared_fixed + (d.call if d.call and (d.calling & used).any() else 0.0))
        return (r + float(gain[drafts].sum())) / seconds, sharing


@cache
def kind_sets(k: int) -> np.ndarray:
    """[2^k − 1, k] bool: every non-empty set of k kinds, in the order of their bit patterns."""
    sets = (np.arange(1, 2 ** k)[:, None] >> np.arange(k)) & 1 == 1
    sets.setflags(write=False)
    return sets


@cache
def set_members(k: int) -> tuple[tuple[int, ...], ...]:
    """The kinds of each set of `kind_sets`, in ascending order."""
    return tuple(tuple(np.flatnonzero(s).tolist()) for s in kind_sets(k))


@cache
def set_growth(k: int) -> tuple[tuple[int, int], ...]:
    """Each set of `kind_sets` as its lowest kind added to a set met before it (its index; -1:
    none): a request's best score in every set, one comparison a set."""
    out = []
    for pattern in range(1, 2 ** k):
        low = pattern & -pattern
        out.append((low.bit_length() - 1, (pattern ^ low) - 1))
    return tuple(out)


@cache
def set_masks(k: int) -> np.ndarray:
    """[2^k − 1, k]: 0 for the kinds in each set of `kind_sets`, −inf for the others (added to
    scores, it leaves a set's kinds to choose from)."""
    masks = np.where(kind_sets(k), 0.0, -np.inf)
    masks.setflags(write=False)
    return masks


@cache
def set_weights(k: int) -> np.ndarray:
    """[2^k − 1, k]: `kind_sets` as 1.0 and 0.0 (a product with each kind's cost sums each set's)."""
    weights = kind_sets(k).astype(np.float64)
    weights.setflags(write=False)
    return weights


@cache
def calling_sets(calls: tuple[bool, ...]) -> np.ndarray:
    """[2^k − 1] bool: the sets of `kind_sets` holding a kind whose drafting calls the replicas."""
    hold = (kind_sets(len(calls)) & np.array(calls)[None, :]).any(axis=1)
    hold.setflags(write=False)
    return hold
