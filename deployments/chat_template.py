"""A checkpoint's own chat template, applied as Hugging Face applies it.

The template is the Jinja source in `tokenizer_config.json` (`chat_template`: a string, or a list
of `{name, template}` of which `default` is taken) beside `tokenizer.json`. It renders in a
sandboxed Jinja environment with Hugging Face's settings (`trim_blocks`, `lstrip_blocks`, the
`raise_exception` and `strftime_now` helpers, the tokenizer's special tokens as variables), so a
prompt is token-for-token what `tokenizer.apply_chat_template(..., add_generation_prompt=True)`
gives — client-side token counts (aiperf, guidellm) agree with the server's. The bundled demo
model ships one that reproduces the role-tagged lines it always used.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or the bundle has none)."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    variables: dict

    @classmethod
    def load(cls, tokenizer_dir: str | pathlib.Path) -> ChatTemplate | None:
        """The template of the tokenizer in `tokenizer_dir`, or None when it has none."""
        path = pathlib.Path(tokenizer_dir) / "tokenizer_config.json"
        if not path.exists():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        variables = {k: _token_text(cfg.get(k)) for k in SPECIAL if cfg.get(k) is not None}
        return cls(source, variables)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            return env.from_string(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       **self.variables)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the conversation: {exc}") from None


def _token_text(token) -> str:
    return token["content"] if isinstance(token, dict) else token  # AddedToken dicts or plain strings


def _raise(message: str):
    raise TemplateError(message)
