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

    def has(self, kind: str) -> bool:
        """Whether the bundle holds drafter kind `kind`'s weights (n-gram needs none)."""
        config = {"block": "drafter_config.json", "mtp": "mtp_config.json"}.get(kind)
        return config is None or pathlib.Path(self.drafter_dir(kind), config).exists()

    def kinds(self, drafter: str) -> tuple[str, ...]:
        """The drafter kinds a `--drafter` value names: one kind, a comma list, or `auto` (every
        kind this bundle can serve)."""
        if drafter == "auto":
            return tuple(k for k in ("block", "mtp", "ngram") if self.has(k))
        return tuple(drafter.split(","))

    def check(self, drafter: str | None) -> None:
        """The files a bundle needs, with those of drafter `drafter` (None: no drafter)."""
        missing = [p for p in (self.target + "/config.json", self.tokenizer) if not pathlib.Path(p).exists()]
        missing += [self.drafter_dir(k) for k in (self.kinds(drafter) if drafter else ()) if not self.has(k)]
        if missing:
            raise SystemExit(f"model bundle {self.root} is incomplete: missing {', '.join(missing)}")
