"""Which drafter kind drafts for each request (a unit hosting several: block, MTP, n-gram).

No drafting structure wins everywhere (AngelSpec): a block drafter shines on predictable code,
an MTP chain on open text, n-gram lookup on text that repeats its context. So each step, before
the drafting gate plans, every request picks a kind from what the engine has learned: each
kind's acceptance tracker predicts the request's survivals under that kind (global rates times
the request's own factor for it), and each kind's measured cost prices its drafts. The value of
kind k for request i is its best expected net gain in tokens,

    v_ik = max_n [ Σ_{j<n} S_ikj − ρ · (d_request,k + n · (d_position,k + τ)) ],

where ρ is the plain-decoding rate (tokens a second) and τ the verify cost of one more token: a
draft is worth its survival minus the tokens plain decoding would have made in the time it costs.
The choice is a bandit (UCB): v_ik plus `bonus` · sqrt(ln(2 + N_i) / (1 + n_ik)), n_ik being
request i's verifications drafted by kind k, so every kind gets tried on a request whose values
are close, and a kind a request has not used in a long while is tried again. An optional prior
(tokens, per request and kind) adds what the prompt says, before any verification has. A kind's
pass has a cost of its own whatever it drafts (`fixed`), paid once for all its requests: the set
of kinds in use is chosen for the batch as a whole (`choose`).

The gate then plans how far each request drafts with its kind's predictions and costs, and
D-Cut prunes every request's drafts in one decision, whatever made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core.pruning import StepCost


@dataclass
class KindChooser:
    kinds: int
    bonus: float = 1.0  # tokens of optimism for the kind a request has tried least
    tried: dict[int, np.ndarray] = field(default_factory=dict)  # request -> verifications by kind

    def values(self, predicted: list[list[np.ndarray]], verify: StepCost, costs) -> tuple[np.ndarray, float]:
        """(v [R, K], ρ): predicted[k][i] is request i's conditional acceptance by position under
        kind k (up to its cap); costs[k] the kind's DraftCost; ρ the plain-decoding rate."""
        r = len(predicted[0])
        if not any(len(p) for rows in predicted for p in rows):  # nobody may draft: nothing to tell apart
            return np.zeros((r, self.kinds)), 0.0
        base = float(verify.seconds(np.array([r]))[0])
        rate = r / base  # plain decoding's tokens a second
        tau = float(verify.seconds(np.array([r + 1]))[0]) - base  # one more verified token
        v = np.zeros((r, self.kinds))
        for k, rows in enumerate(predicted):
            n_max = max((len(p) for p in rows), default=0)
            if n_max == 0:
                continue
            rates = np.zeros((r, n_max))
            for i, p in enumerate(rows):
                rates[i, :len(p)] = np.clip(p, 0.0, 1.0)
            gain = np.cumsum(np.cumprod(rates, axis=1), axis=1)  # [R, n]: expected accepted at n drafts
            n = np.arange(1, n_max + 1)
            net = gain - rate * (costs[k].per_request + n * (costs[k].per_position + tau))
            v[:, k] = net.max(axis=1)
        return v, rate

    def choose(self, rids: list[int], predicted: list[list[np.ndarray]], verify: StepCost, costs,
               allowed: np.ndarray | None = None, prior: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(kind [R], exploring [R]): the kind (index) each request drafts with this step, and
        whether that choice is the bonus's rather than the estimates' — an exploring request must
        draft to teach anything, even where the estimates alone would not draft (the gate sees to
        it). allowed [R, K]: the kinds each request may use (its own choice); prior [R, K]: tokens
        added to the values.

        A kind's pass costs its `fixed` seconds once for all the requests it drafts for, so the
        kinds in use are chosen together: of every set of kinds, the one whose requests' best
        scores (those above 0: the others will not draft) minus ρ × the set's fixed costs sum
        highest; each request takes its best kind within it."""
        r = len(rids)
        if r == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        value, rate = self.values(predicted, verify, costs)
        if prior is not None:
            value = value + prior
        counts = np.array([self.tried.get(rid, np.zeros(self.kinds)) for rid in rids])
        score = value + self.bonus * np.sqrt(np.log(2.0 + counts.sum(axis=1))[:, None] / (1.0 + counts))
        if allowed is not None:
            value, score = np.where(allowed, value, -np.inf), np.where(allowed, score, -np.inf)
        fixed = rate * np.array([c.fixed for c in costs])  # tokens each kind's pass costs
        best_total, use = -np.inf, np.ones(self.kinds, dtype=bool)
        for subset in range(1, 2 ** self.kinds):
            inside = (subset >> np.arange(self.kinds)) & 1 == 1
            top = np.where(inside, score, -np.inf).max(axis=1)
            total = float(np.maximum(top, 0.0).sum() - fixed[inside].sum())
            if total > best_total + 1e-12:  # ties: the set met first (fewer, lower kinds)
                best_total, use = total, inside
        within = np.where(use, score, -np.inf)
        kind = np.where(np.isfinite(within.max(axis=1)), within.argmax(axis=1), score.argmax(axis=1)).astype(np.int64)
        exploring = (kind != np.where(use, value, -np.inf).argmax(axis=1)) & (score[np.arange(r), kind] > 0)
        return kind, exploring

    def observe(self, rid: int, kind: int, kept: int) -> None:
        """Request rid's drafts by `kind` were verified (kept > 0) this step."""
        if kept > 0:
            self.tried.setdefault(rid, np.zeros(self.kinds))[kind] += 1

    def forget(self, rid: int) -> None:
        self.tried.pop(rid, None)
