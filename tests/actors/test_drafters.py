"""Drafters: n-gram exact cases, block-drafter cache consistency, lossless speculative decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.drafter.block import BlockDrafter
from actors.drafter.model import DraftConfig, DraftModel
from actors.drafter.ngram import Corpus, NgramDrafter
from actors.drafter.speculate import speculative_greedy
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from actors.target.model import ForwardBatch


def test_ngram_follows_the_most_recent_match_with_match_statistics():
    d = NgramDrafter(max_n=3)
    d.commit([1], [[1, 2, 3, 9, 1, 2, 3]])
    out = d.draft([1], [3], [3])
    assert out.tokens.tolist() == [9, 1, 2]
    np.testing.assert_allclose(out.confidence, (1 + 0.75) / 2)  # one match, prior 3/4 for n = 3
    np.testing.assert_allclose(out.margin, 1.0)
    # Two earlier "5 6" continuations disagree: the most recent wins, with half the evidence.
    d.commit([2], [[5, 6, 7, 5, 6, 8, 0, 5, 6]])
    out = d.draft([2], [6], [2])
    assert out.tokens.tolist() == [8, 0]
    assert out.confidence[0] == pytest.approx((1 + 2 / 3) / 3)
    assert out.margin[0] == pytest.approx(0.0)
    assert out.confidence[1] == pytest.approx((1 + 2 / 3) / 2)  # only the agreeing match is left


def test_ngram_without_a_match_drafts_nothing_and_checks_history():
    d = NgramDrafter()
    d.commit([1, 2], [[1, 2, 3, 4], [7]])
    out = d.draft([1, 2], [4, 7], [5, 5])
    assert out.cu.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="history"):
        d.draft([1], [9], [2])


def tiny_drafter(target, block=8):
    cfg = DraftConfig(64, (1, 3), num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=64, block_size=block, rope_theta=10000.0)
    torch.manual_seed(3)
    model = DraftModel(cfg, target.embed_tokens, target.lm_head)
    with torch.no_grad():
        model.mask_embedding.normal_()
    return model.eval()


def test_block_drafter_cache_path_equals_the_training_path(make_tiny):
    target = make_tiny()
    model = tiny_drafter(target)
    toks = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(0))
    _, cap = target(ForwardBatch.from_lists([0], [toks.tolist()]), target.new_cache(256), capture_layers=(1, 3))
    p = 17
    drafter = BlockDrafter(model)
    drafter.extend([5], [{k: v[:9] for k, v in cap.items()}])  # in two installments
    drafter.extend([5], [{k: v[9:p] for k, v in cap.items()}])
    drafter.extend([6], [{k: v[:4] for k, v in cap.items()}])  # another request, shorter context
    out = drafter.draft([6, 5], [int(toks[4]), int(toks[p])], [2, 7])
    with torch.no_grad():
        proj = model.project(torch.cat([cap[1], cap[3]], -1))
        cos, sin = model.rope(torch.arange(30))
        kv = [layer.context_kv(proj, cos, sin) for layer in model.layers]
        mask = (torch.arange(30) < p)[None]
        h = model.block_hidden(toks[p:p + 1], torch.tensor([p]), [(k[None], v[None]) for k, v in kv], mask, 8)
        probs = torch.softmax(model.logits(h[0, 1:]), -1)
    assert out.cu.tolist() == [0, 2, 9]
    assert out.tokens[2:].tolist() == probs.argmax(-1).tolist()
    np.testing.assert_allclose(out.confidence[2:], probs.max(-1).values.numpy(), rtol=1e-5)
    # Three drafts run a block of four positions, not the drafter's eight (a pass costs by its block).
    short = drafter.draft([5], [int(toks[p])], [3])
    with torch.no_grad():
        h4 = model.block_hidden(toks[p:p + 1], torch.tensor([p]), [(k[None], v[None]) for k, v in kv], mask, 4)
        probs4 = torch.softmax(model.logits(h4[0, 1:]), -1)
    np.testing.assert_allclose(short.confidence, probs4.max(-1).values.numpy(), rtol=1e-5)
    assert not np.allclose(short.confidence, out.confidence[2:5], rtol=1e-5)  # the block's length matters
    # In one pass with a longer request, each request drafts what it drafts alone.
    alone = drafter.draft([6], [int(toks[4])], [6])
    mixed = drafter.draft([6, 5], [int(toks[4]), int(toks[p])], [6, 3])
    np.testing.assert_allclose(mixed.confidence, np.concatenate([alone.confidence, short.confidence]), rtol=1e-5)
    assert mixed.tokens.tolist() == [*alone.tokens.tolist(), *short.tokens.tolist()]
    drafter.truncate({5: 10})
    assert drafter.context_length(5) == 10


@pytest.mark.parametrize("kind", ["ngram", "block"])
def test_speculative_greedy_is_lossless(make_tiny, kind):
    target = make_tiny()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [50, 51], [7, 7, 7, 7, 9, 10, 11]]
    ref = greedy_decode(LocalTarget(target), [0, 1, 2], prompts, max_new_tokens=20)
    drafter = NgramDrafter() if kind == "ngram" else BlockDrafter(tiny_drafter(target))
    layers = () if kind == "ngram" else (1, 3)
    trace = speculative_greedy(LocalTarget(target), drafter, [0, 1, 2], prompts, 20, 5, layers)
    assert trace.tokens == ref
    assert all(0 <= a <= d for acc, dr in zip(trace.accepted, trace.drafted, strict=True)
               for a, d in zip(acc, dr, strict=True))
    assert trace.mat() >= 1.0


@pytest.mark.parametrize("limit", [4096, 5])
def test_a_replica_of_several_kinds_drafts_what_each_kind_alone_drafts(tiny_bundle, limit):
    """Context held back from the kinds not drafting (`PendingContext`), given to a kind when it
    drafts or when it passes the limit, leaves every kind's drafts exactly those of a replica of
    that kind alone, fed eagerly; nothing is held past the limit."""
    from actors.engine.backlog import CatchUp
    from actors.engine.replica import Drafter, DrafterSpec
    from actors.target.checkpoint import load_model

    kinds = ("block", "mtp", "eagle3", "ngram")
    dirs = (("block", f"{tiny_bundle}/drafter"), ("mtp", f"{tiny_bundle}/mtp"), ("eagle3", f"{tiny_bundle}/eagle3"))
    spec = DrafterSpec(",".join(kinds), f"{tiny_bundle}/target", None, 6, dirs=dirs, pending_tokens=limit)
    mixed = Drafter(spec)
    alone = [Drafter(DrafterSpec(k, f"{tiny_bundle}/target", dict(dirs).get(k), 6)) for k in kinds]
    layers = mixed.target_layers()
    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    rng = np.random.default_rng(0)
    history = {rid: rng.integers(1, 96, 6).tolist() for rid in range(4)}
    fed = dict.fromkeys(history, 0)  # tokens of each request already sent to the drafters
    for _ in range(6):
        rids = list(history)
        tokens = [history[r][fed[r]:] for r in rids]
        feats = [model.forward([r], [history[r][:-1]], capture_layers=layers).features[0] for r in rids]
        hidden = [{lay: f[lay][fed[r]:] for lay in layers} for r, f in zip(rids, feats, strict=True)]
        catchup = CatchUp(rids, tokens, hidden)
        for d in alone:
            d.commit(catchup)
        mixed.commit(catchup)
        assert all(mixed.pending.held(k, r) <= limit for k in range(len(kinds)) for r in rids)
        fed = {r: len(history[r]) for r in rids}
        choice = rng.integers(0, len(kinds), len(rids)).tolist()
        lengths = rng.integers(1, 5, len(rids)).tolist()
        last = [history[r][-1] for r in rids]
        got = mixed.draft(rids, last, lengths, None, choice)
        for i, (rid, k) in enumerate(zip(rids, choice, strict=True)):
            want = alone[k].draft([rid], [last[i]], [lengths[i]])
            assert got.tokens[got.cu[i]:got.cu[i + 1]].tolist() == want.tokens.tolist()
            np.testing.assert_allclose(got.confidence[got.cu[i]:got.cu[i + 1]], want.confidence, rtol=1e-5)
        for r in rids:  # the request goes on: its next tokens
            history[r] += rng.integers(1, 96, int(rng.integers(1, 4))).tolist()
    mixed.release(list(history))
    assert not any(mixed.pending.sizes[k] for k in range(len(kinds)))


def test_a_request_whose_kind_drafts_nothing_is_drafted_by_its_fallback(tiny_bundle):
    """n-gram lookup finds no match for a context without repeats: its fallback (the block
    drafter) drafts instead, in the same call, and the output names the kind that drafted."""
    from actors.engine.backlog import CatchUp
    from actors.engine.replica import Drafter, DrafterSpec
    from actors.target.checkpoint import load_model

    dirs = (("block", f"{tiny_bundle}/drafter"), ("mtp", f"{tiny_bundle}/mtp"))
    mixed = Drafter(DrafterSpec("block,mtp,ngram", f"{tiny_bundle}/target", None, 6, dirs=dirs))
    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    fresh, loop = [1, 2, 3, 4, 5, 6], [7, 8, 9, 7, 8, 9, 7]  # no repeat / a repeat the n-gram drafter follows
    layers = mixed.target_layers()
    feats = [model.forward([r], [h[:-1]], capture_layers=layers).features[0] for r, h in enumerate((fresh, loop))]
    mixed.commit(CatchUp([0, 1], [fresh, loop], feats))
    out = mixed.draft([0, 1], [fresh[-1], loop[-1]], [3, 3], None, [2, 2], [0, 0])
    assert out.kinds.tolist() == [0, 2]  # request 0: the block drafter stood in; request 1: n-gram
    assert np.diff(out.cu).tolist() == [3, 3] and out.tokens[3:].tolist() == [8, 9, 7]
    alone = mixed.draft([0], [fresh[-1]], [3], None, [2], [-1])  # no fallback: nothing
    assert alone.cu.tolist() == [0, 0] and alone.kinds.tolist() == [2]


def _scan_lookup(h: list[int], want: int, max_n: int, min_n: int,
                 recent: int = 32) -> tuple[list[int], list[float], list[float]]:
    """The obviously correct n-gram draft: scan the history for the last n tokens, longest n
    first, follow the most recent earlier occurrence — token by token, each drafted token read
    as history for the next (`_copy_on`); each confidence is the share of the `recent` most
    recent occurrences agreeing so far whose next token agrees (smoothed toward n / (n + 1)),
    each margin the top-1 minus top-2 share among them."""
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        starts = [s for s in range(len(h) - n) if h[s:s + n] == h[-n:]]
        if not starts:
            continue
        return _scan_statistics(n, [_copy_on(h, s + n, want) for s in reversed(starts)][:recent])
    return [], [], []


def _copy_on(h: list[int], start: int, want: int) -> list[int]:
    """`want` tokens read from `start` on, one at a time, each appended to the history read."""
    text, out = list(h), []
    for j in range(want):
        out.append(text[start + j])
        text.append(out[-1])
    return out


def _scan_statistics(n: int, follow: list[list[int]]) -> tuple[list[int], list[float], list[float]]:
    """Position by position, a tally of the next tokens of the occurrences agreeing so far."""
    draft, confs, margins, alive = follow[0], [], [], follow
    for j, tok in enumerate(draft):
        nexts = [f[j] for f in alive if len(f) > j]
        counts = [*sorted((nexts.count(t) for t in set(nexts)), reverse=True), 0]
        confs.append((nexts.count(tok) + n / (n + 1.0)) / (len(nexts) + 1.0))
        margins.append((counts[0] - counts[1]) / len(nexts))
        alive = [f for f in alive if len(f) > j and f[j] == tok]
    return draft, confs, margins


def test_ngram_drafts_copy_on_past_the_end_of_the_history():
    """A match P tokens back whose continuation runs into the end of the history predicts that
    the last P tokens repeat: the draft copies on over itself, to the length asked, in the
    look-ahead (`peek`) as in `draft`."""
    d = NgramDrafter(max_n=3, block_size=8)
    d.commit([1], [[4, 1, 2, 3, 1, 2, 3, 1]])  # "2 3 1" occurred 3 tokens back: the period is 3
    assert d.draft([1], [1], [7]).tokens.tolist() == [2, 3, 1, 2, 3, 1, 2]
    assert d.peek([1], [5])[0].tolist() == [2, 3, 1, 2, 3]
    d.commit([2], [[8, 8]])  # period 1
    assert d.draft([2], [8], [4]).tokens.tolist() == [8, 8, 8, 8]
    assert d.draft([2], [8], [0]).tokens.tolist() == []


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(st.integers(0, 2), max_size=10), min_size=1, max_size=40))
def test_ngram_match_statistics_equal_a_tally_position_by_position(n, follow):
    """The confidences and margins of a draft followed by many occurrences — some agreeing to the
    end, some leaving it at every position, some shorter or longer than it — equal a tally of
    the agreeing occurrences' next tokens at each position, to the last bit."""
    assert NgramDrafter()._statistics(n, follow) == _scan_statistics(n, follow)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
       st.lists(st.integers(0, 40), max_size=6), st.integers(1, 7))
