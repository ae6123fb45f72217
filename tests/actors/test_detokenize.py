"""IncrementalText (actors/engine/detokenize.py) equals decoding the whole output at every
length, for the byte-level BPE the demo model ships and for a SentencePiece-style tokenizer
(Metaspace: the decoder drops the leading space of a string), with outputs grown the way steps
grow them (1 to 17 tokens at a time) from any token ids — including ones that split a
multi-byte character, and byte sequences that are not UTF-8 at all."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from actors.engine.detokenize import IncrementalText
from deployments.bundle import BUNDLED

TEXT = ["héllo wörld — ünïcode ✓ 猫 def f(x):\n    return x  # ok", "naïve café ☕ 日本語 tokens", "spaces   and\ttabs"]


@functools.cache
def tokenizers() -> dict[str, Tokenizer]:
    demo = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator(TEXT * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    return {"demo": demo, "metaspace": sp}


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["demo", "metaspace"]), data=st.data())
def test_the_text_equals_decoding_the_whole_output_at_every_step(kind, data):
    tok = tokenizers()[kind]
    vocab = tok.get_vocab_size()
    text_ids = tok.encode(data.draw(st.sampled_from(TEXT))).ids
    ids = data.draw(st.one_of(st.just(text_ids), st.lists(st.integers(0, vocab - 1), max_size=60)))
    steps = data.draw(st.lists(st.integers(1, 17), min_size=1, max_size=40))
    decode = tok.decode
    inc, output, at = IncrementalText(decode), [], 0
    for k in steps:
        output.extend(ids[at:at + k])
        at += k
        assert inc.text(output) == decode(output), (kind, output)


def test_a_token_the_decoder_skips_does_not_start_the_window():
    """Found by the property test: tab, `<unk>`, "▁#" a token a step. `<unk>` decodes to nothing,
    so a window starting at it dropped the leading space of "▁#" as the start of a string
    ("\\t#"), where the whole output keeps it ("\\t #")."""
    tok = tokenizers()["metaspace"]
    ids = [tok.token_to_id("\t"), tok.token_to_id("<unk>"), tok.token_to_id("▁#")]
    assert None not in ids
    inc = IncrementalText(tok.decode)
    for n in range(1, 4):
        assert inc.text(ids[:n]) == tok.decode(ids[:n])
    assert tok.decode(ids) == "\t #"


def test_a_cut_output_keeps_its_final_text():
    tok = tokenizers()["demo"]
    ids = tok.encode(TEXT[0]).ids
    inc = IncrementalText(tok.decode)
    inc.text(ids)
    inc.end(5, "héll")
    assert inc.text(ids[:5]) == "héll"
    assert inc.text(ids[:3]) == tok.decode(ids[:3])  # shrunk below what it settled: decoded afresh
