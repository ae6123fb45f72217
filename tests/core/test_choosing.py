"""Several drafter kinds in one unit: the per-request kind choice (a bandit over calibrated
estimates) and the drafting plan that charges each kind its own cost."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core import choosing
from dcut_core.choosing import KindChooser, KindQuestion, Support
from dcut_core.drafting import AcceptanceTracker, DraftCost, Exploration, Predicted, Survival, Verified
from dcut_core.gate import DraftingCosts, DraftingGate, GateInput, KindReach, replay
from dcut_core.planning import DraftPlanner
from dcut_core.pruning import StepCost


def kinds_of(chooser: KindChooser, *question, **named) -> list[int]:
    """The kind each request is given (`KindChooser.choose` of one `KindQuestion`)."""
    return chooser.choose(KindQuestion(*question, **named))[0].tolist()

def linear(fixed, per_token):
    return StepCost(lambda n: fixed + per_token * np.asarray(n, dtype=np.float64), 0.0)


def explicit_seconds(lengths, kinds, verify, costs, backlog, shared):
    """The drafting step's time written out: what the plan's scan must add up to."""
    lengths, kinds = np.asarray(lengths), np.asarray(kinds)
    total = float(verify.seconds(np.array([len(lengths) + lengths.sum()]))[0])
    if lengths.sum() == 0:
        return total
    for k in set(kinds[lengths > 0].tolist()):  # a kind's pass, and its chain as long as its longest request's
        total += costs[k].fixed + costs[k].per_pass * lengths[kinds == k].max()
    total += shared
    for n, k, b in zip(lengths, kinds, backlog, strict=True):
        if n:
            total += costs[k].per_request + costs[k].per_context * b + costs[k].per_position * n
    return total


def test_a_plan_over_several_kinds_charges_each_kind_its_own_cost_and_each_chain_its_passes():
    rng = np.random.default_rng(0)
    for _ in range(300):
        r = int(rng.integers(1, 6))
        rows = [rng.uniform(0, 1, rng.integers(0, 6)) for _ in range(r)]
        costs = [DraftCost(*rng.uniform(0, [0.01, 0.002, 0.001, 1e-5, 0.002])) for _ in range(3)]
        kinds, verify = rng.integers(0, 3, r), linear(rng.uniform(0.005, 0.02), rng.uniform(0, 2e-3))
        shared = float(rng.uniform(0, 0.005))
        plan = DraftPlanner().plan(Survival.of(rows), verify, DraftingCosts(costs, shared), kinds)
        assert plan.predicted_seconds == pytest.approx(explicit_seconds(plan.lengths, kinds, verify, costs,
                                                                        np.zeros(r), shared))
        assert plan.expected_tokens == pytest.approx(r + sum(np.cumprod(p)[:n].sum() for p, n in
                                                             zip(rows, plan.lengths, strict=True)))


def test_a_dear_kind_drafts_less_than_a_cheap_one_of_equal_acceptance():
    rows = [np.full(6, 0.8), np.full(6, 0.8)]
    cheap, dear = DraftCost(1e-4, 1e-4, 1e-5), DraftCost(1e-4, 1e-4, 4e-3)
    plan = DraftPlanner().plan(Survival.of(rows), linear(0.01, 1e-4), DraftingCosts([cheap, dear]), np.array([0, 1]))
    assert plan.lengths[0] == 6 and plan.lengths[1] < 6


def test_chooser_picks_the_kind_with_the_larger_net_gain_and_respects_what_a_request_allows():
    ch = KindChooser(kinds=2, bonus=0.0)
    verify, cost = linear(0.01, 1e-3), DraftCost(0.0, 1e-4, 1e-5)
    predicted = [[np.full(6, 0.9), np.full(6, 0.2)],  # kind 0: request 0 good, request 1 poor
                 [np.full(6, 0.3), np.full(6, 0.8)]]  # kind 1: the reverse
    assert ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts([cost, cost])))[0].tolist() == [0, 1]
    # the same acceptance, but kind 0 costs more per position than the drafts are worth
    assert ch.choose(KindQuestion(Predicted.of([predicted[0], predicted[0]]), verify,
                     DraftingCosts([DraftCost(0.0, 1e-4, 5e-3), cost])))[0].tolist() == [1, 1]
    allowed = np.array([[False, True], [True, True]])
    assert kinds_of(ch, Predicted.of(predicted), verify, DraftingCosts([cost, cost]), allowed) == [1, 1]


def test_chooser_tries_a_kind_the_unit_has_seldom_verified_when_values_are_close_and_not_when_far():
    verify, cost = linear(0.01, 1e-3), DraftCost(0.0, 1e-4, 1e-5)
    close = Predicted.of([[np.full(4, 0.60)], [np.full(4, 0.55)]])
    far = Predicted.of([[np.full(4, 0.9)], [np.full(4, 0.1)]])
    ch = KindChooser(kinds=2, bonus=1.0)
    two = DraftingCosts([cost, cost])
    assert ch.choose(KindQuestion(close, verify, two))[0].tolist() == [0]  # equally unsure: the better estimate
    assert kinds_of(ch, close, verify, two, support=Support(np.array([1, 0]))) == [1]  # 1 never verified
    assert kinds_of(ch, far, verify, DraftingCosts([cost, cost]), support=Support(np.array([1, 0]))) == [0]
    # both known
    assert ch.choose(KindQuestion(close, verify, two, support=Support(np.array([500, 400]))))[0].tolist() == [0]


def test_a_request_keeps_the_kind_it_knows_unless_another_beats_it_by_more_than_the_doubt():
    """`caution`: a kind's value for a request is cut by caution / sqrt(1 + the verifications its
    own factor rests on), so a request switches to a kind it has not verified only when that kind's
    estimate leads by more than the doubt (the winner's curse: of several noisy estimates the
    largest is the likeliest overestimated)."""
    verify, cost = linear(0.01, 1e-3), DraftCost(0.0, 1e-4, 1e-5)
    close = Predicted.of([[np.full(4, 0.60)], [np.full(4, 0.65)]])
    far = Predicted.of([[np.full(4, 0.30)], [np.full(4, 0.95)]])
    two = DraftingCosts([cost, cost])
    cautious, trusting = KindChooser(kinds=2, bonus=0.0, caution=1.0), KindChooser(kinds=2, bonus=0.0)
    assert kinds_of(trusting, close, verify, two, support=Support(request=np.array([[10, 0]]))) == [1]
    # 1 unverified: doubted
    assert kinds_of(cautious, close, verify, two, support=Support(request=np.array([[10, 0]]))) == [0]
    # both known
    assert kinds_of(cautious, close, verify, two, support=Support(request=np.array([[10, 10]]))) == [1]
    # leads by more than doubt
    assert kinds_of(cautious, far, verify, two, support=Support(request=np.array([[10, 0]]))) == [1]
    gate = DraftingGate([AcceptanceTracker(block=4) for _ in range(2)], Exploration())
    gate.learn(Verified.of([5, 5, 6], [0, 0, 1], [3, 2, 4], [3, 1, 0]))
    assert gate.evidence([5, 6, 7]).tolist() == [[2, 0], [0, 1], [0, 0]]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_where_some_kind_pays_the_choice_drafts_something(seed):
    """Whatever the bonus does, a step where some request's drafts pay with some kind (its value
    above the kind's pass cost, at plain decoding's rate) is never left without drafts: each
    request's chosen kind pays, or is the bonus's and drafts to explore. Refining the rate
    (Dinkelbach) could pick, by the bonus, a kind that pays nothing at the raised rate while an
    earlier round's choice paid; the step then drafted nothing (42 of 3,000 random cases before
    the best round was kept, session 16)."""
    rng = np.random.default_rng(seed)
    r, k = int(rng.integers(1, 4)), 3
    predicted = [[rng.uniform(0.2, 1.0, int(rng.integers(1, 8))) for _ in range(r)] for _ in range(k)]
    costs = [DraftCost(*rng.uniform(0, [0.004, 2e-4, 2e-4, 0.0, 2e-3])) for _ in range(k)]
    verify = linear(rng.uniform(0.005, 0.02), rng.uniform(1e-4, 3e-3))
    ch = KindChooser(k, bonus=1.0)
    kind, exploring, _ = ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs),
                                   support=Support(rng.integers(0, 50, k))))
    question = KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs))
    value, *_ = ch.values(question)
    plain = r / float(verify.seconds(np.array([r]))[0])
    pays = (value - plain * np.array([c.fixed for c in costs])[None, :] > 0).any()
    # A chained kind's pass is shared by the requests that chose it: each is charged its share
    # (seed 7661: a kind every request took pays at a third of its pass each, not at the whole).
    shared, *_ = ch.values(question, sharing=np.bincount(kind, minlength=k))
    assert not pays or exploring.any() or (shared[np.arange(r), kind] > 0).any()


def simulate(gate, types, truth, steps, rng, allowed=None):
    """Requests of `types` (index into truth[kind][type], the true per-position acceptance),
    decided and verified for `steps` steps; returns the kind each request used per step."""
    rids = list(range(len(types)))
    verify, cost = linear(0.01, 1e-4), DraftCost(1e-4, 1e-4, 1e-5)
    used = []
    for _ in range(steps):
        caps = np.full(len(rids), 7)
        plan = gate.decide(GateInput.capture(rids, caps, np.full(len(rids), 500),
                                             KindReach(np.zeros((len(rids), len(gate.trackers))), allowed),
                                             verify, DraftingCosts([cost] * len(gate.trackers))))
        kinds, lengths = plan.kinds, plan.lengths
        used.append(kinds.copy())
        for rid, k, n in zip(rids, kinds, lengths, strict=True):
            if n:
                ok = rng.random(int(n)) < truth[k][types[rid]]
                gate.observe(rid, int(k), int(n), int(np.argmin(ok)) if not ok.all() else int(n))
    return np.array(used)


def test_the_gate_learns_which_kind_suits_which_request():
    """Two populations: kind 0 accepts 0.9 of type A's drafts and 0.4 of type B's, kind 1 the
    reverse. Starting from nothing, the bandit settles each request on its own better kind."""
    rng = np.random.default_rng(1)
    gate = DraftingGate([AcceptanceTracker(block=8), AcceptanceTracker(block=8)],
                        Exploration(every=50, requests=2, warmup=0))
    types = [0, 1] * 8
    truth = [[0.9, 0.4], [0.4, 0.9]]
    used = simulate(gate, types, truth, 150, rng)
    late = used[-50:]
    right = np.mean([late[:, i] == types[i] for i in range(len(types))])
    assert right > 0.85
    assert (used[:20] != np.array(types)).any()  # it did have to learn


def test_a_multi_kind_history_replays_exactly():
    rng = np.random.default_rng(2)

    def fresh(**kw):
        return DraftingGate([AcceptanceTracker(block=8), AcceptanceTracker(block=8)],
                            Exploration(every=50, requests=2, warmup=0), **kw)

    live, log = fresh(), []
    rids = [0, 1, 2, 3]
    allowed = np.array([[True, True], [True, False], [True, True], [False, True]])
    for _ in range(120):
        caps = rng.integers(0, 8, len(rids))
        costs = [DraftCost(rng.uniform(0, 0.01), 1e-4, 1e-5, 1e-6), DraftCost(rng.uniform(0, 0.01), 2e-4, 1e-5, 1e-6)]
        reach = KindReach(rng.integers(0, 20, (4, 2)), allowed)
        plan = live.decide(GateInput.capture(rids, caps, np.full(4, 40), reach, linear(0.01, 2e-4),
                                             DraftingCosts(costs, 1e-3)))
        g, kinds, lengths = plan.seen, plan.kinds, plan.lengths
        assert all(allowed[i, k] for i, k in enumerate(kinds))
        kept = np.minimum(lengths, rng.integers(0, 8, 4))
        accepted = [int(rng.integers(0, k + 1)) for k in kept]
        live.learn(Verified.of(rids, kinds, kept, accepted))  # one step, one batch: as the engine learns
        log.append({"gate": {"input": g.as_dict(), "lengths": lengths.tolist(), "kinds": kinds.tolist()},
                    "observed": {"rids": rids, "kinds": kinds.tolist(), "kept": kept.tolist(), "accepted": accepted,
                                 "beyond": [], "beyond_cu": None}})
    plans = replay(fresh(), log)
    assert len(plans) == 120 and all(np.array_equal(a, b) for a, b in plans)
    assert len({int(k) for a, _ in plans for k in a[0]}) == 2  # both kinds were chosen
    assert any(not np.array_equal(a, b) for a, b in replay(fresh(bonus=0.0), log))


def test_a_kind_is_predicted_and_asked_only_as_far_as_it_can_draft_now():
    """Kind 1 (an n-gram kind) accepts far more than kind 0, but its look-ahead found nothing
    for request 0 and three drafts for request 1: request 0 drafts with kind 0, request 1 with
    kind 1 and at most three drafts — exploring or not, gated or not."""
    for bonus in (0.0, 5.0):
        gate = DraftingGate([AcceptanceTracker(block=8), AcceptanceTracker(block=8)],
                            Exploration(every=50, requests=2, warmup=0), bonus=bonus)
        for _ in range(40):
            gate.trackers[0].observe(9, 7, 2)
            gate.trackers[1].observe(9, 7, 7)
        costs = [DraftCost(1e-4, 1e-4, 1e-5), DraftCost(1e-5, 1e-5, 1e-6)]
        g = GateInput.capture([0, 1], [7, 7], [40, 40],
                              KindReach(np.zeros((2, 2)), available=np.array([[-1, 0], [-1, 3]])),
                              linear(0.01, 1e-5), DraftingCosts(costs))
        assert g.room().tolist() == [[7, 0], [7, 3]]
        for plan in (gate.decide(g), gate.choose(g)):
            assert plan.kinds.tolist() == [0, 1]
            assert plan.lengths[0] > 0 and 0 < plan.lengths[1] <= 3
        back = GateInput.from_dict(g.as_dict())
        assert np.array_equal(back.available, g.available) and np.array_equal(back.room(), g.room())
    # a kind a request may not use has no room, whatever it could draft
    g = GateInput.capture([0], [5], [40], KindReach(np.zeros((1, 2)), np.array([[True, False]]), np.array([[2, 4]])),
                          linear(0.01, 1e-5), DraftingCosts(costs))
    assert g.room().tolist() == [[2, 0]]


def test_what_a_look_ahead_would_have_had_accepted_replays_as_it_was_learnt():
    """The engine teaches the n-gram kind's tracker from its look-ahead on steps it did not
    draft (`hindsight_outcomes`), logged as `shadow`: a replay learns the same and plans the same."""
    rng = np.random.default_rng(5)

    def fresh():
        return DraftingGate([AcceptanceTracker(block=8), AcceptanceTracker(block=8)],
                            Exploration(every=50, requests=2, warmup=0))

    live, log, rids = fresh(), [], [0, 1, 2]
    costs = [DraftCost(2e-3, 1e-4, 1e-5), DraftCost(1e-5, 1e-5, 1e-6)]
    for _ in range(80):
        available = np.stack([np.full(3, -1), rng.integers(0, 8, 3)], axis=1)
        reach = KindReach(np.zeros((3, 2)), available=available)
        plan = live.decide(GateInput.capture(rids, [7, 7, 7], [40, 40, 40], reach, linear(0.01, 2e-4),
                                             DraftingCosts(costs)))
        kinds, lengths = plan.kinds, plan.lengths
        kept = lengths.copy()
        accepted = [int(rng.integers(0, k + 1)) for k in kept]
        shadow = [[rid, 1, int(min(available[i, 1], accepted[i] + 1)), 0] for i, rid in enumerate(rids)
                  if (kinds[i] != 1 or lengths[i] == 0) and available[i, 1] > 0]
        verified = Verified.of(rids, kinds, kept, accepted)
        live.learn(verified.then(Verified.of(*zip(*shadow, strict=True))) if shadow else verified)
        log.append({"gate": {"input": plan.seen.as_dict(), "lengths": lengths.tolist(), "kinds": kinds.tolist()},
                    "observed": {"rids": rids, "kinds": kinds.tolist(), "kept": kept.tolist(), "accepted": accepted,
                                 "beyond": [], "beyond_cu": None, "shadow": shadow}})
    plans = replay(fresh(), log)
    assert all(np.array_equal(a, b) for a, b in plans)
    unshadowed = [{**r, "observed": {**r["observed"], "shadow": []}} for r in log]
    assert any(not np.array_equal(a, b) for a, b in replay(fresh(), unshadowed))


def test_a_kind_whose_pass_costs_more_than_its_few_requests_gain_is_left_out_of_the_batch():
    """Kind 1 is a little better for request 2 alone; worth it when its pass is cheap, not when
    the pass costs more than that request gains over kind 0 (the pass is paid once per step)."""
    verify = linear(0.01, 1e-4)
    predicted = [[np.full(4, 0.8), np.full(4, 0.8), np.full(4, 0.6)],
                 [np.full(4, 0.3), np.full(4, 0.3), np.full(4, 0.7)]]
    ch = KindChooser(kinds=2, bonus=0.0)
    cheap = [DraftCost(1e-4, 1e-4, 1e-5), DraftCost(1e-4, 1e-4, 1e-5)]
    assert ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(cheap)))[0].tolist() == [0, 0, 1]
    dear = [DraftCost(1e-4, 1e-4, 1e-5), DraftCost(5e-3, 1e-4, 1e-5)]
    assert ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(dear)))[0].tolist() == [0, 0, 0]
    # ... unless the request may use nothing else
    only = np.array([[True, True], [True, True], [False, True]])
    assert ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(dear), only))[0].tolist() == [0, 0, 1]


def test_switching_kinds_costs_the_context_the_new_kind_has_not_seen():
    """Equal estimates; kind 1 has seen none of the request's 600-token context, kind 0 all of
    it: catching up is charged (in the share of the remaining output the step may make), so the
    request stays with kind 0 — unless little context is missing."""
    verify = linear(0.01, 1e-4)
    predicted = [[np.full(4, 0.7)], [np.full(4, 0.72)]]
    costs = [DraftCost(0.0, 1e-4, 1e-5, 2e-5), DraftCost(0.0, 1e-4, 1e-5, 2e-5)]
    ch = KindChooser(kinds=2, bonus=0.0)
    assert ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs)))[0].tolist() == [1]
    far = ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs), held=np.array([[0.0, 600.0]]),
                    remaining=np.array([20])))
    assert far[0].tolist() == [0]
    near = ch.choose(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs), held=np.array([[0.0, 2.0]]),
                     remaining=np.array([20])))
    assert near[0].tolist() == [1]


def test_a_chains_passes_are_shared_by_the_requests_that_draft_with_it():
    """A chained kind (per pass 2 ms) accepting a little more than a cheap kind: one request
    alone pays the whole chain and takes the cheap kind; sixteen share it and take the chain."""
    verify = linear(0.010, 2e-4)
    costs = [DraftCost(0.0, 1e-4, 1e-5), DraftCost(0.0, 1e-4, 1e-5, 0.0, 0.002)]  # cheap; chain
    for r, want in ((1, 0), (16, 1)):
        predicted = [[np.full(4, 0.5)] * r, [np.full(4, 0.7)] * r]
        kind, _, _ = KindChooser(2, bonus=0.0).choose(
            KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs)))
        assert (kind == want).all(), (r, kind)


def reference_values(predicted, verify, costs, rate, held, remaining, sharing):
    """`KindChooser.values` written out request by request, kind by kind and length by length."""
    r, k = len(predicted[0]), len(predicted)
    base = float(verify.seconds(np.array([r]))[0])
    tau = float(verify.seconds(np.array([r + 1]))[0]) - base
    rate = r / base if rate is None else rate
    v, gain_at, n_at = np.zeros((r, k)), np.zeros((r, k)), np.zeros((r, k))
    for j in range(k):
        width = max(len(p) for p in predicted[j])
        if width == 0:
            continue
        c = costs[j]
        per_pass = c.per_pass / (1.0 if sharing is None else max(1.0, float(sharing[j])))
        for i in range(r):
            rates = [min(1.0, max(0.0, x)) for x in predicted[j][i]] + [0.0] * (width - len(predicted[j][i]))
            best, survive, gain = None, 1.0, 0.0
            for n in range(1, width + 1):
                survive *= rates[n - 1]
                gain += survive
                net = gain - rate * (c.per_request + n * (c.per_position + per_pass + tau))
                if held is not None:
                    net -= rate * c.per_context * held[i, j] * min(1.0, (1.0 + gain) / max(1.0, remaining[i]))
                if best is None or net > best[0]:
                    best = (net, gain, n)
            v[i, j], gain_at[i, j], n_at[i, j] = best
    return v, gain_at, n_at


def reference_assign(score, fixed, call=0.0, calls=None):
    """`KindChooser._assign` by enumerating the sets of kinds one by one: a set holding a kind
    drafted on the replicas (`calls`) pays their `call` once."""
    r, k = score.shape
    best_total, use = -np.inf, None
    for subset in range(1, 2 ** k):
        inside = [(subset >> j) & 1 == 1 for j in range(k)]
        total = sum(max(0.0, max((score[i, j] for j in range(k) if inside[j]), default=-np.inf))
                    for i in range(r)) - sum(fixed[j] for j in range(k) if inside[j])
        if calls is not None and any(inside[j] and calls[j] for j in range(k)):
            total -= call
        if total > best_total + 1e-9:
            best_total, use = total, inside
    return best_total, use


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(2, 3), st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_the_chooser_array_code_equals_a_request_by_request_reference(r, k, seed, with_held, with_sharing):
    """Values over every kind at once equal the loops they replace, and the chosen set of kinds
    is the best of all sets (ties: within rounding)."""

    rng = np.random.default_rng(seed)
    widths = rng.integers(0, 6, k)
    predicted = [[rng.random(int(rng.integers(0, w + 1))) * 1.2 for _ in range(r)] for w in widths]
    costs = [DraftCost(*rng.uniform(0, [2e-3, 5e-4, 5e-4, 1e-5, 2e-3])) for _ in range(k)]
    verify = linear(0.01, float(rng.uniform(0, 1e-3)))
    held = rng.integers(0, 300, (r, k)).astype(np.float64) if with_held else None
    remaining = rng.integers(1, 60, r)
    sharing = rng.integers(0, r + 1, k) if with_sharing else None
    rate = None if seed % 2 else float(rng.uniform(10, 500))
    ch = KindChooser(k, bonus=0.0)
    got = ch.values(KindQuestion(Predicted.of(predicted), verify, DraftingCosts(costs), held=held, remaining=remaining),
                    rate, sharing)
    want = reference_values(predicted, verify, costs, rate, held, remaining, sharing)
    for a, b in zip(got[:3], want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    score = got[0] + rng.normal(0, 0.5, (r, k))
    fixed = rng.uniform(0, 1.0, k)
    call, calls = float(rng.uniform(0, 1.0)), rng.random(k) < 0.6
    kind, use = ch._assign(score, fixed, call, calls)
    best, _ = reference_assign(score, fixed, call, calls)
    chosen = np.maximum(np.where(use, score, -np.inf).max(axis=1), 0.0).sum() - fixed[use].sum() \
        - call * bool((use & calls).any())
    assert chosen == pytest.approx(best, abs=1e-9)
    assert use[kind].all() or not np.isfinite(np.where(use, score, -np.inf).max(axis=1)).all()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_a_choices_predicted_rate_adds_up_what_its_step_would_cost(r, k, seed):
    """`Choice.predicted_rate` of an assignment against the step's time written out
    (`explicit_seconds`), the replicas' call paid once where a kind drafted there is in use."""
    rng = np.random.default_rng(seed)
    costs = [DraftCost(*(rng.uniform(0, [2e-3, 5e-4, 5e-4, 1e-5, 2e-3]) * (rng.random(5) < 0.7))) for _ in range(k)]
    shared, call, remote = float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 1e-3)), rng.random(k) < 0.5
    verify = linear(0.01, float(rng.uniform(0, 1e-3)))
    question = KindQuestion(Predicted.of([[rng.random(6) for _ in range(r)] for _ in range(k)]), verify,
                            DraftingCosts(costs, shared, call, remote))
    kind, n = rng.integers(0, k, r), rng.integers(1, 7, r).astype(np.float64)
    drafts = rng.random(r) < 0.7
    drafts[0] = True  # the chooser asks only of an assignment where some request drafts
    gain = rng.uniform(0, n)
    rate, sharing = KindChooser(k)._choice(question).predicted_rate(kind, drafts, gain, n)
    seconds = explicit_seconds(np.where(drafts, n, 0).astype(np.int64), kind, verify, costs, np.zeros(r), shared)
    seconds += call if remote[kind[drafts]].any() else 0.0
    assert rate == pytest.approx((r + gain[drafts].sum()) / seconds, rel=1e-12)
    assert sharing.tolist() == np.bincount(kind[drafts], minlength=k).tolist()


