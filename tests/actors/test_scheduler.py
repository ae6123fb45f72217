"""The scheduler as the one owner of a request's state: waiting, running, finished (with a typed
error when it failed), claimed once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.errors import EngineError, ErrorKind
from actors.engine.sequence import Census, SamplingParams, Scheduler, Sequence, Status
from tests.actors.test_detokenize import TEXT, tokenizers  # at import: not inside a running @given


def scheduler(n: int, running: int) -> tuple[Scheduler, list[Sequence]]:
    sched = Scheduler(max_running=running, detokenize=lambda ids: "".join(chr(97 + t % 26) for t in ids))
    seqs = [Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=4)) for rid in range(n)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    return sched, seqs


def test_a_failed_request_leaves_its_set_and_is_claimed_once_with_its_error():
    sched, seqs = scheduler(4, running=2)  # 0, 1 running; 2, 3 waiting
    error = EngineError(ErrorKind.UNAVAILABLE, "a step failed under this request; retry it")
    sched.fail([seqs[1], seqs[3]], error)
    assert [s.rid for s in sched.running] == [0] and [s.rid for s in sched.waiting] == [2] and len(sched) == 2
    for s in (seqs[1], seqs[3]):
        assert s.status is Status.FINISHED and s.finish_reason == "error" and s.error is error
    assert sched.claim(1) is seqs[1] and sched.claim(1) is None and sched.claim(3) is seqs[3]
    assert not sched.finished


def test_an_aborted_request_leaves_and_nobody_claims_it():
    sched, seqs = scheduler(3, running=1)
    assert sched.abort(0) is seqs[0] and sched.abort(2) is seqs[2] and sched.abort(7) is None
    assert seqs[0].finish_reason == seqs[2].finish_reason == "abort" and seqs[0].error is None
    assert [s.rid for s in [*sched.running, *sched.waiting]] == [1] and sched.claim(0) is None


def test_a_request_that_can_never_fit_fails_as_invalid_and_the_queue_moves_on():
    sched = Scheduler(max_running=4, detokenize=lambda ids: "")
    big = Sequence(0, list(range(100)), SamplingParams(max_tokens=50))
    small = Sequence(1, [1, 2], SamplingParams(max_tokens=4))
    sched.add(big)
    sched.add(small)
    assert sched.admit(kv_budget=64, block=8) == [small]
    assert big.error == EngineError(ErrorKind.INVALID, "request exceeds the KV cache") and not big.error.retryable
    assert sched.claim(0) is big


def test_step_totals_sum_every_field_of_the_records():
    """`StepTotals.add` names its fields one by one: each one (but the step count) is the sum of
    the `StepRecord` field of its name, a field added to both included."""
    import dataclasses

    from actors.engine.history import StepHistory
    from actors.engine.stages import StepRecord

    history = StepHistory(keep=2)
    names = [f.name for f in dataclasses.fields(history.totals) if f.name != "steps"]
    recs = [StepRecord(**{f.name: (i + 1) * (j + 2) if f.type in ("int", int) else (i + 1) * (j + 2) * 0.5
                          for j, f in enumerate(dataclasses.fields(StepRecord)) if f.name != "rank_compute_s"})
            for i in range(3)]
    for rec in recs:
        history.append(rec)
    assert history.steps == 3 and len(history.recent) == 2
    for name in names:
        assert getattr(history.totals, name) == sum(getattr(r, name) for r in recs), name


def _committed(tokens: list[int], have: int, max_tokens: int, eos: int | None) -> tuple[list[int], str | None]:
    """What a step-by-step decoder commits: token by token while room is left, the EOS included
    and last."""
    kept, reason = [], None
    for t in tokens:
        if have + len(kept) >= max_tokens:
            break
        kept.append(t)
        if t == eos:
            reason = "stop"
            break
    if reason is None and have + len(kept) >= max_tokens:
        reason = "length"
    return kept, reason


@given(st.lists(st.integers(0, 5), max_size=9), st.integers(0, 6), st.integers(1, 8), st.sampled_from([None, 0, 3]),
       st.booleans())
def test_committing_a_plain_requests_tokens_keeps_what_a_step_by_step_decoder_would(tokens, have, max_tokens, eos,
                                                                                  ignore_eos):
    """`Scheduler.append`'s fast path (no stop strings or ids, no log-probabilities) against the
    token-by-token reference: the room, the first EOS (unless ignored), the finish reason."""
    sched = Scheduler(max_running=1, detokenize=lambda ids: "")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    assert params.plain_commit
    seq = Sequence(0, [1], params, output=[4] * min(have, max_tokens - 1))
    before = list(seq.output)
    kept = sched.append(seq, list(tokens), eos, None)
    want, reason = _committed(tokens, len(before), max_tokens, None if ignore_eos else eos)
    assert kept == want and seq.output == before + want and seq.finish_reason == reason
    # the same tokens through the general path (a stop token id nobody emits) agree
    other = Sequence(0, [1], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=(99,)),
                     output=list(before))
    assert not other.params.plain_commit
    assert sched.append(other, list(tokens), eos, None) == kept and other.finish_reason == reason


def _stopped(chunks: list[list[int]], stops: tuple[str, ...], max_tokens: int, min_tokens: int,
             decode) -> tuple[list[int], str | None, str | None]:
    """Stop strings as a decoder that searches the whole text after every step finds them: at the
    first step whose text holds one, the shortest output (from min_tokens on) past the previous
    step's whose text holds one, and the text before it."""
    output: list[int] = []
    least = max(1, min_tokens)
    for chunk in chunks:
        before = len(output)
        output += chunk[:max(0, max_tokens - len(output))]
        text = decode(output) if len(output) >= least else ""
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            n = next(n for n in range(max(least, before + 1), len(output) + 1)
                     if any(s in decode(output[:n]) for s in stops))
            return output[:n], "stop", text[:min(a for a, _ in hits)]
        if len(output) >= max_tokens:
            return output, "length", None
    return output, None, None


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_stop_strings_searched_from_where_the_last_search_left_off_find_what_a_whole_search_finds(data):
    """`Sequence.stop_hits` searches only the text past the last search (less the longest stop
    string): outputs grown a step at a time (1 to 17 tokens), with stop strings cut from their
    own text, from other text or split multi-byte characters, stop where searching the whole
    text every step stops them, with the same text."""
    tok = tokenizers()["demo"]
    decode = tok.decode
    ids = data.draw(st.one_of(st.just(tok.encode(data.draw(st.sampled_from(TEXT))).ids),
                              st.lists(st.integers(0, tok.get_vocab_size() - 1), min_size=1, max_size=60)))
    full = decode(ids)
    cut = st.builds(lambda a, n: full[a:a + n], st.integers(0, max(0, len(full) - 1)), st.integers(1, 6))
    stops = tuple(s for s in data.draw(st.lists(st.one_of(cut, st.sampled_from(["é", "\n", "x):", "zz"])),
                                                min_size=1, max_size=3)) if s)
    sizes = data.draw(st.lists(st.integers(1, 17), min_size=1, max_size=30))
    chunks, at = [], 0
    for k in sizes:
        chunks.append(ids[at:at + k])
        at += k
    chunks = [c for c in chunks if c]
    if not stops or not chunks:
        return
    max_tokens, min_tokens = data.draw(st.integers(1, 70)), data.draw(st.integers(0, 5))
    sched = Scheduler(max_running=1, detokenize=decode)
    seq = Sequence(0, [1], SamplingParams(max_tokens=max_tokens, stop=stops, min_tokens=min_tokens))
    seq.detokenize = decode
    for chunk in chunks:
        sched.append(seq, list(chunk), None, None)
        if seq.finish_reason is not None:
            break
    want_out, want_reason, want_text = _stopped(chunks, stops, max_tokens, min_tokens, decode)
    assert (seq.output, seq.finish_reason) == (want_out, want_reason), (stops, chunks)
    if want_reason == "stop":
        assert seq.text == want_text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
                         min_size=3, max_size=3), min_size=1, max_size=12))
