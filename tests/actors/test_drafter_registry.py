"""The drafter kind registry (`actors/drafter/kinds.py`): one table the bundle, the engine's
config and the replicas read."""

from __future__ import annotations

import pathlib

import pytest

from actors.drafter import KINDS
from actors.drafter.kinds import REGISTRY, kind
from actors.engine.config import EngineConfig
from actors.engine.replica import DrafterSpec, build_drafter
from deployments.bundle import Bundle


def test_every_kind_a_bundle_holds_builds_from_its_folder(tiny_bundle):
    bundle = Bundle(pathlib.Path(tiny_bundle))
    assert tuple(REGISTRY) == KINDS and bundle.held() == KINDS  # the tiny bundle holds every kind
    built = {name: build_drafter(DrafterSpec(name, bundle.target, bundle.drafter_dir(name), 4)) for name in KINDS}
    assert {n: type(d).__name__ for n, d in built.items()} == {
        "block": "BlockDrafter", "mtp": "MTPDrafter", "eagle3": "Eagle3Drafter", "ngram": "NgramDrafter"}
    assert [n for n in KINDS if bundle.drafter_dir(n) is None] == ["ngram"]


def test_a_kind_without_its_weights_is_not_held_and_an_unknown_one_is_named(tmp_path, tiny_bundle):
    (tmp_path / "target").symlink_to(pathlib.Path(tiny_bundle) / "target")
    bundle = Bundle(tmp_path)
    assert bundle.held() == ("ngram",)  # the tiny target has no next-n layer; no drafter folders
    with pytest.raises(ValueError, match="unknown drafter 'medusa'; choose from block, mtp, eagle3, ngram"):
        kind("medusa")
    with pytest.raises(ValueError, match="needs drafter weights"):
        build_drafter(DrafterSpec("block", bundle.target, None, 4))


def test_the_replicas_host_every_kind_but_the_coordinators_own():
    cfg = EngineConfig(target_dir="unused", drafter="block,mtp,ngram")
    assert cfg.replica_kinds == ("block", "mtp") and [k for k in REGISTRY if REGISTRY[k].local] == ["ngram"]