def test_the_replicas_call_is_priced_once_and_only_for_the_kinds_drafted_there():
    """Two kinds of equal acceptance and cost, kind 1 drafted on the replicas: a call dear
    enough moves every request to kind 0 (drafted in the coordinator), and the planner charges
    the call once when some request drafts with kind 1, never when only kind 0 drafts."""
    verify, cost = linear(0.01, 1e-3), DraftCost(0.0, 1e-4, 1e-5)
    predicted = Predicted.of([[np.full(4, 0.8)] * 3, [np.full(4, 0.8)] * 3])
    remote = np.array([False, True])
    ch = KindChooser(2, bonus=0.0)
    assert kinds_of(ch, predicted, verify, DraftingCosts([cost, cost], 0.0, 0.0, remote)) == [0, 0, 0]
    dear = DraftingCosts([cost, DraftCost(0.0, 1e-4, 1e-6)], 0.0, 0.0, remote)  # kind 1 cheaper per draft...
    assert set(ch.choose(KindQuestion(predicted, verify, dear))[0].tolist()) == {1}
    dearer = DraftingCosts(dear.draft, 0.0, 0.05, remote)  # ...until its call costs more than that saves
    assert ch.choose(KindQuestion(predicted, verify, dearer))[0].tolist() == [0, 0, 0]
    planner, survival = DraftPlanner(), Survival.of(np.full((3, 4), 0.8))
    local = planner.plan(survival, verify, DraftingCosts([cost, cost], 0.0, 0.02, remote), np.zeros(3, np.int64))
    free = planner.plan(survival, verify, DraftingCosts([cost, cost], 0.0, 0.0, remote), np.zeros(3, np.int64))
    assert local.lengths.tolist() == free.lengths.tolist() and local.predicted_seconds == free.predicted_seconds
    mixed = np.array([0, 1, 0])
    paid = planner.plan(survival, verify, DraftingCosts([cost, cost], 0.0, 1e-4, remote), mixed)
    unpaid = planner.plan(survival, verify, DraftingCosts([cost, cost], 0.0, 0.0, remote), mixed)
    assert paid.lengths.tolist() == unpaid.lengths.tolist() and paid.lengths[1] > 0
    assert paid.predicted_seconds == pytest.approx(unpaid.predicted_seconds + 1e-4, rel=1e-12)


