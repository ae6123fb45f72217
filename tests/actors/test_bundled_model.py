"""The shipped demo model: checksums, loading, and drafting with both drafters."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from tokenizers import Tokenizer

from actors.drafter.block import BlockDrafter
from actors.drafter.mtp import MTPDrafter
from actors.drafter.ngram import NgramDrafter
from actors.drafter.speculate import speculative_greedy
from actors.engine.replica import DrafterSpec, build_drafter
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from deployments.bundle import BUNDLED, Bundle

PROMPT = "def read_config(path):\n    with open(path) as f:\n"


def test_checksums_match():
    sums = (BUNDLED / "SHA256SUMS").read_text().splitlines()
    assert len(sums) >= 4
    for line in sums:
        digest, name = line.split(maxsplit=1)
        assert hashlib.sha256((BUNDLED / name.strip()).read_bytes()).hexdigest() == digest, name


def test_bundle_is_small_enough_to_ship():
    total = sum(p.stat().st_size for p in BUNDLED.rglob("*") if p.is_file())
    assert total <= 40 * 2**20


@pytest.fixture(scope="module")
def target():
    return load_model(BUNDLED / "target")


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).encode(PROMPT).ids


@pytest.mark.parametrize("kind", ["block", "mtp", "ngram"])
def test_every_drafter_drafts_and_decoding_stays_lossless(target, prompt_ids, kind):
    drafter = build_drafter(DrafterSpec(kind, str(BUNDLED / "target"), Bundle(BUNDLED).drafter_dir(kind), 8))
    assert isinstance(drafter, {"block": BlockDrafter, "mtp": MTPDrafter, "ngram": NgramDrafter}[kind])
    layers = tuple(getattr(drafter, "target_layers", ()))
    trace = speculative_greedy(LocalTarget(target), drafter, [0], [prompt_ids], 24, 7, layers)
    reference = greedy_decode(LocalTarget(target), [0], [prompt_ids], 24)
    assert trace.tokens == reference
    drafted = sum(sum(d) for d in trace.drafted)
    assert drafted > 0
    conf = np.concatenate([c for cs in trace.confidence for c in cs])
    assert ((conf >= 0) & (conf <= 1)).all()
    if kind != "ngram":
        assert trace.mat() > 1.2  # the trained drafters' drafts are accepted, not just made
