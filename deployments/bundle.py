"""Where a model bundle's parts live: `ROOT/target` (HF checkpoint), `ROOT/drafter` (block
drafter), `ROOT/tokenizer.json`. The bundled demo is `models/demo` in this repository."""

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
    def tokenizer(self) -> str:
        return str(self.root / "tokenizer.json")

    def check(self, need_drafter: bool) -> None:
        missing = [p for p in (self.target + "/config.json", self.tokenizer) if not pathlib.Path(p).exists()]
        if need_drafter and not pathlib.Path(self.drafter, "drafter_config.json").exists():
            missing.append(self.drafter)
        if missing:
            raise SystemExit(f"model bundle {self.root} is incomplete: missing {', '.join(missing)}")
