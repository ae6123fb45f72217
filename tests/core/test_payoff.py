"""The payoff check (dcut_core/payoff.py): plain decoding measured beside the gate's steps, band
by band, and played where it delivers more. Exact small cases, then a property: against any two
steady arms it ends on the better one, paying at most its probes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core.learned import LearnedState
from dcut_core.payoff import DRAFTING, PLAIN, PayoffCheck, arms_of


def play(check: PayoffCheck, requests: int, drafting_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """`steps` steps of one band against steady arms (tokens a second of each, a plain step
    predicted at 1 s); the arms played, in order."""
    arms = []
    for _ in range(steps):
        drafts = check.arm(requests)
        rate = drafting_rate if drafts else plain_rate
        check.observe(requests, drafts, rate * requests, 1.0, 1.0)
        arms.append(drafts)
    return arms


def test_bands_double_and_hold_the_usual_concurrencies_inside():
    requests = (0, 1, 2, 3, 4, 5, 6, 11, 12, 15, 16, 23, 24, 32, 47, 48, 64, 95, 96, 1024)
    assert [PayoffCheck.band_of(r) for r in requests] == \
        [0, 0, 1, 2, 2, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 10]
    assert [PayoffCheck.lowest(b) for b in range(8)] == [1, 2, 3, 6, 12, 24, 48, 96]
    for r in range(1, 3000):  # `lowest` is each band's first request count
        assert PayoffCheck.band_of(PayoffCheck.lowest(PayoffCheck.band_of(r))) == PayoffCheck.band_of(r)
        assert PayoffCheck.band_of(PayoffCheck.lowest(PayoffCheck.band_of(r)) - 1) < PayoffCheck.band_of(r) or r < 2


def test_a_fresh_band_drafts_and_probes_plain_decoding_every_warm_steps_until_both_arms_are_known():
    check = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4)
    arms = play(check, 8, drafting_rate=2.0, plain_rate=1.0, steps=12)
    assert arms == [True, True, True, False] * 3
    assert check.lead(check.bands[3]) == 2.0


def test_a_band_where_drafting_loses_decodes_plainly_and_probes_drafting():
    check = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4, probe=16, sure=64, margin=0.15)
    arms = play(check, 16, drafting_rate=0.95, plain_rate=1.0, steps=12 + 64)
    later = arms[12:]  # band steps 13 .. 76: drafting only on the steps divisible by `probe`
    assert [i + 13 for i, a in enumerate(later) if a] == [16, 32, 48, 64]
    far = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4, probe=16, sure=64, margin=0.15)
    arms = play(far, 16, drafting_rate=0.5, plain_rate=1.0, steps=12 + 64)
    assert [i + 13 for i, a in enumerate(arms[12:]) if a] == [64]  # a lead past the margin: every `sure` steps


def test_a_band_where_drafting_pays_drafts_and_probes_plain_decoding():
    check = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4, probe=16, sure=64, margin=0.15)
    arms = play(check, 1, drafting_rate=1.1, plain_rate=1.0, steps=12 + 64)
    assert [i + 13 for i, a in enumerate(arms[12:]) if not a] == [16, 32, 48, 64]


def test_bands_are_measured_apart():
    check = PayoffCheck(least_requests=1, plain_requests=1, least=2, warm=2)
    play(check, 1, drafting_rate=3.0, plain_rate=1.0, steps=8)
    play(check, 40, drafting_rate=0.5, plain_rate=1.0, steps=8)
    assert check.leads() == {1: 3.0, 24: 0.5}


def test_outcomes_are_scaled_by_the_plain_steps_prediction():
    """Two steps of one band at different request counts and contexts compare by tokens a second
    over what a plain step of their shape is predicted to make."""
    check = PayoffCheck(least_requests=1, plain_requests=1, least=1)
    check.observe(16, False, 16, 0.010, 0.010)  # a plain step as predicted
    check.observe(20, True, 30, 0.015, 0.0125)  # 1.5 tokens a request in 1.2 x a plain step's time
    assert abs(check.lead(check.bands[4]) - 1.25) < 1e-12


def test_an_arms_rate_is_its_tokens_over_its_time_not_its_typical_step():
    """At one request drafting accepts nothing in most steps and runs long in a few: three steps
    of 1 token and one of 8, each 1.2 x a plain step's time, make 11 tokens in 4.8 plain steps'
    time (2.3 x plain decoding), though the median step makes 0.83 x."""
    check = PayoffCheck(least_requests=1, plain_requests=1, least=1)
    for tokens in (1, 1, 8, 1):
        check.observe(1, True, tokens, 0.012, 0.010)
    check.observe(1, False, 1, 0.010, 0.010)
    assert abs(check.lead(check.bands[0]) - 11 / 4.8) < 1e-12


def test_one_requests_bursts_are_no_evidence_of_a_loss_but_a_batchs_steady_loss_is():
    """One request: a burst of 8 tokens in 2.1 plain steps' time, then 31 steps without a match
    (1 token in 1.3: the gate's own time) — 0.92 x plain decoding over the window, within the
    scatter one burst makes: the gate keeps deciding. A batch whose every step makes 0.94–0.96 x
    plain's rate: plain decoding is played."""
    check = PayoffCheck(least_requests=1, plain_requests=1)
    for t, sec in [(8, 2.1)] + [(1, 1.3)] * 31:
        check.observe(1, True, t, sec, 1.0)
    for _ in range(6):
        check.observe(1, False, 1, 1.0, 1.0)
    band = check.bands[0]
    assert check.lead(band) < 1 and -check.confidence < check.evidence(band) < 0
    assert check.arm(1)
    steady = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4, probe=16)
    arms = []
    for i in range(40):
        drafts = steady.arm(16)
        steady.observe(16, drafts, 16 * (0.95 + 0.01 * (i % 3 - 1)) if drafts else 16, 1.0, 1.0)
        arms.append(drafts)
    assert steady.evidence(steady.bands[4]) < -steady.confidence and not any(arms[-8:])


