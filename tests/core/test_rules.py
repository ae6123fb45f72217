"""Acceptance rules: exact greedy cases and distribution tests of speculative sampling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from dcut_core import ragged
from dcut_core.rules import Accepted, coupled_sampling, greedy, greedy_in_turn, inverse_cdf, speculative, target_offsets


def speculative_rng(draft_tokens, cu_kept, draft_probs, target_probs, rng: np.random.Generator) -> Accepted:
    """`speculative` with uniforms drawn from one generator (the statistical tests below)."""
    u_accept = rng.random(len(draft_tokens))
    u_sample = rng.random(len(cu_kept) - 1)
    return speculative(draft_tokens, cu_kept, draft_probs, target_probs, u_accept, u_sample)

def test_greedy_exact_cases():
    # r0: drafts 5 6 7, target 5 6 7 9 -> all accepted, bonus 9.
    # r1: drafts 1 2, target 1 3 4 -> 1 accepted, recovered 3.
    # r2: no kept drafts, target 8 -> plain decode.
    # r3: drafts 4, target 2 4 -> nothing accepted, recovered 2 (a later match does not count).
    drafts = np.array([5, 6, 7, 1, 2, 4])
    cu = ragged.offsets_from_lengths([3, 2, 0, 1])
    target = np.array([5, 6, 7, 9, 1, 3, 4, 8, 2, 4])
    out = greedy(drafts, cu, target)
    assert out.accepted.tolist() == [3, 1, 0, 0]
    assert out.cu_tokens.tolist() == [0, 4, 6, 7, 8]
    assert out.tokens.tolist() == [5, 6, 7, 9, 1, 3, 8, 2]


def test_greedy_rejects_a_bad_layout():
    with pytest.raises(ValueError, match="target rows"):
        greedy(np.array([1, 2]), np.array([0, 2]), np.array([1, 2]))


def test_greedy_property_random():
    rng = np.random.default_rng(0)
    for _ in range(100):
        lengths = rng.integers(0, 6, rng.integers(1, 6))
        cu = ragged.offsets_from_lengths(lengths)
        target = rng.integers(0, 3, int(target_offsets(cu)[-1]))
        drafts = rng.integers(0, 3, int(cu[-1]))
        out = greedy(drafts, cu, target)
        cu_t = target_offsets(cu)
        for i, k in enumerate(lengths):
            d, t = drafts[cu[i]:cu[i + 1]], target[cu_t[i]:cu_t[i + 1]]
            a = next((j for j in range(k) if d[j] != t[j]), k)
            assert out.accepted[i] == a
            assert out.tokens[out.cu_tokens[i]:out.cu_tokens[i + 1]].tolist() == t[: a + 1].tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=8), st.integers(0, 2 ** 31))
def test_greedy_on_lists_accepts_and_emits_as_the_array_rule(rows, seed):
    """Requests of `drafted` drafts, the first `kept` verified (target rows over a 3-token
    vocabulary: matches, mismatches and late matches)."""
    rng = np.random.default_rng(seed)
    drafted = [d for d, _ in rows]
    kept = [min(k, d) for d, k in rows]
    cu_d = ragged.offsets_from_lengths(drafted)
    tokens = rng.integers(0, 3, int(cu_d[-1]))
    cu_k = ragged.offsets_from_lengths(kept)
    target = rng.integers(0, 3, int(cu_k[-1]) + len(kept))
    flat = np.concatenate([tokens[cu_d[i]:cu_d[i] + k] for i, k in enumerate(kept)]) if kept else np.zeros(0, int)
    want = greedy(flat.astype(np.int64), cu_k, target)
    accepted, emitted = greedy_in_turn(tokens.tolist(), cu_d[:-1].tolist(), kept, target.tolist())
    assert accepted == want.accepted.tolist()
    assert emitted == [want.tokens[want.cu_tokens[i]:want.cu_tokens[i + 1]].tolist() for i in range(len(kept))]
    with pytest.raises(ValueError, match="target rows"):
        greedy_in_turn(tokens.tolist(), cu_d[:-1].tolist(), kept, [*target.tolist(), 0])

def test_leading_true_against_a_loop():
    rng = np.random.default_rng(1)
    for _ in range(300):
        lengths = rng.integers(0, 5, rng.integers(0, 7))
        cu = ragged.offsets_from_lengths(lengths)
        mask = rng.random(int(cu[-1])) < rng.random()
        want = [next((j for j in range(k) if not mask[cu[i] + j]), k) for i, k in enumerate(lengths.tolist())]
        got = ragged.leading_true(mask, cu)
        assert got.tolist() == want and got.dtype == np.int64


def random_dist(rng, v, sharp=1.0):
    p = rng.dirichlet(np.full(v, sharp))
    return p


def test_speculative_identical_distributions_accept_everything():
    rng = np.random.default_rng(0)
    p = random_dist(rng, 5)
    drafts = np.array([1, 3])
    cu = np.array([0, 2])
    out = speculative(drafts, cu, np.stack([p, p]), np.stack([p, p, p]), np.array([0.999, 0.999]), np.array([0.5]))
    assert out.accepted.tolist() == [2]
    assert out.tokens[:2].tolist() == [1, 3]


def test_speculative_one_hot_draft_with_zero_target_probability_is_replaced():
    p = np.array([0.0, 0.5, 0.5])
    out = speculative(np.array([0]), np.array([0, 1]), None, np.stack([p, p]), np.array([0.0]), np.array([0.1]))
    assert out.accepted.tolist() == [0] and out.tokens.tolist() == [1]


V = 6
N_TRIALS = 60000


@pytest.mark.parametrize("one_hot", [False, True])
def test_single_token_distribution_equals_the_target(one_hot):
    rng = np.random.default_rng(42)
    p, q = random_dist(rng, V), random_dist(rng, V, sharp=0.5)
    drafts = rng.choice(V, size=N_TRIALS, p=q)  # one draft per request, all in one batch
    cu = np.arange(N_TRIALS + 1)
    target = np.tile(p, (2 * N_TRIALS, 1))
    out = speculative_rng(drafts, cu, None if one_hot else np.tile(q, (N_TRIALS, 1)), target, rng)
    first = out.tokens[out.cu_tokens[:-1]]
    counts = np.bincount(first, minlength=V)
    assert chisquare(counts, p * N_TRIALS).pvalue > 1e-3
    # Sanity: the test can fail; the draft distribution itself is rejected.
    assert chisquare(np.bincount(drafts, minlength=V), p * N_TRIALS).pvalue < 1e-6


def test_two_token_joint_distribution_equals_the_target():
    rng = np.random.default_rng(7)
    v = 4
    p0, q0 = random_dist(rng, v), random_dist(rng, v)
    p1 = np.stack([random_dist(rng, v) for _ in range(v)])  # p(second | first)
    q1 = np.stack([random_dist(rng, v) for _ in range(v)])
    n = N_TRIALS
    x0 = np.array([rng.choice(v, p=q0) for _ in range(n)])
    x1 = np.array([rng.choice(v, p=q1[a]) for a in x0])
    drafts = np.stack([x0, x1], axis=1).reshape(-1)
    cu = np.arange(0, 2 * n + 1, 2)
    dprobs = np.stack([np.tile(q0, (n, 1)), q1[x0]], axis=1).reshape(-1, v)
    tprobs = np.stack([np.tile(p0, (n, 1)), p1[x0], np.full((n, v), 1.0 / v)], axis=1).reshape(-1, v)
    out = speculative_rng(drafts, cu, dprobs, tprobs, rng)
    first = out.tokens[out.cu_tokens[:-1]]
    second = np.where(out.accepted >= 1, out.tokens[np.minimum(out.cu_tokens[:-1] + 1, len(out.tokens) - 1)], -1)
    # Requests that emitted one token continue autoregressively from the target.
    for i in np.nonzero(second < 0)[0]:
        second[i] = rng.choice(v, p=p1[first[i]])
    joint = np.bincount(first * v + second, minlength=v * v)
    expected = (p0[:, None] * p1).reshape(-1) * n
    assert chisquare(joint, expected).pvalue > 1e-3
    assert 0 < out.accepted.mean() < 2  # both outcomes happen


def test_speculative_layout_errors():
    with pytest.raises(ValueError):
        speculative(np.array([1]), np.array([0, 1]), None, np.ones((1, 3)) / 3, np.array([0.1]), np.array([0.2]))


def test_inverse_cdf_exact():
    probs = np.array([[0.0, 0.5, 0.5], [0.2, 0.0, 0.8]])
    assert inverse_cdf(probs, np.array([0.0, 0.0])).tolist() == [1, 0]
    assert inverse_cdf(probs, np.array([0.49, 0.2])).tolist() == [1, 2]  # 0.2 is past token 0's mass
    assert inverse_cdf(probs, np.array([0.999, 0.999])).tolist() == [2, 2]


def test_coupled_sampling_reproduces_the_target_and_ignores_the_drafts():
    rng = np.random.default_rng(3)
    p = random_dist(rng, V)
    n = N_TRIALS
    u = rng.random(n)
    target = np.tile(p, (2 * n, 1))
    u_rows = np.stack([u, rng.random(n)], axis=1).reshape(-1)  # one uniform per row
    with_drafts = coupled_sampling(rng.integers(0, V, n), np.arange(n + 1), target, u_rows)
    without = coupled_sampling(np.zeros(0, dtype=np.int64), np.zeros(n + 1, dtype=np.int64), p[None].repeat(n, 0), u)
    first = with_drafts.tokens[with_drafts.cu_tokens[:-1]]
    assert (first == without.tokens).all()  # same uniforms: same tokens, drafts or not
    assert chisquare(np.bincount(first, minlength=V), p * n).pvalue > 1e-3
    accept_rate = with_drafts.accepted.mean()
    assert accept_rate == pytest.approx(float((p * (1 / V)).sum()), abs=0.01)  # P(x == y) for uniform x
