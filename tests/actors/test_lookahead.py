"""The coordinator's n-gram look-ahead (actors/engine/lookahead.py) on hand-made steps."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import lookahead
from actors.engine.lookahead import Lookahead, NgramLookahead
from actors.engine.sequence import SamplingParams, Sequence
from dcut_core import ragged
from dcut_core.gate import LOOKAHEAD_REQUESTS, Plan


def seq(rid: int, prompt: list[int], output: list[int]) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=32), output=output)


def test_the_look_ahead_peeks_drafts_for_every_request_and_drafts_for_those_it_is_given():
    la = NgramLookahead(kind=1, block=6)
    batch = [seq(0, [1, 2, 3, 1, 2], [3]), seq(1, [5, 6, 7], [8]), seq(2, [4, 4, 4], [4])]
    look = la.look(batch, np.array([5, 5, 2]))
    # "1 2 3" occurred before, followed by "1 2 3" to the history's end, copied on; nothing; "4 4 4"
    # by "4", copied on
    assert look.counts.tolist() == [5, 0, 2]
    assert look.tokens.tolist() == [1, 2, 3, 1, 2, 4, 4]
    assert look.available(2).tolist() == [[-1, 5], [-1, 0], [-1, 2]]
    plan = Plan(np.array([1, 0, 1]), np.array([2, 3, 0]), np.full(3, -1))
    idx, out = la.draft(batch, plan)
    assert idx == [0] and out.tokens.tolist() == [1, 2] and out.kinds.tolist() == [1]
    assert len(out.confidence) == 2 and out.kind_s[1] >= 0.0


def test_what_the_look_ahead_would_have_had_accepted_is_judged_by_what_each_request_emitted():
    la = NgramLookahead(kind=1, block=6)
    batch = [seq(0, [1, 2, 3, 1, 2], [3]), seq(1, [9, 8, 9, 8], [9]), seq(2, [4, 4, 4], [4])]
    look = la.look(batch, np.array([5, 5, 5]))  # drafts: [1 2 3], [8 9], [4]
    drafted = np.array([0, 3, 0])  # request 1 drafted with kind 1 itself: nothing to judge in hindsight
    kinds = np.array([0, 1, 0])
    idx, judged, accepted = look.hindsight(drafted, kinds, [[1, 2, 7], [8, 9, 8, 9], [4]])
    assert idx.tolist() == [0, 2] and judged.tolist() == [3, 1] and accepted.tolist() == [2, 1]
    # later steps follow the sequences' new tokens, with no commit call
    batch[0].output += [1, 2, 7]
    assert la.look(batch[:1], np.array([5])).counts.tolist() == [0]  # "2 7" never occurred before
    la.release([0, 1, 2])
    assert la.held() == 0


def test_finished_outputs_join_the_corpus_after_a_step_of_few_requests_and_are_dropped_after_a_large_one():
    la = NgramLookahead(kind=0, block=6, corpus_tokens=1000)
    batch = [seq(0, [1, 2], [3, 4, 5]), seq(1, [6, 7], [8, 9, 10])]
    la.look(batch, np.array([5, 5]))
    la.release([0])
    la.absorb(LOOKAHEAD_REQUESTS + 1)  # a step too large for the look-ahead: its outputs are dropped
    assert len(la.drafter.corpus) == 0
    la.release([1])
    la.absorb(2)
    assert la.drafter.corpus.follow([0, 6, 7], 3) == (2, [8, 9, 10])
    # A new request whose own text repeats nothing drafts from it.
    assert la.look([seq(2, [5, 6, 7], [])], np.array([5])).tokens.tolist() == [8, 9, 10]
    la.forget_outputs()
    assert len(la.drafter.corpus) == 0


def test_prompt_chunks_indexed_as_they_are_fed_make_the_history_one_follow_makes():
    """`ingest` takes a prompt in chunk by chunk (as a step's prefill feeds it); what the first
    decode step then follows — the last chunk, the first token — completes the same history a
    whole-prompt `follow` builds: its tokens, its index (equal drafts and confidences), and which
    part of it is output (only that joins the corpus)."""
    from actors.engine.stages import Feed

    prompt = [7, 1, 2, 3, 9, 1, 2, 3, 5, 1, 2, 3, 6, 4, 1, 2]
    chunked, whole = NgramLookahead(kind=0, block=6, corpus_tokens=1000), NgramLookahead(kind=0, block=6)
    s = seq(0, prompt, [])
    for start in (0, 5, 10):  # three chunks fed, the last (10 ..) in the step whose prefill ends
        chunked.ingest([Feed(s, start, prompt[start:start + 5])])
        chunked.ingest([Feed(s, start, prompt[start:start + 5])])  # fed again (a rebuild): changes nothing
    assert chunked.drafter._history[0].tokens == prompt[:15]
    s.output = [3]
    chunked.ingest([Feed(s, 15, prompt[15:])])  # learnt after the first decode step followed it: nothing
    for la in (chunked, whole):
        la.look([s], np.array([5]))
    a, b = chunked.drafter._history[0], whole.drafter._history[0]
    assert a.tokens == b.tokens == [*prompt, 3] and a.first == b.first == len(prompt)
    assert a.chains == b.chains and a.last == b.last
    plan = Plan(np.array([0]), np.array([5]), np.full(1, -1))
    (_, x), (_, y) = chunked.draft([s], plan), whole.draft([s], plan)
    assert x.tokens.tolist() == y.tokens.tolist() == [6, 4, 1, 2, 3]
    assert x.confidence.tolist() == y.confidence.tolist() and x.margin.tolist() == y.margin.tolist()
    # A resumed request's feed runs on into its output (only the prompt is ingested); a request
    # released while its prompt was still being fed leaves nothing in the corpus; one that finished
    # as its prompt ended (released already) is not ingested again.
    r = seq(1, [4, 5, 6, 7], [8, 9])
    chunked.ingest([Feed(r, 0, [4, 5, 6])])
    chunked.ingest([Feed(r, 3, [7, 8])])
    assert chunked.drafter._history[1].tokens == [4, 5, 6, 7]
    chunked.release([1])
    done = seq(2, [1, 2, 3], [4])
    done.finish_reason = "length"
    chunked.ingest([Feed(done, 0, [1, 2, 3])])
    assert 2 not in chunked.drafter._history
    chunked.release([0])
    chunked.absorb(1)
    assert chunked.drafter.corpus.follow([0, 1, 2], 3) == (2, [3])  # request 0's output, with its prompt's tail
    assert chunked.drafter.corpus.follow([0, 4, 5], 3) == (0, [])  # nothing of request 1
    assert chunked.held() == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), min_size=1, max_size=7),
                          st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=20))
def test_a_few_requests_judged_in_hindsight_in_turn_equal_the_array_codes(rows):
    """Look-aheads (any, or none), what each request drafted and with which kind, and what it
    emitted: plain Python and array code judge the same requests the same."""
    look = Lookahead(1, *ragged.flatten([r[0] for r in rows], dtype=np.int64))
    counts, kinds, emitted = np.array([r[2] for r in rows]), np.array([r[3] for r in rows]), [r[1] for r in rows]
    in_turn = look.hindsight(counts, kinds, emitted)
    with mock.patch.object(lookahead, "IN_TURN_REQUESTS", 0):
        whole = look.hindsight(counts, kinds, emitted)
    assert [a.tolist() for a in in_turn] == [b.tolist() for b in whole]
    assert [a.dtype for a in in_turn] == [b.dtype for b in whole]