def test_a_requests_per_step_record_is_what_each_step_recorded(steps):
    """`record_step` keeps only the steps that drafted for a request; its per-step lists (drafts,
    kind, kept, accepted) read back as if every step had appended to each."""
    import types

    import numpy as np

    sched = Scheduler(max_running=3, detokenize=lambda ids: "")
    seqs = [Sequence(rid, [1], SamplingParams(max_tokens=1000)) for rid in range(3)]
    want = {name: [[] for _ in seqs] for name in ("drafted", "kinds", "kept", "accepted")}
    for rows in steps:
        drafted = [d for _, d, _, _ in rows]
        kept = [min(k, d) for _, d, k, _ in rows]
        accepted = [min(a, k) for a, k in zip((a for *_, a in rows), kept, strict=True)]
        kinds = [kind for kind, *_ in rows]
        st_ = types.SimpleNamespace(
            batch=seqs, drafts=types.SimpleNamespace(counts=np.array(drafted), kinds=np.array(kinds)),
            pruned=types.SimpleNamespace(kept=np.array(kept)), out=types.SimpleNamespace(logprobs=None),
            accepted=types.SimpleNamespace(counts=accepted, emitted=[[7] * (a + 1) for a in accepted]))
        sched.record_step(st_, None)
        for i in range(3):
            for name, value in (("drafted", drafted[i]), ("kinds", kinds[i] if drafted[i] else -1),
                                ("kept", kept[i]), ("accepted", accepted[i])):
                want[name][i].append(value)
    for i, s in enumerate(seqs):
        assert s.steps == len(steps)
        assert (s.drafted, s.kinds, s.kept, s.accepted) == tuple(want[n][i] for n in ("drafted", "kinds", "kept",
                                                                                         "accepted"))
        assert s.accepted_tokens == sum(want["accepted"][i])
        assert s.output == [7] * (len(steps) + sum(want["accepted"][i]))