def test_outcomes_without_time_or_requests_are_ignored():
    check = PayoffCheck(least_requests=1, plain_requests=1)
    check.observe(0, True, 0, 0.01, 0.01)
    check.observe(4, True, 4, 0.0, 0.01)
    check.observe(4, False, 4, 0.01, 0.0)
    assert all(not any(b.outcomes) for b in check.bands.values())


def test_only_the_recent_outcomes_are_kept():
    check = PayoffCheck(least_requests=1, plain_requests=1, least=1, window=4)
    for rate in (0.1, 0.1, 0.1, 0.1, 2.0, 2.0, 2.0, 2.0):  # the machine's phase moved
        check.observe(4, True, rate * 4, 1.0, 1.0)
    check.observe(4, False, 4, 1.0, 1.0)
    assert len(check.bands[2].outcomes[DRAFTING]) == 4 and check.lead(check.bands[2]) == 2.0


@settings(max_examples=200, deadline=None)
@given(st.floats(0.3, 3.0), st.floats(0.3, 3.0), st.sampled_from([1, 3, 12, 40, 200]))
def test_against_steady_arms_it_ends_on_the_better_one_paying_only_its_probes(d, p, requests):
    check = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4, probe=16, sure=64, margin=0.15)
    warmup = check.least * check.warm
    arms = play(check, requests, d, p, warmup + 320)
    later = arms[warmup:]
    if abs(d - p) > 1e-9 * max(d, p):  # (equal arms: either is the better one)
        better = d > p
        assert sum(a == better for a in later) >= len(later) * (1 - 1 / check.probe)
    # what it delivered after the warm-up, against always playing the better arm
    delivered = sum(d if a else p for a in later) / len(later)
    assert delivered >= max(d, p) * (1 - 1 / check.probe) - 1e-9


def test_a_restored_check_decides_from_its_first_step_as_the_saved_one_would():
    saved = PayoffCheck(least_requests=1, plain_requests=1)
    play(saved, 16, drafting_rate=0.8, plain_rate=1.0, steps=40)
    play(saved, 1, drafting_rate=2.0, plain_rate=1.0, steps=40)
    state = LearnedState.from_dict(json.loads(json.dumps(LearnedState({}, payoff=saved.as_dict()).as_dict())))
    again = PayoffCheck(least_requests=1, plain_requests=1)
    again.restore(state.payoff)
    assert again.leads() == saved.leads()
    assert {b: round(lead, 9) for b, lead in saved.leads().items()} == {1: 2.0, 12: 0.8}
    assert again.arm(16) == PLAIN and again.arm(1) == DRAFTING  # no warm-up: the leader from the first step


@pytest.mark.parametrize("bad", [{"4": {"drafting": [[1.0, 0.0]], "plain": []}},
                                 {"4": {"drafting": [[float("nan"), 1.0]], "plain": []}},
                                 {"x": {"drafting": [], "plain": []}}, {"4": {"plain": []}}])
