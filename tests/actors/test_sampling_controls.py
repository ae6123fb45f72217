"""Sampling controls applied to the target's logits, against a naive per-row reference."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.target.sampling import Controls, RequestControls, apply_controls, target_probs

V = 12


def naive(logits: np.ndarray, seen: list[int], prompt_len: int, c: Controls) -> np.ndarray:
    """One row, plainly: `seen` is every token before the one this row draws."""
    x = logits.astype(np.float64).copy()
    for i, b in c.logit_bias:
        x[i] += b
    output = seen[prompt_len:]
    if len(output) < c.min_tokens:
        for t in c.banned:
            x[t] = -np.inf
    for t in set(seen):
        if c.repetition_penalty != 1.0:
            x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
    for t in set(output):
        x[t] -= c.frequency_penalty * output.count(t) + c.presence_penalty
    return x


controls = st.builds(
    Controls, presence_penalty=st.sampled_from([0.0, 0.7, -0.5]), frequency_penalty=st.sampled_from([0.0, 1.3]),
    repetition_penalty=st.sampled_from([1.0, 1.5, 0.8]),
    logit_bias=st.lists(st.tuples(st.integers(0, V - 1), st.floats(-5, 5)), max_size=3,
                        unique_by=lambda t: t[0]).map(tuple),
    min_tokens=st.integers(0, 6), banned=st.sampled_from([(), (0,), (0, 3)]))


@settings(max_examples=200, deadline=None)
@given(c=controls, history=st.lists(st.integers(0, V - 1), min_size=1, max_size=10),
       chunk=st.lists(st.integers(0, V - 1), min_size=1, max_size=6), prompt_len=st.integers(1, 12),
       data=st.data())
def test_apply_controls_equals_a_naive_row_by_row_reference(c, history, chunk, prompt_len, data):
    prompt_len = min(prompt_len, len(history) + len(chunk))
    rows = np.array(sorted(data.draw(st.sets(st.integers(0, len(chunk) - 1), min_size=1))))
    logits = torch.from_numpy(np.random.default_rng(len(history)).normal(size=(len(rows), V)).astype(np.float32))
    got = apply_controls(logits, np.array(chunk), rows, RequestControls(c, np.array(history), prompt_len)).numpy()
    tokens = history + chunk
    for j, r in enumerate(rows):
        want = naive(logits[j].numpy(), tokens[:len(history) + r + 1], prompt_len, c)
        np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)


def test_top_k_and_min_p_keep_what_they_say_and_renormalise():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.25, 0.15, 0.1]]))
    one = torch.ones(2)
    p = target_probs(logits, one, one, top_k=torch.tensor([2, 0]), min_p=torch.tensor([0.0, 0.3]))
    np.testing.assert_allclose(p[0].numpy(), [0.4 / 0.7, 0.3 / 0.7, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(p[1].numpy(), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], rtol=1e-6)  # 0.1 < 0.15
