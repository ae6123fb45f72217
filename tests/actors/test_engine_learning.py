"""What a committed step teaches (`actors/engine/learning.py`): a few requests' entries walked in
plain Python equal the array code's."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import learning
from actors.engine.stages import Accepted, Drafts, Pruned
from dcut_core import ragged


def random_step(rng: np.random.Generator, lengths: list[int], estimates: bool) -> SimpleNamespace:
    """The parts of a `Step` that `learning.drafted` reads: drafts of several kinds, some
    requests with none, kept ≤ drafted and accepted ≤ kept, calibrated estimates or none."""
    cu = ragged.offsets_from_lengths(lengths)
    n = int(cu[-1])
    drafts = Drafts(rng.integers(0, 100, n), cu, rng.random(n), rng.random(n), rng.integers(0, 3, len(lengths)))
    kept = np.array([rng.integers(0, m + 1) for m in lengths], dtype=np.int64)
    accepted = [int(rng.integers(0, k + 1)) for k in kept]
    pruned = Pruned(kept, rng.random(n) if estimates else None)
    return SimpleNamespace(drafts=drafts, pruned=pruned, accepted=Accepted(accepted, [[0]] * len(lengths)),
                           rids=rng.permutation(1000)[:len(lengths)].astype(np.int64))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=24), st.booleans(), st.integers(0, 2**31 - 1))
def test_a_steps_verifications_in_turn_equal_the_array_codes(lengths, estimates, seed):
    step = random_step(np.random.default_rng(seed), lengths, estimates)
    with mock.patch.object(learning, "IN_TURN_REQUESTS", 0):
        whole = learning.drafted(step)
    in_turn = learning._drafted_in_turn(step)
    for field in ("rids", "kinds", "kept", "accepted", "beyond", "beyond_cu"):
        a, b = getattr(in_turn, field), getattr(whole, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    assert len(in_turn) == int((np.asarray(lengths) > 0).sum())
