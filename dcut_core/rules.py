"""Lossless acceptance rules on numpy arrays.

Layout: request i sent k_i kept drafts; the target returned k_i + 1 rows for it — its
prediction after the last committed token and after each kept draft. So drafts are ragged by
`cu_kept` ([R + 1]) and target rows by `cu_kept + arange(R + 1)`.

Per request the rule emits the accepted drafts plus exactly one token from the target:
- bonus token: every kept draft was accepted, the target's own next token is appended;
- recovered token: draft a_i was rejected, a replacement is drawn in its place.
Either way at least one token is committed per step, and the output is distributed exactly as
the target alone would produce it (greedy: identical tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcut_core import ragged


@dataclass(frozen=True)
class Accepted:
    """Outcome of one verification step."""

    accepted: np.ndarray  # [R] drafts accepted per request
    tokens: np.ndarray  # [Σ (accepted_i + 1)] emitted tokens, flat
    cu_tokens: np.ndarray  # [R + 1]


def target_offsets(cu_kept: np.ndarray) -> np.ndarray:
    """Offsets of the target's rows [R + 1] for drafts ragged by cu_kept."""
    return cu_kept + np.arange(len(cu_kept))


def _draft_rows(cu_kept: np.ndarray) -> np.ndarray:
    """Target row of every draft [N]: draft j of request i is judged by row cu_t[i] + j."""
    return np.arange(int(cu_kept[-1])) + ragged.segment_ids(cu_kept)


def greedy(draft_tokens: np.ndarray, cu_kept: np.ndarray, target_tokens: np.ndarray) -> Accepted:
    """Longest prefix of drafts equal to the target's argmax tokens, then the target's token.

    draft_tokens: [N]; target_tokens: [N + R] argmax of the target's rows.
    """
    ragged.check_offsets(cu_kept, len(draft_tokens))
    cu_t = target_offsets(cu_kept)
    if len(target_tokens) != cu_t[-1]:
        raise ValueError(f"expected {cu_t[-1]} target rows, got {len(target_tokens)}")
    match = draft_tokens == target_tokens[_draft_rows(cu_kept)]  # [N]
    accepted = ragged.leading_true(match, cu_kept)
    # Accepted drafts equal the target's tokens, so the output is target rows 0..a_i of each.
    cu_out = np.zeros(len(accepted) + 1, dtype=np.int64)
    (accepted + 1).cumsum(out=cu_out[1:])
    rows = np.repeat(cu_t[:-1] - cu_out[:-1], accepted + 1) + np.arange(cu_out[-1])
    return Accepted(accepted, target_tokens[rows], cu_out)


def greedy_in_turn(draft_tokens: list[int], starts: list[int], kept: list[int],
                   target_tokens: list[int]) -> tuple[list[int], list[list[int]]]:
    """`greedy` in plain Python for a few requests (per-call numpy had cost more than the rule
    at one request): request i's kept drafts are draft_tokens[starts[i] : starts[i] + kept[i]],
    its target rows the next kept[i] + 1 of `target_tokens` (in request order). Returns each
    request's accepted count and emitted tokens."""
    if len(target_tokens) != sum(kept) + len(kept):
        raise ValueError(f"expected {sum(kept) + len(kept)} target rows, got {len(target_tokens)}")
    accepted, emitted, row = [], [], 0
    for s, k in zip(starts, kept, strict=True):
        a = 0
        while a < k and draft_tokens[s + a] == target_tokens[row + a]:
            a += 1
        accepted.append(a)
        emitted.append(target_tokens[row:row + a + 1])
        row += k + 1
    return accepted, emitted


