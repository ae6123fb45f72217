"""Structured output: a grammar constrains the target's distribution, and speculation stays exact.

`llguidance` (a maintained Rust library with CPU wheels and no dependencies; docs/dependencies.md)
compiles JSON schemas, regular expressions and Lark grammars, and answers, per request, which
tokens may come next. For one decode step of a constrained request:

- **before pruning**, its drafts are checked against the grammar (`valid_prefix`): a draft the
  grammar forbids, and every draft after it, gets survival 0, so D-Cut spends the step's budget
  only on drafts that can be accepted — and no policy verifies one (`kept` is capped there);
- **verify** gets one token mask per row (`masks`): row j's is the grammar's state after the
  committed tokens and the first j kept drafts (consumed, then rolled back), exactly what plain
  constrained decoding would mask at that position once they are accepted; the rank sets
  forbidden tokens' logits to −∞ before anything else;
- **commit** consumes the committed tokens (`commit`, from `Scheduler.append`).

Greedy output is then constrained plain decoding's, and sampled output follows the masked
distribution. When the grammar is complete only EOS may follow, so output parses whenever the
request ends by itself (not at `max_tokens`).
"""

from __future__ import annotations

import json

import numpy as np

KINDS = ("json_object", "json_schema", "regex", "lark", "choice")
# JSON as `json.dumps` writes it (", " and ": ", no newlines): without it a model may spend its
# whole budget on whitespace the grammar allows. A schema's own "x-guidance" options win.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_grammar(schema: dict) -> str:
    import llguidance as llg

    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = schema | {"x-guidance": COMPACT}
    return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))


def grammar_source(kind: str, spec: str) -> str:
    """llguidance's grammar for a request's constraint (kind, spec): a JSON schema (text), a regex,
    a Lark grammar, or a JSON list of strings to choose from."""
    import llguidance as llg

    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        return _json_grammar(schema)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    raise ValueError(f"unknown constraint {kind!r}; one of {', '.join(KINDS)}")


class Grammars:
    """Compiles constraints for one tokenizer (the model's `tokenizer.json`, its vocabulary size
    and EOS token)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos: int) -> None:
        import llguidance as llg

        with open(tokenizer_path) as f:
            self.tokenizer = llg.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos = eos

    def check(self, kind: str, spec: str) -> str | None:
        """Why this constraint cannot be served, or None."""
        import llguidance as llg

        try:
            failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar_source(kind, spec),
                                                                            self.tokenizer)
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "; ".join(messages)[:500] if failed else None  # (warnings alone do not refuse it)

    def matcher(self, kind: str, spec: str, committed: list[int] = ()) -> RequestGrammar:
        """A request's grammar state, after the tokens it has already `committed` (a resumed request)."""
        import llguidance as llg

        g = RequestGrammar(llg.LLMatcher(self.tokenizer, grammar_source(kind, spec)), self.vocab_size, self.eos)
        if g.matcher.is_error():
            raise ValueError(f"invalid {kind}: {g.matcher.get_error()}")
        if committed:
            g.commit(list(committed))
        return g


class RequestGrammar:
    """One request's grammar state (`llguidance.LLMatcher`), advanced by its committed tokens."""

    def __init__(self, matcher, vocab_size: int, eos: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos

    def valid_prefix(self, drafts: np.ndarray) -> int:
        """How many of these drafts, in order, the grammar allows after the committed tokens."""
        return int(self.matcher.validate_tokens([int(t) for t in drafts])) if len(drafts) else 0

    def masks(self, drafts: np.ndarray) -> np.ndarray:
        """Allowed-token bitmasks [len(drafts) + 1, ceil(V / 32)] int32: row j after the first j
        drafts (which must be allowed: `valid_prefix`). The state is left as it was."""
        words = (self.vocab_size + 31) // 32
        out = np.empty((len(drafts) + 1, words), dtype=np.int32)
        for j in range(len(drafts) + 1):
            out[j] = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[:words]
            if j < len(drafts) and not self.matcher.consume_token(int(drafts[j])):
                raise RuntimeError(f"draft {int(drafts[j])} was not allowed: {self.matcher.get_error()}")
        if len(drafts):
            self.matcher.rollback(len(drafts))
        return out

    def commit(self, tokens: list[int]) -> None:
        """Advance by committed tokens. EOS ends the request: it is not fed to the grammar (which
        allowed it because it is complete)."""
        tokens = [int(t) for t in tokens if t != self.eos]
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"a committed token broke the grammar: {self.matcher.get_error()}")


def unpack(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bitmasks [m, W] int32 → allowed [m, V] bool (bit t of word t // 32, little-endian)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
