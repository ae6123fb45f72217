"""Where the EP group places each request's KV cache (`RequestRanks`, actors/target/group.py):
the least loaded rank, kept as counts, against the count over every held request it replaced."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.target.group import RequestRanks


@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 5), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=120))
def test_requests_go_to_the_least_loaded_rank_as_a_count_over_every_held_request_would_place_them(world, ops):
    ranks, reference = RequestRanks(world), {}
    for place, rid in ops:
        if place:
            if rid not in reference:  # the old placement: every held request counted again
                load = [0] * world
                for r in reference.values():
                    load[r] += 1
                reference[rid] = int(np.argmin(load))
            assert ranks.rank_of(rid) == reference[rid]
        else:
            assert ranks.drop(rid) == reference.pop(rid, None)
        assert len(ranks) == len(reference) and all(ranks[r] == w and r in ranks for r, w in reference.items())
        assert ranks.load == [list(reference.values()).count(r) for r in range(world)]


def test_a_wave_spreads_evenly_and_a_freed_rank_takes_the_next_request():
    ranks = RequestRanks(3)
    assert [ranks.rank_of(rid) for rid in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert ranks.rank_of(4) == 1  # placed once, kept
    assert ranks.drop(1) == 1 and ranks.drop(4) == 1 and ranks.drop(99) is None
    assert ranks.rank_of(10) == 1 and ranks.load == [3, 1, 2]
    assert ranks.place([10, 11, 0, 12]) == [11, 12] and ranks[11] == ranks[12] == 1 and ranks.load == [3, 3, 2]