def test_the_ngram_index_finds_what_a_scan_of_the_history_finds(chunks, cuts, want):
    """Committed in chunks, rolled back at random lengths, committed again: after every change
    the indexed lookup drafts exactly what a scan of the whole history drafts, with the same
    match-statistics confidences and margins."""
    d, history = NgramDrafter(max_n=3, block_size=8, recent=4), []
    for i, chunk in enumerate(chunks):
        d.commit([0], [chunk])
        history += chunk
        if i < len(cuts) and 0 < cuts[i] < len(history):
            d.truncate({0: cuts[i]})
            del history[cuts[i]:]
        out = d.draft([0], [history[-1]], [want])
        tokens, confs, margins = _scan_lookup(history, min(want, 7), 3, 1, recent=4)
        assert out.tokens.tolist() == tokens
        np.testing.assert_allclose(out.confidence, confs, rtol=1e-12)
        np.testing.assert_allclose(out.margin, margins, rtol=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2 ** 31, 2 ** 32 - 1]), min_size=1, max_size=40), st.integers(1, 7),
       st.integers(1, 4))
def test_the_ngram_index_keeps_token_ids_at_the_edges_of_a_packed_key_apart(tokens, want, max_n):
    """The index packs an n-gram's ids into one int, 32 bits apiece (`History.BITS`): ids at the
    field's edges (0, its top bit, its largest) never make two n-grams one key, or an n-gram of
    zeros of a short history one of a long one; the lookup equals a scan of the history."""
    d = NgramDrafter(max_n=max_n, block_size=8)
    for i in range(len(tokens)):  # a token at a time: every length of the history looked up
        d.commit([0], [tokens[i:i + 1]])
        out = d.draft([0], [tokens[i]], [want])
        expect, confs, margins = _scan_lookup(tokens[:i + 1], min(want, 7), max_n, 1, recent=32)
        assert out.tokens.tolist() == expect
        np.testing.assert_allclose(out.confidence, confs, rtol=1e-12)
        np.testing.assert_allclose(out.margin, margins, rtol=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
       st.lists(st.integers(0, 9), min_size=1, max_size=4))
