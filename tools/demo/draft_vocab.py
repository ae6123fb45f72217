"""The MTP drafter's draft vocabulary: the N most frequent tokens of the training split.

    .venv/bin/python -m tools.demo.draft_vocab --size 2048 --out models/demo/mtp

The drafter then drafts only these tokens and its head reads N of the target head's rows
(`actors/drafter/mtp.DraftVocabulary`; FR-Spec's frequency-ranked head). For the bundled model 2,048
of 4,096 tokens cover 97.9 % of the target's own greedy continuations of validation windows
(1,024: 93.9 %). The bundle ships none: on this CPU it does not pay (docs/model.md).
"""

from __future__ import annotations

import argparse

import numpy as np

from actors.drafter.mtp import DraftVocabulary
from actors.target.config import MoEConfig
from tools.demo.data import token_array


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/demo/target")
    ap.add_argument("--tokenizer", default="models/demo/tokenizer.json")
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--out", default="models/demo/mtp")
    args = ap.parse_args()
    counts = np.bincount(token_array(args.tokenizer, "train"), minlength=MoEConfig.load(args.target).vocab_size)
    vocab = DraftVocabulary.from_counts(counts, args.size)
    vocab.save(args.out)
    print(f"draft vocabulary: {len(vocab)} tokens, {100 * counts[vocab.ids.numpy()].sum() / counts.sum():.1f} % of "
          "the training split's tokens")


if __name__ == "__main__":
    main()
