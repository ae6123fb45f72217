"""The drafter kinds a unit can host, in one table (`REGISTRY`): where a bundle keeps each kind's
weights, whether a bundle can serve it, how a replica builds it, and whether the coordinator
drafts it itself. The bundle (`deployments/bundle.py`), the engine's config and the drafter
replicas read this table instead of branching on a kind's name (the coordinator's look-ahead is
the n-gram kind by design: actors/engine/lookahead.py).

A new kind is one `DrafterKind` here and its drafter class (the protocol in `base.py`)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BuildArgs:
    """What building any drafter reads: the target checkpoint (shared embeddings, head, final
    norm, a next-n layer), the kind's weights folder (None: none given), the context capacity of
    its KV cache and the block (drafts per step are at most block − 1)."""

    target_dir: str
    folder: str | None
    capacity_tokens: int
    block: int


@dataclass(frozen=True)
class DrafterKind:
    name: str
    folder: str | None  # its weights' folder inside a bundle (None: it needs none)
    holds: Callable[[pathlib.Path | None, str], bool]  # (that folder, the target checkpoint) -> can serve it
    build: Callable[[BuildArgs], object]  # the drafter (`actors/drafter/base.py`'s protocol)
    local: bool = False  # drafted by the coordinator itself (actors/engine/lookahead.py): no replica hosts it
    chained: bool = False  # a pass per draft position, cut as it runs: `draft` takes a `stop` (dcut_core/chains.py)


def _holds_block(folder: pathlib.Path | None, target_dir: str) -> bool:
    from actors.drafter import is_dflash  # our own format, or a DFlash drafter (config.json naming it)

    return folder is not None and ((folder / "drafter_config.json").exists() or is_dflash(folder))


def _holds_mtp(folder: pathlib.Path | None, target_dir: str) -> bool:
    from actors.drafter import has_nextn
    from actors.drafter.mtp import CONFIG

    if folder is not None and (folder / CONFIG).exists():
        return True
    return pathlib.Path(target_dir, "config.json").exists() and has_nextn(target_dir)  # the checkpoint's own next-n


def _holds_eagle3(folder: pathlib.Path | None, target_dir: str) -> bool:
    from actors.drafter.eagle3 import CONFIG

    return folder is not None and (folder / CONFIG).exists()


def _build_block(a: BuildArgs):
    if not a.folder:
        raise ValueError("the block drafter needs drafter weights (drafter_dir)")
    from actors.drafter.block import BlockDrafter
    from actors.drafter.dflash import load_block_model
    from actors.drafter.target_parts import shared_embeddings
    from actors.target.layout import for_cpu

    embed, head = shared_embeddings(a.target_dir)
    return BlockDrafter(for_cpu(load_block_model(a.folder, embed, head)), a.capacity_tokens, a.block)


def _build_mtp(a: BuildArgs):
    from actors.drafter import has_nextn
    from actors.drafter.mtp import CONFIG, DraftVocabulary, MTPDrafter, MTPModule
    from actors.drafter.nextn import NextNModule
    from actors.drafter.target_parts import shared_embeddings, target_final_norm
    from actors.target.config import MoEConfig
    from actors.target.layout import for_cpu

    embed, head = shared_embeddings(a.target_dir)
    if a.folder and (pathlib.Path(a.folder) / CONFIG).exists():
        module = MTPModule.load(a.folder, embed, head)
    elif has_nextn(a.target_dir):  # the checkpoint's own next-n layer (DeepSeek-V3, GLM-4-MoE)
        module = NextNModule.load(a.target_dir, embed, head)
    else:
        raise ValueError(f"the mtp drafter needs a folder with {CONFIG} and its weights (drafter_dir), or a "
                         "target checkpoint with a next-n layer")
    layer = MoEConfig.load(a.target_dir).num_hidden_layers
    return MTPDrafter(for_cpu(module, head), target_final_norm(a.target_dir), layer, a.capacity_tokens, a.block,
                      DraftVocabulary.load(a.folder) if a.folder else None)


def _build_eagle3(a: BuildArgs):
    from actors.drafter.eagle3 import CONFIG, Eagle3Drafter, Eagle3Module
    from actors.drafter.target_parts import shared_embeddings
    from actors.target.config import MoEConfig
    from actors.target.layout import for_cpu

    if not a.folder or not (pathlib.Path(a.folder) / CONFIG).exists():
        raise ValueError(f"the eagle3 drafter needs a folder with {CONFIG} and its weights (drafter_dir)")
    embed, _ = shared_embeddings(a.target_dir)
    module = Eagle3Module.load(a.folder, embed, MoEConfig.load(a.target_dir).num_hidden_layers)
    return Eagle3Drafter(for_cpu(module), a.capacity_tokens, a.block)


def _build_ngram(a: BuildArgs):
    from actors.drafter.ngram import NgramDrafter

    return NgramDrafter(block_size=a.block)


REGISTRY: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("block", "drafter", _holds_block, _build_block),
    DrafterKind("mtp", "mtp", _holds_mtp, _build_mtp, chained=True),
    DrafterKind("eagle3", "eagle3", _holds_eagle3, _build_eagle3),
    DrafterKind("ngram", None, lambda folder, target_dir: True, _build_ngram, local=True),
)}


def kind(name: str) -> DrafterKind:
    """The kind called `name`; a ValueError naming the known kinds otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(REGISTRY)}") from None
