"""The demo model's corpus: the Python standard library's own sources, which every machine with
this Python has offline. Split by file (a hash of the relative path), so validation and held-out
prompts come from files the models never trained on.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from collections.abc import Iterator

VALIDATION_PERCENT = 5


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Every .py file of the standard library (not site-packages), in a fixed order."""
    root = root or stdlib_root()
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def split_of(path: pathlib.Path, root: pathlib.Path) -> str:
    digest = hashlib.sha1(path.relative_to(root).as_posix().encode()).digest()
    return "validation" if digest[0] % 100 < VALIDATION_PERCENT else "train"


def texts(split: str, root: pathlib.Path | None = None) -> Iterator[str]:
    """File contents of one split ("train" or "validation"), undecodable files skipped."""
    root = root or stdlib_root()
    for f in source_files(root):
        if split_of(f, root) == split:
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
