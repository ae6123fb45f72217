"""Drafters: the block drafter (our own format or DFlash's), the MTP (next-n) chain, EAGLE-3 and
n-gram lookup."""

import json
import pathlib

KINDS = ("block", "mtp", "eagle3", "ngram")  # the drafter kinds a replica can host (`--drafter`, per request)


def is_dflash(folder: str | pathlib.Path) -> bool:
    """Whether `folder` holds a DFlash drafter (config.json naming DFlashDraftModel)."""
    path = pathlib.Path(folder) / "config.json"
    return path.exists() and "DFlashDraftModel" in (json.loads(path.read_text()).get("architectures") or ())