def two_kind_input(rids, available=None):
    costs = [DraftCost(1e-4, 1e-4, 1e-5), DraftCost(1e-4, 1e-4, 1e-5)]
    r = len(rids)
    return GateInput.capture(rids, np.full(r, 7), np.full(r, 40), KindReach(np.zeros((r, 2)), None, available),
                             linear(0.01, 1e-5), DraftingCosts(costs))


class CountingChooser(KindChooser):
    calls = 0

    def choose(self, *args, **kwargs):
        CountingChooser.calls += 1
        return super().choose(*args, **kwargs)


def counting_gate(stick):
    gate = DraftingGate([AcceptanceTracker(block=8), AcceptanceTracker(block=8)],
                        Exploration(every=50, requests=2, warmup=0), bonus=0.0, stick=stick)
    gate.chooser = CountingChooser(2, 0.0, caution=gate.caution)
    for _ in range(40):  # kind 1 accepts more: the chooser's pick for everyone
        gate.trackers[0].observe(9, 7, 2)
        gate.trackers[1].observe(9, 7, 6)
    CountingChooser.calls = 0
    return gate


def test_a_kind_sticks_for_its_term_and_the_chooser_runs_again_after_it():
    gate = counting_gate(stick=3)
    kinds = [gate.decide(two_kind_input([0, 1])).kinds.tolist() for _ in range(7)]
    assert kinds == [[1, 1]] * 7
    assert CountingChooser.calls == 3  # decisions 1, 4, 7: each choice kept for two more
    plain = counting_gate(stick=1)
    for _ in range(4):
        plain.decide(two_kind_input([0, 1]))
    assert CountingChooser.calls == 4 and plain.held()["sticky_choices"] == 0


