"""The payoff check (dcut_core/payoff.py): plain decoding measured beside the gate's steps, band
by band, and played where it delivers more. Exact small cases, then a property: against any two
steady arms it ends on the better one, paying at most its probes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core.payoff import PayoffCheck


def play(check: PayoffCheck, requests: int, drafting_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """`steps` steps of one band against steady arms (tokens a second of each, a plain step
    predicted at 1 s); the arms played, in order."""
    arms = []
    for _ in range(steps):
        drafts = check.drafts(requests)
        rate = drafting_rate if drafts else plain_rate
        check.observe(requests, drafts, rate * requests, 1.0, 1.0)
        arms.append(drafts)
    return arms


def test_bands_are_powers_of_two_of_the_requests():
    assert [PayoffCheck.band_of(r) for r in (0, 1, 2, 3, 4, 7, 8, 15, 16, 63, 64, 1024)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 10]


def test_a_fresh_band_drafts_and_probes_plain_decoding_every_warm_steps_until_both_arms_are_known():
    check = PayoffCheck(least=3, warm=4)
    arms = play(check, 8, drafting_rate=2.0, plain_rate=1.0, steps=12)
    assert arms == [True, True, True, False] * 3
    assert check.lead(check.bands[3]) == 2.0


def test_a_band_where_drafting_loses_decodes_plainly_and_probes_drafting():
    check = PayoffCheck(least=3, warm=4, probe=16, sure=64, margin=0.15)
    arms = play(check, 16, drafting_rate=0.95, plain_rate=1.0, steps=12 + 64)
    later = arms[12:]  # band steps 13 .. 76: drafting only on the steps divisible by `probe`
    assert [i + 13 for i, a in enumerate(later) if a] == [16, 32, 48, 64]
    far = PayoffCheck(least=3, warm=4, probe=16, sure=64, margin=0.15)
    arms = play(far, 16, drafting_rate=0.5, plain_rate=1.0, steps=12 + 64)
    assert [i + 13 for i, a in enumerate(arms[12:]) if a] == [64]  # a lead past the margin: every `sure` steps


def test_a_band_where_drafting_pays_drafts_and_probes_plain_decoding():
    check = PayoffCheck(least=3, warm=4, probe=16, sure=64, margin=0.15)
    arms = play(check, 1, drafting_rate=1.1, plain_rate=1.0, steps=12 + 64)
    assert [i + 13 for i, a in enumerate(arms[12:]) if not a] == [16, 32, 48, 64]


def test_bands_are_measured_apart():
    check = PayoffCheck(least=2, warm=2)
    play(check, 1, drafting_rate=3.0, plain_rate=1.0, steps=8)
    play(check, 40, drafting_rate=0.5, plain_rate=1.0, steps=8)
    assert check.leads() == {1: 3.0, 32: 0.5}


def test_outcomes_are_scaled_by_the_plain_steps_prediction():
    """Two steps of one band at different request counts and contexts compare by tokens a second
    over what a plain step of their shape is predicted to make."""
    check = PayoffCheck(least=1)
    check.observe(16, False, 16, 0.010, 0.010)  # a plain step as predicted
    check.observe(20, True, 30, 0.015, 0.0125)  # 1.5 tokens a request in 1.2 x a plain step's time
    assert abs(check.lead(check.bands[4]) - 1.25) < 1e-12


def test_an_arms_rate_is_its_tokens_over_its_time_not_its_typical_step():
    """At one request drafting accepts nothing in most steps and runs long in a few: three steps
    of 1 token and one of 8, each 1.2 x a plain step's time, make 11 tokens in 4.8 plain steps'
    time (2.3 x plain decoding), though the median step makes 0.83 x."""
    check = PayoffCheck(least=1)
    for tokens in (1, 1, 8, 1):
        check.observe(1, True, tokens, 0.012, 0.010)
    check.observe(1, False, 1, 0.010, 0.010)
    assert abs(check.lead(check.bands[0]) - 11 / 4.8) < 1e-12


def test_outcomes_without_time_or_requests_are_ignored():
    check = PayoffCheck()
    check.observe(0, True, 0, 0.01, 0.01)
    check.observe(4, True, 4, 0.0, 0.01)
    check.observe(4, False, 4, 0.01, 0.0)
    assert all(not b.drafting and not b.plain for b in check.bands.values())


def test_only_the_recent_outcomes_are_kept():
    check = PayoffCheck(least=1, window=4)
    for rate in (0.1, 0.1, 0.1, 0.1, 2.0, 2.0, 2.0, 2.0):  # the machine's phase moved
        check.observe(4, True, rate * 4, 1.0, 1.0)
    check.observe(4, False, 4, 1.0, 1.0)
    assert len(check.bands[2].drafting) == 4 and check.lead(check.bands[2]) == 2.0


@settings(max_examples=200, deadline=None)
@given(st.floats(0.3, 3.0), st.floats(0.3, 3.0), st.sampled_from([1, 3, 12, 40, 200]))
def test_against_steady_arms_it_ends_on_the_better_one_paying_only_its_probes(d, p, requests):
    check = PayoffCheck(least=3, warm=4, probe=16, sure=64, margin=0.15)
    warmup = check.least * check.warm
    arms = play(check, requests, d, p, warmup + 320)
    later = arms[warmup:]
    if abs(d - p) > 1e-9 * max(d, p):  # (equal arms: either is the better one)
        better = d > p
        assert sum(a == better for a in later) >= len(later) * (1 - 1 / check.probe)
    # what it delivered after the warm-up, against always playing the better arm
    delivered = sum(d if a else p for a in later) / len(later)
    assert delivered >= max(d, p) * (1 - 1 / check.probe) - 1e-9