def test_a_following_history_peeks_what_a_committed_one_drafts(chunks, wants):
    """The coordinator's n-gram look-ahead (`follow` a request's prompt and output, `peek` its
    drafts) sees what a drafter fed by commits drafts, for any number of drafts asked."""
    committed, follower = NgramDrafter(max_n=3, block_size=8), NgramDrafter(max_n=3, block_size=8)
    prompt, output = chunks[0], []
    committed.commit([0], [prompt])
    for chunk in [*chunks[1:], []]:
        follower.follow([0], [prompt], [output])
        last = (prompt + output)[-1]
        for want in wants:
            tokens, cu = follower.peek([0], [want])
            assert tokens.tolist() == committed.draft([0], [last], [want]).tokens.tolist()
            assert cu.tolist() == [0, len(tokens)]
        committed.commit([0], [chunk])
        output = output + chunk


def test_every_drafter_kind_computes_where_its_weights_are(tiny_bundle):
    """#29: a drafter hosted by a GPU rank runs on that rank's device with its features. On this
    CPU the check is a trap: torch's default device is set to `meta` while a replica of every kind
    takes context (features as tensors, as a rank hands them over without a host copy) and
    drafts, so any tensor a drafter makes without naming its device lands on `meta` and the
    step fails. The drafts equal those of a replica fed host arrays with no trap set."""
    import torch

    from actors.engine.backlog import CatchUp
    from actors.engine.replica import Drafter, DrafterSpec
    from actors.target.checkpoint import load_model

    kinds = ("block", "mtp", "eagle3", "ngram")
    dirs = (("block", f"{tiny_bundle}/drafter"), ("mtp", f"{tiny_bundle}/mtp"), ("eagle3", f"{tiny_bundle}/eagle3"))
    spec = DrafterSpec(",".join(kinds), f"{tiny_bundle}/target", None, 6, dirs=dirs, pending_tokens=5)
    trapped, plain = Drafter(spec).to("cpu"), Drafter(spec)
    layers = trapped.target_layers()
    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    history = {0: [5, 9, 14, 5, 9, 14, 5], 1: [3, 1, 4, 1, 5, 9, 2]}
    feats = [model.forward([r], [h[:-1]], capture_layers=layers).features[0] for r, h in history.items()]
    on_device = [{lay: torch.as_tensor(f[lay]).half() for lay in f} for f in feats]
    host = [{lay: torch.as_tensor(f[lay]).half().numpy() for lay in f} for f in feats]
    rids, last = list(history), [h[-1] for h in history.values()]
    plain.commit(CatchUp(rids, list(history.values()), host))
    torch.set_default_device("meta")
    try:
        trapped.commit(CatchUp(rids, list(history.values()), on_device))
        got = [trapped.draft(rids, last, [4, 4], None, [k, k]) for k in range(len(kinds))]
    finally:
        torch.set_default_device(None)
    for k, out in enumerate(got):
        want = plain.draft(rids, last, [4, 4], None, [k, k])
        assert out.tokens.tolist() == want.tokens.tolist() and len(out.tokens) > 0, kinds[k]
        np.testing.assert_allclose(out.confidence, want.confidence, rtol=1e-5)
    with pytest.raises(RuntimeError, match="moves before"):
        trapped.drafters[0].to("meta")  # holding context: its cache cannot move


