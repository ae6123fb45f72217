"""Where a model bundle's parts live: `ROOT/target` (HF checkpoint), `ROOT/drafter` (block
drafter), `ROOT/mtp` (MTP drafter, DeepSeek next-n layout), `ROOT/tokenizer.json` and
`tokenizer_config.json`. The bundled demo is `models/demo` in this repository."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "models" / "demo"


@dataclass(frozen=True)
class Bundle:
    root: pathlib.Path

    @property
    def target(self) -> str:
        return str(self.root / "target")

    @property
    def drafter(self) -> str:
        return str(self.root / "drafter")

    @property
    def mtp(self) -> str:
        return str(self.root / "mtp")

    def drafter_dir(self, kind: str) -> str:
        """The folder of a drafter kind's weights (none needed for ngram)."""
        return self.mtp if kind == "mtp" else self.drafter

    @property
    def tokenizer(self) -> str:
        return str(self.root / "tokenizer.json")

    def check(self, drafter: str | None) -> None:
        """The files a bundle needs, with those of drafter kind `drafter` (None: no drafter)."""
        missing = [p for p in (self.target + "/config.json", self.tokenizer) if not pathlib.Path(p).exists()]
        config = {"block": "drafter_config.json", "mtp": "mtp_config.json"}.get(drafter or "")
        if config and not pathlib.Path(self.drafter_dir(drafter), config).exists():
            missing.append(self.drafter_dir(drafter))
        if missing:
            raise SystemExit(f"model bundle {self.root} is incomplete: missing {', '.join(missing)}")