def test_a_new_request_an_unusable_kind_or_a_miss_makes_the_whole_batch_choose_again():
    gate = counting_gate(stick=10)
    gate.decide(two_kind_input([0, 1]))
    gate.decide(two_kind_input([0, 1]))
    assert CountingChooser.calls == 1
    gate.decide(two_kind_input([0, 1, 2]))  # request 2 has no kept kind: all choose (a batch's kinds share passes)
    assert CountingChooser.calls == 2
    plan = gate.decide(two_kind_input([0, 1, 2], available=np.array([[-1, -1], [-1, 0], [-1, -1]])))
    assert CountingChooser.calls == 3 and plan.kinds.tolist() == [1, 0, 1]  # kind 1 has nothing for request 1 now
    calls = CountingChooser.calls
    plan = gate.decide(two_kind_input([0, 1, 2]))  # kept for its term, though kind 1 could draft again
    assert CountingChooser.calls == calls and plan.kinds.tolist() == [1, 0, 1]
    gate.learn(Verified.of([0], [1], [3], [0]))  # request 0's kept kind had nothing accepted: evidence
    gate.decide(two_kind_input([0, 1, 2]))
    assert CountingChooser.calls == calls + 1
    for rid in (0, 1, 2):
        gate.forget(rid)
    assert gate.held()["sticky_choices"] == 0