def test_ngram_confidences_count_the_recent_occurrences_of_a_long_repetitive_context():
    """A token that occurred 20,000 times: the draft's statistics read its 32 most recent
    occurrences, exactly as for a history holding only those (counting every one of them took
    about 60 ms a draft here)."""
    d = NgramDrafter(max_n=1, block_size=8)
    history = [5, 6, 7] * 20_000 + [5, 6]
    d.commit([0], [history])
    out = d.draft([0], [6], [4])
    tokens, confs, margins = _scan_lookup(history[-200:], 4, 1, 1, recent=32)
    assert out.tokens.tolist() == tokens == [7, 5, 6, 7]
    np.testing.assert_allclose(out.confidence, confs, rtol=1e-12)
    np.testing.assert_allclose(out.margin, margins, rtol=1e-12)


def _scan_corpus(docs: list[list[int]], capacity: int, context: list[int], want: int, min_n: int = 2,
                 max_n: int = 4, only: int | None = None) -> tuple[int, list[int]]:
    """The corpus's lookup by a scan: the requests (each one's last capacity // 2 − 1 tokens,
    those of min_n tokens or fewer left out) laid end to end with a separator after each, in
    generations of at most capacity // 2 tokens, the two newest held; the most recent occurrence
    of the longest n-gram ending the context (of length `only` if given), and what followed it
    up to the separator."""
    half, older, newer = capacity // 2, [], []
    for doc in docs:
        doc = doc[max(0, len(doc) - (half - 1)):] if half > 1 else []
        if len(doc) <= min_n:
            continue
        if len(newer) + len(doc) + 1 > half:
            older, newer = newer, []
        newer += [*doc, -1]
    flat = older + newer
    for n in [only] if only else range(min(max_n, len(context)), min_n - 1, -1):
        for end in range(len(flat) - 1, n - 1, -1):
            gram = flat[end - n:end]
            if flat[end] != -1 and -1 not in gram and gram == context[-n:]:
                out = flat[end:end + want]
                return n, out[:out.index(-1)] if -1 in out else out
    return 0, []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=8), st.integers(2, 30),
       st.lists(st.integers(0, 3), max_size=5), st.integers(0, 6))
