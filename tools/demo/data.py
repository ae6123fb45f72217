"""Token arrays of the corpus splits, cached on disk, and random training windows."""

from __future__ import annotations

import pathlib

import numpy as np
from tokenizers import Tokenizer

from deployments.corpus import texts
from tools.demo.tokenizer import EOS


def token_array(tokenizer_path: str, split: str, cache_dir: str = "runs/demo") -> np.ndarray:
    """All files of `split`, tokenized, each followed by EOS: [n] uint16 (cached as .npy)."""
    cache = pathlib.Path(cache_dir) / f"{split}_tokens.npy"
    if cache.exists():
        return np.load(cache)
    tok = Tokenizer.from_file(tokenizer_path)
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts(split))):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


def windows(arr: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """[batch, length + 1] random windows (inputs and shifted targets)."""
    starts = rng.integers(0, len(arr) - length - 1, batch)
    return np.stack([arr[s:s + length + 1] for s in starts]).astype(np.int64)