def test_a_bad_saved_outcome_makes_the_learned_state_unreadable(bad):
    with pytest.raises((ValueError, KeyError)):
        LearnedState.from_dict(LearnedState({}, payoff=bad).as_dict())


def test_below_least_requests_the_gate_alone_decides_and_nothing_is_measured():
    check = PayoffCheck(least_requests=6)
    assert all(check.arm(r) for r in (1, 2, 5) for _ in range(40))
    check.observe(5, False, 5, 1.0, 1.0)
    assert not check.bands  # nothing counted, nothing kept
    assert check.arm(6) and check.bands


def test_a_step_not_measured_plays_the_leader_and_changes_nothing():
    """A step that also feeds prompts: its outcome is not measured (the profile's error on a mixed
    step is not a plain one's), so it is no probe and not counted — it plays the band's leader."""
    check = PayoffCheck(least_requests=1, plain_requests=1, least=3, warm=4, probe=16)
    assert check.arm(16, measured=False) and not check.bands  # nothing known: the gate's arm
    play(check, 16, drafting_rate=0.9, plain_rate=1.0, steps=12)
    before = check.bands[4].steps
    assert [check.arm(16, measured=False) for _ in range(40)] == [False] * 40
    assert check.bands[4].steps == before


# -- an engine of several kinds: an arm per kind beside plain decoding and the gate over all ------------


def play_arms(check: PayoffCheck, requests: int, rates: list[float], steps: int) -> list[int]:
    """`steps` steps of one band against steady arms (`rates` by arm index); the arms played."""
    played = []
    for _ in range(steps):
        a = check.arm(requests)
        check.observe(requests, a, rates[a] * requests, 1.0, 1.0)
        played.append(a)
    return played


def test_arms_of_an_engine_are_plain_drafting_and_each_kind_where_there_are_several():
    assert arms_of(("ngram",)) == ("plain", "drafting")
    assert arms_of(("block", "ngram")) == ("plain", "drafting", "kind:block", "kind:ngram")
    with pytest.raises(ValueError):
        PayoffCheck(arms=("drafting", "plain"))
    with pytest.raises(ValueError):
        PayoffCheck(arms=("plain", "drafting", "kind:a", "kind:a"))


def test_a_fresh_band_of_several_arms_probes_each_in_turn_until_all_are_known():
    check = PayoffCheck(arms=arms_of(("a", "b")), least_requests=1, plain_requests=1, least=2, least_kind=2, warm=4)
    played = play_arms(check, 16, [1.0, 1.2, 1.5, 0.9], steps=24)
    # every 4th step the next arm lacking outcomes (plain, kind:a, kind:b, in turn), else the gate's
    assert [(i + 1, a) for i, a in enumerate(played) if a != DRAFTING] == \
        [(4, PLAIN), (8, 2), (12, 3), (16, PLAIN), (20, 2), (24, 3)]
    assert check.leaders() == {12: "kind:a"}


def test_the_best_arm_ahead_of_the_gate_is_played_and_the_others_probed_in_turn():
    check = PayoffCheck(arms=arms_of(("a", "b")), least_requests=1, least=2, least_kind=2, warm=1, probe=8, sure=64,
                         margin=0.15)
    # kind:a leads the gate by 2 %, plain by less: both ahead (steady outcomes: exact evidence); kind:b
    # behind by far. With a probe every step until all are known (the gate's arm plays once no other
    # lacks), then kind:a; every 8 steps a probe: of plain (the likelier of the two to lead) every
    # other time, of plain and the gate in turn the rest; kind:b every 64.
    played = play_arms(check, 16, [1.01, 1.0, 1.02, 0.5], steps=8 + 128)
    assert played[:8] == [PLAIN, 2, 3, PLAIN, 2, 3, DRAFTING, DRAFTING]
    assert [(i + 9, a) for i, a in enumerate(played[8:]) if a != 2] == \
        [(16, PLAIN), (24, PLAIN), (32, DRAFTING), (40, PLAIN), (48, PLAIN), (56, PLAIN), (64, 3),
         (72, PLAIN), (80, PLAIN), (88, PLAIN), (96, DRAFTING), (104, PLAIN), (112, PLAIN), (120, PLAIN),
         (128, 3), (136, PLAIN)]
    assert check.leaders() == {12: "kind:a"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.3, 3.0), min_size=4, max_size=6), st.sampled_from([6, 12, 40, 200]))