def test_the_corpus_drafts_what_a_scan_of_the_held_outputs_drafts(docs, capacity, context, want):
    """Finished requests added one by one, the oldest dropped past the capacity: what `follow`
    drafts is what a scan of the tokens still held finds (the longest n-gram first, its most
    recent occurrence, never running on into the next request's tokens), and the indexes hold
    nothing the held tokens do not."""
    corpus = Corpus(capacity)
    for doc in docs:
        corpus.add(doc)
        assert len(corpus) <= capacity
    assert corpus.follow(context, want) == _scan_corpus(docs, capacity, context, want)
    for gram in [*corpus.older[1], *corpus.newer[1]]:  # every entry is found by a scan: nothing stale
        assert _scan_corpus(docs, capacity, list(gram), 1, only=len(gram))[0] == len(gram)


def test_a_request_with_no_match_of_its_own_drafts_from_earlier_requests_outputs():
    d = NgramDrafter(max_n=3, block_size=8, corpus_tokens=1000)
    d.commit([1], [[7, 8]])  # the prompt
    d.commit([1], [[1, 2, 3, 4, 5]])  # its output
    d.release([1])
    assert len(d.corpus) == 0  # not yet: the engine has it taken in where it learns (`absorb`)
    d.absorb()  # the prompt's last n-gram and the output
    assert d.corpus.newer[0] == [7, 8, 1, 2, 3, 4, 5, -1]
    d.commit([2], [[9, 1, 2]])  # no earlier "2", "1 2" of its own: the corpus's "1 2" -> "3 4 5"
    out = d.draft([2], [2], [5])
    assert out.tokens.tolist() == [3, 4, 5]  # up to the end of request 1's tokens
    np.testing.assert_allclose(out.confidence, (1 + 2 / 3) / 2)  # one occurrence of "1 2", as one of its own
    assert d.peek([2], [5])[0].tolist() == [3, 4, 5]
    # A match of its own, however short, comes first.
    d.commit([3], [[2, 6, 1, 2]])
    assert d.draft([3], [2], [5]).tokens.tolist() == [6, 1, 2, 6, 1]  # copied on past its end
    # Off: nothing kept, nothing drafted.
    off = NgramDrafter(max_n=3, block_size=8)
    off.commit([1], [[7, 8, 1, 2, 3]])
    off.release([1])
    off.absorb()
    off.commit([2], [[9, 1, 2]])
    assert off.corpus is None and off.draft([2], [2], [5]).tokens.tolist() == []
