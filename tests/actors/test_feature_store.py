"""`FeatureStore` against the obvious model: a dict of position -> row per request."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.target.features import FeatureStore


def rows(start: int, n: int, rid: int = 0) -> torch.Tensor:
    """Row of position p holds (rid, 7, p): every value says where it came from."""
    base = torch.arange(start, start + n, dtype=torch.float32)[:, None]
    return torch.cat([base * 0 + rid, base * 0 + 7, base], dim=1).half()


def test_a_forward_replaces_what_it_overlaps_and_take_drops_what_it_returns():
    fs = FeatureStore()
    fs.write(7, 0, rows(0, 5))  # prefill of 5
    fs.write(7, 5, rows(5, 4))  # a step: last token + 3 drafts
    fs.write(7, 6, rows(6, 2))  # 1 of 3 accepted: rolled back to 6 and the next step starts there
    assert fs.held(7) == (0, 8)
    got = fs.take({7: (0, 7)})[7]
    np.testing.assert_array_equal(got[:, 2], np.arange(7))
    assert got.dtype == np.float16 and got.shape == (7, 3) and (got[:, 1] == 7).all()
    assert fs.held(7) == (7, 8) and fs.rows == 1


def test_a_request_s_rows_are_a_slice_of_the_step_block():
    fs = FeatureStore()
    block = torch.cat([rows(10, 2, rid=1), rows(4, 3, rid=2)])  # one step: two requests side by side
    fs.write(1, 10, block, 0, 2)
    fs.write(2, 4, block, 2, 3)
    got = fs.take({1: (10, 12), 2: (5, 7)})
    np.testing.assert_array_equal(got[1][:, 2], [10, 11])
    np.testing.assert_array_equal(got[2][:, 2], [5, 6])
    assert (got[2][:, 0] == 2).all()


def test_a_span_not_held_is_refused_and_an_empty_span_is_empty():
    fs = FeatureStore()
    fs.write(1, 0, rows(0, 4))
    fs.take({1: (0, 2)})
    with pytest.raises(LookupError):
        fs.take({1: (1, 3)})  # position 1 was taken already
    with pytest.raises(LookupError):
        fs.take({2: (0, 1)})  # never written
    assert fs.take({1: (3, 3)}) == {1: None}


def test_skipped_positions_forget_the_old_rows():
    fs = FeatureStore()
    fs.write(1, 0, rows(0, 4))
    fs.write(1, 6, rows(6, 2))
    assert fs.held(1) == (6, 8)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "take", "release"]), st.integers(0, 2),
                          st.integers(0, 5), st.integers(0, 6)), max_size=40))
def test_matches_a_position_dict(ops):
    fs, ref = FeatureStore(), {}
    for op, rid, a, b in ops:
        held = ref.setdefault(rid, {})
        if op == "write":
            # The engine writes where the KV cache is: at or before the end of what is held.
            end = max(held, default=-1) + 1
            start = min(a, end) if held else a
            if held and start < min(held):  # never before what was taken already
                start = min(held)
            fs.write(rid, start, rows(start, b, rid))
            for p in [p for p in held if p >= start]:
                del held[p]
            held.update({p: (rid, p) for p in range(start, start + b)})
        elif op == "take":
            start, end = a, a + b
            if all(p in held for p in range(start, end)):
                got = fs.take({rid: (start, end)})[rid]
                if end > start:
                    np.testing.assert_array_equal(got[:, 2], np.arange(start, end))
                    assert (got[:, 0] == rid).all()
                for p in [p for p in held if p < end]:
                    del held[p]
            else:
                with pytest.raises(LookupError):
                    fs.take({rid: (start, end)})
        else:
            fs.release([rid])
            held.clear()
        span = (min(held), max(held) + 1) if held else None
        assert fs.held(rid) == span
        assert span is None or len(held) == span[1] - span[0]
    assert fs.rows == sum(map(len, ref.values()))