def test_against_steady_arms_of_every_kind_it_ends_on_the_best_paying_only_its_probes(rates, requests):
    check = PayoffCheck(arms=arms_of([f"k{i}" for i in range(len(rates) - 2)]), least=3, warm=4, probe=16, sure=64)
    warmup = check.least * check.warm * (len(rates) - 1)
    played = play_arms(check, requests, rates, warmup + 320)
    later = played[warmup:]
    best = max(rates)
    if sorted(rates)[-2] < best * (1 - 1e-9):  # one best arm
        assert sum(rates[a] == best for a in later) >= len(later) * (1 - 1 / check.probe)
    delivered = sum(rates[a] for a in later) / len(later)
    assert delivered >= best * (1 - 1 / check.probe) - 1e-9


def test_a_saved_state_of_other_kinds_restores_the_arms_both_have():
    saved = PayoffCheck(arms=arms_of(("a", "b")), least_requests=1, plain_requests=1)
    play_arms(saved, 16, [1.0, 1.2, 1.5, 0.9], steps=60)
    one_kind = PayoffCheck(least_requests=1, plain_requests=1)
    one_kind.restore(json.loads(json.dumps(saved.as_dict())))
    assert one_kind.leads() == saved.leads() and one_kind.leaders() == {12: "drafting"}
    other = PayoffCheck(arms=arms_of(("a", "c")), least_requests=1, plain_requests=1)
    other.restore(saved.as_dict())
    assert other.leaders() == {12: None}  # kind:c never measured: learning again
    assert len(other.bands[4].outcomes[2]) == len(saved.bands[4].outcomes[2])


def test_rates_are_each_arms_tokens_over_time_once_it_has_least_outcomes():
    check = PayoffCheck(arms=arms_of(("a", "b")), least_requests=1, plain_requests=1, least=2, least_kind=2, warm=1)
    play_arms(check, 16, [1.0, 1.2, 1.5, 0.9], steps=7)  # plain, a, b twice each, then the gate's once
    assert check.rates() == {12: {"plain": 1.0, "drafting": None, "kind:a": 1.5, "kind:b": 0.9}}


def test_every_other_probe_goes_to_the_arm_most_likely_to_lead_and_none_is_left_stale():
    """Four arms within the margin of the gate's: kind:c, 1 % behind it, is the likeliest to lead
    (the highest upper bound) and takes every other probe; the rest take their turns."""
    check = PayoffCheck(arms=arms_of(("a", "b", "c")), least_requests=1, least=2, warm=1, probe=8, sure=64)
    rates = [0.95, 1.0, 0.93, 0.94, 0.99]
    played = play_arms(check, 16, rates, steps=10 + 128)
    probes = [a for a in played[10:] if a != DRAFTING]
    assert len(probes) == 16 and probes.count(4) >= 8
    assert {0, 2, 3} <= set(probes)
    assert check._judge(check.bands[4])[3] == 4


def test_an_arm_that_may_lead_is_probed_every_warm_steps_until_it_is_known_whether_it_does():
    """kind:a's outcomes scatter (0.3 and 1.2 tokens a plain step's time: 0.75 on average, a
    standard error of 0.45 — more than half of one below the gate's steady 1.0, so it does not
    lead, but its upper bound is above): probed every `warm` steps, not every `probe`. Once its
    outcomes are many and steady below the gate's, the usual schedule again."""
    check = PayoffCheck(arms=arms_of(("a", "b")), least_requests=1, least=2, warm=4, probe=16, sure=64)
    for rate, arm in [(1.0, DRAFTING)] * 8 + [(0.8, PLAIN)] * 3 + [(0.5, 3)] * 3 + [(0.3, 2), (1.2, 2)]:
        check.observe(16, arm, rate * 16, 1.0, 1.0)
    judged = check._judge(check.bands[4])
    assert judged[0] == DRAFTING and judged[3] == 2 and judged[4]  # kind:a may lead
    assert [check.arm(16) for _ in range(16)] == [DRAFTING, DRAFTING, DRAFTING, 2] * 4
    for _ in range(30):
        check.observe(16, 2, 0.9 * 16, 1.0, 1.0)
    assert not check._judge(check.bands[4])[4]
    assert [check.arm(16) for _ in range(16)].count(2) <= 1