def test_one_kind_keeps_no_choices():
    gate = DraftingGate([AcceptanceTracker(block=8)], Exploration(every=50, requests=2, warmup=0), stick=5)
    costs = DraftingCosts([DraftCost(1e-4, 1e-4, 1e-5)])
    gate.decide(GateInput.capture([0], [7], [40], KindReach(np.zeros((1, 1))), linear(0.01, 1e-5), costs))
    assert gate.held()["sticky_choices"] == 0


def test_a_history_learnt_a_step_late_replays_exactly():
    """The engine may learn step t after its gate decided step t + 1 (the learning hidden behind
    the forward); a log whose records say so (`late`) replays every plan exactly."""
    rng = np.random.default_rng(3)

    def fresh():
        return DraftingGate([AcceptanceTracker(block=8), AcceptanceTracker(block=8)],
                            Exploration(every=50, requests=2, warmup=0))

    live, log, pending = fresh(), [], None
    rids = [0, 1, 2]
    for step in range(80):
        caps = rng.integers(0, 8, len(rids))
        costs = [DraftCost(rng.uniform(0, 0.01), 1e-4, 1e-5, 1e-6), DraftCost(rng.uniform(0, 0.01), 2e-4, 1e-5, 1e-6)]
        plan = live.decide(GateInput.capture(rids, caps, np.full(3, 40), KindReach(rng.integers(0, 20, (3, 2))),
                                             linear(0.01, 2e-4), DraftingCosts(costs, 1e-3)))
        if pending is not None:
            live.learn(pending)
        kept = np.minimum(plan.lengths, rng.integers(0, 8, 3))
        accepted = [int(rng.integers(0, k + 1)) for k in kept]
        late = step % 5 != 4  # now and then learnt before the next decision (an idle engine settles at once)
        pending = Verified.of(rids, plan.kinds, kept, accepted)
        if not late:
            live.learn(pending)
            pending = None
        log.append({"gate": {"input": plan.seen.as_dict(), "lengths": plan.lengths.tolist(),
                             "kinds": plan.kinds.tolist()},
                    "observed": {**Verified.of(rids, plan.kinds, kept, accepted).as_dict(), "empty": []},
                    "late": late})
    plans = replay(fresh(), log)
    assert len(plans) == 80 and all(np.array_equal(a, b) for a, b in plans)
    assert sum(int(p[0][1].sum()) for p in plans) > 0


