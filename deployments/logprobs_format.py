"""The target's log-probabilities (`actors.engine.logprobs.TokenLogprob`) in OpenAI's two shapes:
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat
(`content: [{token, logprob, bytes, top_logprobs}]`). A token's text is what it adds to the
decoded text after the tokens before it (so the pieces join to the returned text); an
alternative's is what decoding it alone gives. A position without an entry (the prompt's first
token; tokens an earlier engine already reported before a resubmission) has `null` values."""

from __future__ import annotations

from functools import lru_cache


class LogprobFormat:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i], skip_special_tokens=False))

    def text(self, token: int) -> str:
        return self._text(token)

    def pieces(self, ids: list[int], before: list[int] = ()) -> list[str]:
        """The text each of `ids` adds when decoded after `before` and the ids ahead of it."""
        seq, out = list(before), []
        prev = self.tokenizer.decode(seq, skip_special_tokens=True) if seq else ""
        for i in ids:
            seq.append(i)
            now = self.tokenizer.decode(seq, skip_special_tokens=True)
            out.append(now[len(prev):])
            prev = now
        return out

    def completion(self, ids: list[int], entries: list, before: list[int] = (), prompt: int = 0) -> dict:
        """Legacy completions shape; text offsets count from the start of the returned text. The
        first `prompt` ids are an echoed prompt (decoded on their own, then the rest)."""
        tokens = self.pieces(ids[:prompt]) + self.pieces(ids[prompt:], before)
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {self.text(i): lp for i, lp in e.top} for e in entries],
                "text_offset": offsets}

    def chat(self, ids: list[int], entries: list, before: list[int] = ()) -> dict:
        def one(text: str, logprob: float | None) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [one(piece, None if e is None else e.logprob)
                            | {"top_logprobs": [] if e is None else [one(self.text(t), lp) for t, lp in e.top]}
                            for piece, e in zip(self.pieces(ids, before), entries, strict=True)]}