def speculative(
    draft_tokens: np.ndarray,
    cu_kept: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    u_accept: np.ndarray,
    u_sample: np.ndarray,
) -> Accepted:
    """Speculative sampling (Leviathan et al. / Chen et al.) with explicit uniforms.

    draft_tokens: [N]; draft_probs: [N, V] the distribution each draft was sampled from, or
    None for deterministic drafts (one-hot q); target_probs: [N + R, V];
    u_accept: [N] and u_sample: [R] uniforms in [0, 1), drawn by the caller (per-request seeds).
    Draft x at a row with target p and draft q is accepted when u < p(x) / q(x); on rejection
    the replacement is drawn from norm(max(0, p − q)); after the last kept draft, from p.
    """
    ragged.check_offsets(cu_kept, len(draft_tokens))
    r = len(cu_kept) - 1
    cu_t = target_offsets(cu_kept)
    if target_probs.shape[0] != cu_t[-1] or len(u_accept) != len(draft_tokens) or len(u_sample) != r:
        raise ValueError("target_probs, u_accept or u_sample do not match the drafts' layout")
    n = len(draft_tokens)
    rows = _draft_rows(cu_kept)
    p_x = target_probs[rows, draft_tokens]  # [N]
    q_x = np.ones(n) if draft_probs is None else draft_probs[np.arange(n), draft_tokens]
    accepted = ragged.leading_true(u_accept * q_x < p_x, cu_kept)

    final_rows = cu_t[:-1] + accepted  # [R] row that yields the bonus or recovered token
    dist = target_probs[final_rows].astype(np.float64, copy=True)  # [R, V]
    rejected = np.nonzero(accepted < ragged.lengths(cu_kept))[0]
    if len(rejected):
        draft_at = cu_kept[rejected] + accepted[rejected]  # flat index of the rejected draft
        if draft_probs is None:
            dist[rejected, draft_tokens[draft_at]] = 0.0
        else:
            dist[rejected] = np.maximum(dist[rejected] - draft_probs[draft_at], 0.0)
    mass = dist.sum(axis=1, keepdims=True)  # [R, 1]
    # A rejection implies p(x) < q(x), so some other token has p > q and the residual has mass;
    # only rounding can empty it, and then the target's row is the exact answer.
    empty = mass[:, 0] <= 1e-12
    dist[empty] = target_probs[final_rows[empty]]
    mass[empty] = dist[empty].sum(axis=1, keepdims=True)
    cdf = np.cumsum(dist, axis=1)  # [R, V], last column = mass
    sampled = np.minimum((cdf <= u_sample[:, None] * mass).sum(axis=1), dist.shape[1] - 1)

    keep_draft = ragged.positions(cu_kept) < np.repeat(accepted, ragged.lengths(cu_kept))
    cu_out = ragged.offsets_from_lengths(accepted + 1)
    out = np.empty(int(cu_out[-1]), dtype=draft_tokens.dtype if n else np.int64)
    last = cu_out[1:] - 1
    body = np.ones(len(out), dtype=bool)
    body[last] = False
    out[body] = draft_tokens[keep_draft]
    out[last] = sampled
    return Accepted(accepted, out, cu_out)


def inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Token drawn from each row of probs [M, V] with its uniform u [M]: the smallest token whose
    cumulative probability exceeds u · (row mass). Zero-probability tokens are never drawn."""
    cdf = np.cumsum(probs, axis=1)
    return np.minimum((cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1), probs.shape[1] - 1)


def coupled_sampling(draft_tokens: np.ndarray, cu_kept: np.ndarray, target_probs: np.ndarray,
                     u_rows: np.ndarray) -> Accepted:
    """Lossless sampling verification by coupling: the target's own sample at every row is fixed
    by that row's uniform (`inverse_cdf`), and drafts are accepted while they equal it.

    Each output token is exactly the target's sample, so the output distribution is the target's;
    a deterministic draft x is accepted with probability p(x), the same as speculative sampling
    with one-hot drafts. Because a position's uniform depends only on the position (the caller
    keeps one stream per request), a seeded request gives the same tokens whatever was drafted,
    kept or batched with it.
    """
    return greedy(draft_tokens, cu_kept, inverse_cdf(target_probs, u_rows))