def random_question(rng: np.random.Generator, r: int, k: int) -> KindQuestion:
    """A kind question as the gate asks it, or odder: ragged rows (a kind may have none), rates
    of ties (0, ½, 1) or any, allowed kinds (a request may be allowed none), switch charges,
    chains, the replicas' call, the unit's and each request's support, a captured verify table
    or a smooth curve."""
    lengths = rng.integers(0, 8, (r, k)) * (rng.random((r, k)) < 0.8)
    lengths[rng.integers(r), rng.integers(k)] = int(rng.integers(1, 8))  # some kind can draft
    width = int(lengths.max())
    rates = rng.choice([0.0, 0.5, 1.0], (r, k, width)) if rng.random() < 0.3 else rng.uniform(0, 1, (r, k, width))
    rates[np.arange(width) >= lengths[:, :, None]] = 0.0
    scale = rng.uniform(0, [2e-3, 5e-4, 5e-4, 1e-5, 2e-3]) * (rng.random((k, 5)) < 0.7)
    if rng.random() < 0.3:  # every kind priced alike: ties between kinds
        scale[:] = scale[0]
    costs = DraftingCosts([DraftCost(*row) for row in scale], float(rng.uniform(0, 5e-4)),
                          float(rng.uniform(0, 1e-3)) if rng.random() < 0.5 else 0.0, rng.random(k) < 0.5)
    if rng.random() < 0.2:  # a flat curve (no cost model): ties between lengths
        verify = StepCost(lambda n: np.full(np.shape(n), 5e-3), 0.0)
    else:
        verify = StepCost(lambda n: 4e-3 + 3e-4 * np.sqrt(np.asarray(n, dtype=np.float64)), 0.0)
    if rng.random() < 0.5:  # as the gate captures it: the counts R .. R + Σ caps
        caps = lengths.max(axis=1)
        verify = GateInput.capture(list(range(r)), caps, np.full(r, 50), KindReach(np.zeros((r, k))), verify,
                                   costs).verify()
    allowed = rng.random((r, k)) < 0.8 if rng.random() < 0.4 else None
    held = rng.integers(0, 300, (r, k)).astype(np.float64) if rng.random() < 0.6 else None
    support = Support(rng.integers(0, 500, k).astype(np.float64) if rng.random() < 0.8 else None,
                      rng.integers(0, 6, (r, k)).astype(np.float64) if rng.random() < 0.7 else None)
    return KindQuestion(Predicted(rates, lengths), verify, costs, allowed, held, rng.integers(1, 60, r), support)


