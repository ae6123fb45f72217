"""Response bodies in OpenAI's shapes: the whole response of a non-streaming request, and the
server-sent events of a streaming one (every choice's stream merged, each chunk with its choice's
index)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from actors.engine.api import Delta
from deployments.errors import ApiError
from deployments.logprobs_format import LogprobFormat
from deployments.metrics import Metrics
from deployments.openai_schema import new_id, now

log = logging.getLogger(__name__)


def best(candidates: list[dict], n: int) -> list[dict]:
    """best_of: the n candidates of highest log-probability (sum over their tokens), best first."""
    score = lambda r: sum(e.logprob for e in r["logprobs"] if e is not None)  # noqa: E731
    return sorted(candidates, key=score, reverse=True)[:n]


def full_response(body, chat: bool, results: list[dict], fmt: LogprobFormat, metrics: Metrics) -> dict:
    """The non-streaming body: every choice, usage (each prompt counted once), our `dcut` stats."""
    usage = {"prompt_tokens": sum(r["prompt_tokens"] for r in results[::body.n]),  # each prompt once
             "completion_tokens": sum(r["completion_tokens"] for r in results)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    for r in results:
        metrics.tokens(r["completion_tokens"])
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                    "finish_reason": r["finish_reason"],
                    "logprobs": fmt.chat(r["token_ids"], r["logprobs"]) if body.logprobs else None}
                   for i, r in enumerate(results)]
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": body.model,
                "choices": choices, "usage": usage}
    choices = [{"index": i, "text": (r["prompt"] if body.echo else "") + r["text"],
                "finish_reason": r["finish_reason"], "logprobs": completion_logprobs(body, r, fmt)}
               for i, r in enumerate(results)]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": body.model,
            "choices": choices, "usage": usage,
            "dcut": [{"token_ids": r["token_ids"], "steps": r["steps"], "accepted": r["accepted"]}
                     for r in results]}


def completion_logprobs(body, r: dict, fmt: LogprobFormat) -> dict | None:
    """A completion choice's `logprobs` (with `echo`, the prompt's tokens first)."""
    if body.logprobs is None:
        return None
    ids, entries = r["token_ids"], r["logprobs"]
    if not body.echo:
        return fmt.completion(ids, entries)
    prompt = r["prompt_ids"]  # the prompt's tokens first (its first token has no log-probability)
    return fmt.completion([*prompt, *ids], [*(r["prompt_logprobs"] or [None] * len(prompt)), *entries],
                          prompt=len(prompt))


async def sse(streams: list, firsts: list[Delta], body, chat: bool, prompt_tokens: int, fmt: LogprobFormat,
              metrics: Metrics):
    """One SSE response for every choice's stream: chunks go out as each choice's deltas
    arrive, each carrying its choice's index; usage (when asked) after the last."""
    cid, created = new_id("chatcmpl" if chat else "cmpl"), now()
    kind = "chat.completion.chunk" if chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream, delta: Delta) -> None:
        try:
            while True:
                await queue.put((index, delta, None))
                if delta.finished:
                    break
                delta = await stream.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as exc:
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    sent = {index: [] for index, _ in streams}  # tokens streamed per choice: token texts continue them
    timing = {index: (time.perf_counter(), None, 0) for index, _ in streams}  # start, last chunk, tokens then
    last = dict(zip((i for i, _ in streams), firsts, strict=True))

    continuous = body.stream_options is not None and body.stream_options.continuous

    def chunk(index: int, d: Delta | None, role: bool = False) -> str:
        text, finish = (d.text, d.finish_reason if d.finished else None) if d is not None else (None, None)
        lp = None
        if d is not None and d.logprobs is not None and d.token_ids:
            lp = (fmt.chat if chat else fmt.completion)(d.token_ids, d.logprobs, sent[index])
            sent[index].extend(d.token_ids)
        if chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lp}
        event = {"id": cid, "object": kind, "created": created, "model": body.model, "choices": [choice]}
        if continuous:  # this choice's usage so far (vLLM's continuous_usage_stats)
            first = d if d is not None else last[index]
            done = d.completion_tokens if d is not None else 0
            event["usage"] = {"prompt_tokens": first.prompt_tokens, "completion_tokens": done,
                              "total_tokens": first.prompt_tokens + done}
        return "data: " + json.dumps(event) + "\n\n"

    tasks = [asyncio.create_task(pump(index, st, first)) for (index, st), first in zip(streams, firsts,
                                                                                          strict=True)]
    live = len(tasks)
    try:
        if chat:
            for index, _ in streams:
                yield chunk(index, None, role=True)
        while live:
            index, delta, err = await queue.get()
            if delta is None:
                live -= 1
                if err is None:
                    continue
                body_ = err.body() if isinstance(err, ApiError) else \
                    ApiError(500, f"internal error: {type(err).__name__}", "server_error").body()
                if not isinstance(err, ApiError):
                    log.error("stream failed", exc_info=err)
                yield "data: " + json.dumps(body_) + "\n\n"  # the engine failed mid-stream: say so in-band
                break
            t0, t_prev, n_prev = timing[index]
            now_t = time.perf_counter()
            if t_prev is None:
                metrics.ttft(now_t - t0)
            elif delta.completion_tokens > n_prev:
                metrics.tpot((now_t - t_prev) / (delta.completion_tokens - n_prev))
            timing[index], last[index] = (t0, now_t, delta.completion_tokens), delta
            if delta.text or delta.finished or (delta.logprobs and delta.token_ids):
                yield chunk(index, delta)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, st in streams:
            await st.aclose()  # a client that went away frees each request's KV and drafter state
    completion = sum(d.completion_tokens for d in last.values())
    metrics.tokens(completion)
    if body.stream_options and body.stream_options.include_usage:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}
        yield "data: " + json.dumps({"id": cid, "object": kind, "created": created, "model": body.model,
                                     "choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"
