"""Where a model bundle's parts live: `ROOT/target` (HF checkpoint), `ROOT/drafter` (block
drafter), `ROOT/mtp` (MTP drafter, DeepSeek next-n layout), `ROOT/eagle3` (an EAGLE-3 drafter,
speculators or SpecForge layout), `ROOT/tokenizer.json` and `tokenizer_config.json`. The bundled
demo is `models/demo` in this repository.

A plain Hugging Face folder works too (`dcut serve|generate --model DIR`): `ROOT/config.json`
and its safetensors are the target, with the checkpoint's own tokenizer, chat template and
generation config beside them; drafters in `ROOT/drafter`, `ROOT/mtp` or `ROOT/eagle3` if
present (n-gram lookup needs none)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from actors.drafter.kinds import REGISTRY
from actors.drafter.kinds import kind as drafter_kind

BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "models" / "demo"


@dataclass(frozen=True)
class Bundle:
    root: pathlib.Path

    @property
    def target(self) -> str:
        nested = self.root / "target"
        return str(self.root if (self.root / "config.json").exists() and not nested.exists() else nested)

    def drafter_dir(self, kind: str) -> str | None:
        """The folder of a drafter kind's weights (None: the kind needs none)."""
        k = drafter_kind(kind)
        return str(self.root / k.folder) if k.folder else None

    @property
    def tokenizer(self) -> str:
        return str(self.root / "tokenizer.json")

    def has(self, kind: str) -> bool:
        """Whether the bundle can serve drafter kind `kind` (its weights, or for MTP the
        checkpoint's own next-n layer; n-gram needs none)."""
        k = drafter_kind(kind)
        return k.holds(self.root / k.folder if k.folder else None, self.target)

    def held(self) -> tuple[str, ...]:
        """Every drafter kind this bundle can serve (`--drafter auto`)."""
        return tuple(k for k in REGISTRY if self.has(k))

    def kinds(self, drafter: str) -> tuple[str, ...]:
        """The drafter kinds a `--drafter` value names: one kind, a comma list, `auto` (every kind
        this bundle can serve: the command-line contract) or `tuned`: the kinds the bundle's prior
        names for per-request choice (`LearnedState.tuned`, chosen by `dcut prior` from the
        model's training traces), every kind it can serve where the prior names none or one it
        lacks."""
        if drafter == "auto":
            return self.held()
        if drafter == "tuned":
            held = self.held()
            chosen = self.prior_tuned()
            return tuple(k for k in held if k in chosen) if chosen and set(chosen) <= set(held) else held
        return tuple(drafter.split(","))

    def prior_tuned(self) -> tuple[str, ...]:
        """The kinds the bundle's prior names for `tuned` (empty: no prior, or it names none)."""
        import json

        from actors.engine.warm import prior_of

        path = prior_of(self.target)
        return tuple(json.loads(path.read_text()).get("tuned") or ()) if path else ()

    def eos_token_id(self) -> int | None:
        """The checkpoint's end of sequence: its generation_config.json's first, else config.json's."""
        import json

        from actors.target.config import MoEConfig

        gen = pathlib.Path(self.target, "generation_config.json")
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
        eos = eos[0] if isinstance(eos, list) and eos else eos
        return eos if isinstance(eos, int) else MoEConfig.load(self.target).eos_token_id

    def check(self, drafter: str | None) -> None:
        """The files a bundle needs, with those of drafter `drafter` (None: no drafter), and a
        target this server can run exactly (the reason named if not)."""
        from actors.target.config import MoEConfig

        missing = [p for p in (self.target + "/config.json", self.tokenizer) if not pathlib.Path(p).exists()]
        missing += [self.drafter_dir(k) for k in (self.kinds(drafter) if drafter else ()) if not self.has(k)]
        if missing:
            raise SystemExit(f"model bundle {self.root} is incomplete: missing {', '.join(missing)}")
        try:
            MoEConfig.load(self.target)
        except (ValueError, KeyError) as exc:
            raise SystemExit(f"{self.target} cannot be served: {exc}") from None