@settings(max_examples=600, deadline=None)
@given(st.integers(1, 7), st.integers(2, 4), st.integers(0, 2**31 - 1))
def test_a_few_requests_kinds_chosen_in_plain_python_equal_the_array_codes_to_the_last_bit(r, k, seed):
    """`_InTurn` (plain Python, taken up to IN_TURN_REQUESTS requests; exact up to seven, where
    numpy's sums are still in turn) against the array code, on random questions and every
    chooser setting: the same kinds, exploration and fallbacks."""
    rng = np.random.default_rng(seed)
    q = random_question(rng, r, k)
    ch = KindChooser(k, bonus=float(rng.choice([0.0, 1.0, 2.5])), refine=int(rng.integers(1, 4)),
                     switch=bool(rng.random() < 0.7), fallback=bool(rng.random() < 0.8),
                     caution=float(rng.choice([0.0, 1.0])))
    bonus, doubt = ch._optimism(q)
    whole = ch._choose_whole(q, bonus, doubt)
    in_turn = choosing._InTurn(ch, q).choose(bonus, doubt)
    for a, b in zip(in_turn, whole, strict=True):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()


def test_the_chooser_takes_the_plain_python_path_for_a_few_requests_only():
    rng = np.random.default_rng(3)
    ch = KindChooser(3, caution=1.0)
    with mock.patch.object(choosing._InTurn, "choose", autospec=True, side_effect=choosing._InTurn.choose) as in_turn, \
            mock.patch.object(KindChooser, "_choose_whole", autospec=True,
                              side_effect=KindChooser._choose_whole) as whole:
        ch.choose(random_question(rng, choosing.IN_TURN_REQUESTS, 3))
        assert (in_turn.call_count, whole.call_count) == (1, 0)
        ch.choose(random_question(rng, choosing.IN_TURN_REQUESTS + 1, 3))
        assert (in_turn.call_count, whole.call_count) == (1, 1)
