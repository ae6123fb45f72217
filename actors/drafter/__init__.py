"""Drafters: the block drafter (our own format or DFlash's), the MTP (next-n) chain, EAGLE-3 and
n-gram lookup."""

import json
import pathlib

from actors.drafter.kinds import REGISTRY

KINDS = tuple(REGISTRY)  # the drafter kinds a unit can host (`--drafter`, per request), in the registry's order


def is_dflash(folder: str | pathlib.Path) -> bool:
    """Whether `folder` holds a DFlash drafter (config.json naming DFlashDraftModel)."""
    path = pathlib.Path(folder) / "config.json"
    return path.exists() and "DFlashDraftModel" in (json.loads(path.read_text()).get("architectures") or ())


def has_nextn(target_dir: str | pathlib.Path) -> bool:
    """Whether the target checkpoint holds a next-n layer (config and weights)."""
    path = pathlib.Path(target_dir)
    d = json.loads((path / "config.json").read_text())
    if not d.get("num_nextn_predict_layers"):
        return False
    key = f"model.layers.{d['num_hidden_layers']}.eh_proj.weight"
    index = path / "model.safetensors.index.json"
    if index.exists():
        return key in json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            if key in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                return True
    return False
