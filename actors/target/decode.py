"""Plain autoregressive decoding (the `ar` baseline) and chunked prefill, over any target with
the `EPGroup` interface (`EPGroup` or `LocalTarget`)."""

from __future__ import annotations

from collections.abc import Sequence


def prefill(target, request_ids: Sequence[int], prompts: Sequence[Sequence[int]], chunk_tokens: int = 512) -> list[int]:
    """Feed each prompt in chunks of at most chunk_tokens per request per forward; return the
    target's greedy next token after each prompt."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must not be empty")
    done = [0] * len(prompts)
    first: list[int] = [-1] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        active = [i for i, (d, p) in enumerate(zip(done, prompts, strict=True)) if d < len(p)]
        chunks = [list(prompts[i][done[i]:done[i] + chunk_tokens]) for i in active]
        out = target.forward([request_ids[i] for i in active], chunks, logits="last")
        last = out.argmax[out.rows_cu[1:] - 1].tolist()  # each request's last row
        for i, c, tok in zip(active, chunks, last, strict=True):
            done[i] += len(c)
            if done[i] == len(prompts[i]):
                first[i] = tok
    return first


def greedy_decode(target, request_ids: Sequence[int], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_token_id: int | None = None, chunk_tokens: int = 512) -> list[list[int]]:
    """Greedy continuation of every prompt, one token per request per step, all in one batch."""
    nxt = prefill(target, request_ids, prompts, chunk_tokens)
    outputs: list[list[int]] = [[t] for t in nxt]
    live = [i for i in range(len(prompts)) if max_new_tokens > 1 and nxt[i] != eos_token_id]
    while live:
        out = target.forward([request_ids[i] for i in live], [[outputs[i][-1]] for i in live], logits="last")
        still = []
        for i, tok in zip(live, out.argmax[out.rows_cu[1:] - 1].tolist(), strict=True):
            outputs[i].append(tok)
            if len(outputs[i]) < max_new_tokens and outputs[i][-1] != eos_token_id:
                still.append(i)
        live = still
    for out in outputs:
        del out[max_new_tokens:]
    return outputs