def _recount(sched: Scheduler) -> Census:
    """The census from scratch: every running request looked at."""
    run = sched.running
    return Census(unfed=sum(not s.prefilled for s in run), sampling=sum(s.params.temperature > 0 for s in run),
                  logprobs=sum(s.params.logprobs is not None or s.params.prompt_logprobs is not None for s in run),
                  controls=sum(s.controls is not None or s.params.constraint is not None for s in run),
                  drafters=sum(s.params.drafters is not None for s in run))


PARAMS = st.builds(SamplingParams, max_tokens=st.integers(1, 6), temperature=st.sampled_from([0.0, 0.7]),
                   logprobs=st.sampled_from([None, 2]), prompt_logprobs=st.sampled_from([None, 0]),
                   presence_penalty=st.sampled_from([0.0, 0.5]), min_tokens=st.sampled_from([0, 2]),
                   constraint=st.sampled_from([None, ("regex", "a+")]), drafters=st.sampled_from([None, ("ngram",)]))


@settings(max_examples=150, deadline=None)
@given(st.lists(PARAMS, min_size=1, max_size=8), st.lists(st.tuples(st.sampled_from(
    ["admit", "prefill", "finish", "abort", "fail", "refeed"]), st.integers(0, 7)), max_size=30),
    st.sampled_from([None, 0]))
def test_the_census_of_the_running_set_is_what_a_recount_finds_after_every_change(params, ops, eos):
    """Admission, the end of a prefill, finishing, aborting, failing and feeding everything again
    keep `Scheduler.census` equal to a count over the running requests, and `decoding` splits
    them as a look at each would."""
    from types import SimpleNamespace

    from actors.engine.stages import Feed

    sched = Scheduler(max_running=4, detokenize=lambda ids: "", eos=eos)
    seqs = [Sequence(rid, [1, 2, 3], p) for rid, p in enumerate(params)]
    for s in seqs:
        sched.add(s)
    for op, i in ops:
        run = sched.running
        s = run[i % len(run)] if run else None
        if op == "admit":
            sched.admit()
        elif op == "prefill" and s is not None and not s.prefilled and s.params.prompt_logprobs is None:
            # its whole feed in one chunk (the prompt's log-probabilities would need the target's rows)
            out = SimpleNamespace(logprobs=None, tokens=lambda row: [5])
            sched.advance_prefill(SimpleNamespace(batch=[], feeding=[Feed(s, s.fed, s.feed[s.fed:])], out=out), eos)
        elif op == "finish" and s is not None:
            s.finish_reason = "length"
            assert s in sched.finish_done()
        elif op == "abort" and s is not None:
            sched.abort(s.rid)
        elif op == "fail" and s is not None:
            sched.fail([s], EngineError(ErrorKind.UNAVAILABLE, "retry"))
        elif op == "refeed":
            sched.refeed()
        assert sched.census == _recount(sched)
        assert all(s.controls == s.params.controls(eos) for s in sched.running)
        decoding, unfed = sched.decoding()
        assert decoding == [s for s in sched.running if s.prefilled] and unfed == [s for s in sched.running
                                                                                     if not s.prefilled]