def test_a_kinds_arm_is_judged_from_its_first_outcome_and_chased_until_its_evidence_says():
    """Plain decoding needs `least` (3) outcomes, a kind's arm `least_kind` (1): the warm-up probes
    the arms lacking outcomes in turn (plain, kind:a, plain, kind:b, plain). An arm of one outcome
    has no variance: kind:a's, 1.5 against the gate's 1.0, leads from the warm-up's end (no
    evidence against it, and played it soon has more); kind:b's, 0.5, cannot lead and is chased
    at the next `warm` step as the likeliest to (an unbounded upper bound), then behind by far
    (probed every `sure` steps)."""
    check = PayoffCheck(arms=arms_of(("a", "b")), least_requests=1, least=3, least_kind=1, warm=4, probe=16,
                        sure=64)
    played = play_arms(check, 16, [0.8, 1.0, 1.5, 0.5], steps=40)
    assert [(i + 1, a) for i, a in enumerate(played[:20]) if a != DRAFTING] == \
        [(4, PLAIN), (8, 2), (12, PLAIN), (16, 3), (20, PLAIN)]
    assert played[20:] == [2] * 3 + [3] + [2] * 16  # kind:a played; kind:b chased once
    assert check.leaders() == {12: "kind:a"}
    assert [len(o) for o in check.bands[4].outcomes][2:] == [20, 2]


def test_a_kinds_arm_level_with_the_gate_is_played_and_one_behind_by_its_evidence_is_not():
    """Between the gate over every kind and one kind alone the tie goes to the one kind (its steps
    run no chooser): kind:a level with the gate leads; kind:a whose outcomes scatter (0.5 and 1.4:
    0.95 on average, a standard error of 0.45) leads too — it trails by 0.11 of a standard error;
    kind:a at 0.3 and 1.2 (0.75, 0.45) trails by 0.56 and does not. An arm of one outcome (no
    evidence either way) leads if that outcome is no worse than the gate's rate."""
    def judged(kind_outcomes):
        check = PayoffCheck(arms=arms_of(("a", "b")), least=2, least_kind=1)
        for rate, arm in [(1.0, DRAFTING)] * 8 + [(0.8, PLAIN)] * 3 + [(0.5, 3)] * 3 + [(r, 2) for r in kind_outcomes]:
            check.observe(16, arm, rate * 16, 1.0, 1.0)
        return check._judge(check.bands[4])[0]

    assert judged([1.0, 1.0]) == 2
    assert judged([0.5, 1.4]) == 2
    assert judged([0.3, 1.2]) == DRAFTING
    assert judged([1.0]) == 2 and judged([0.99]) == DRAFTING
    assert judged([0.9, 0.9]) == DRAFTING  # steady and lower: exact evidence against it


def test_below_plain_requests_a_band_weighs_the_gate_and_the_kinds_never_plain_decoding():
    """From `least_requests` (3) the kinds' arms are measured; plain decoding's only from
    `plain_requests` (6): at three to five requests one request's stretches that do not repeat
    would be read as drafting's loss. A check of one kind has nothing to weigh below 6."""
    check = PayoffCheck(arms=arms_of(("a", "b")), least_requests=3, plain_requests=6, least_kind=2, warm=2,
                        probe=8)
    assert all(check.arm(2) == DRAFTING for _ in range(20)) and not check.bands
    played = play_arms(check, 4, [9.0, 1.0, 1.5, 0.5], steps=80)  # plain would lead by far: never played
    assert PLAIN not in played and {2, 3} <= set(played)
    assert check.leaders() == {3: "kind:a"} and played[-8:].count(2) >= 7
    assert not check.bands[2].plain and check.rates()[3]["plain"] is None
    assert play_arms(check, 6, [9.0, 1.0, 1.5, 0.5], steps=40).count(PLAIN) > 20  # from 6 it is weighed
    one = PayoffCheck()
    assert all(one.arm(r) == DRAFTING for r in (3, 4, 5) for _ in range(20)) and not one.bands
    one.observe(5, PLAIN, 5.0, 1.0, 1.0)
    assert not one.bands


def test_a_restored_band_below_plain_requests_keeps_plain_decoding_out():
    saved = PayoffCheck(arms=arms_of(("a", "b")))
    play_arms(saved, 4, [9.0, 1.0, 1.5, 0.5], steps=40)
    again = PayoffCheck(arms=arms_of(("a", "b")))
    again.restore(json.loads(json.dumps(saved.as_dict())))
    assert not again.bands[2].plain and again.leaders() == saved.leaders() == {3: "kind:a"}
