"""Train the demo BPE tokenizer (byte-level, HF `tokenizers`) on the corpus's training split."""

from __future__ import annotations

import argparse
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from actors.demo.corpus import texts

EOS = "<|endoftext|>"


def train_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts("train"), trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="models/demo/tokenizer.json")
    args = ap.parse_args()
    tok = train_tokenizer(args.vocab)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"vocabulary {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
