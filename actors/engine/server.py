"""`AsyncEngine`: the engine behind an asyncio interface — many concurrent streams, one step loop.

Requests arrive from the event loop; the step loop runs `Engine.step()` in a worker thread (a
step blocks for milliseconds) and, between steps, admits new requests, drops aborted ones and
publishes each request's new tokens to its stream. Engine state is only touched between steps,
from the event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """New output of one request since the last delta."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    accepted: int = 0


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, max_waiting: int = 256) -> None:
        self.engine = Engine(cfg)
        self.max_waiting = max_waiting
        self._queues: dict[int, asyncio.Queue] = {}
        self._sent: dict[int, tuple[int, int]] = {}  # rid -> (tokens sent, text chars sent)
        self._new: list[tuple[int, list[int], SamplingParams]] = []
        self._aborted: set[int] = set()
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.steps = 0
        self.last_step_s = 0.0

    @property
    def load(self) -> int:
        return len(self.engine.scheduler) + len(self._new)

    async def stream(self, prompt: list[int], params: SamplingParams,
                     resume: list[int] | None = None) -> AsyncIterator[Delta]:
        """Deltas of one request until it finishes; closing the iterator aborts the request.
        `resume`: output already sent to the client by an engine that failed (not sent again)."""
        if self.load >= self.engine.cfg.max_running + self.max_waiting:
            raise OverloadedError(f"engine is full ({self.load} requests in flight)")
        if not prompt:
            raise ValueError("the prompt must not be empty")
        rid = self.engine.new_rid()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        resume = list(resume or [])
        if len(resume) >= params.max_tokens:
            raise ValueError("nothing left to generate: resume already holds max_tokens tokens")
        self._sent[rid] = (len(resume), len(self.engine.text_of(resume)) if resume else 0)
        self._new.append((rid, list(prompt), params, resume))
        self._ensure_loop()
        finished = False
        try:
            while True:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
                if delta.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._aborted.add(rid)
                self._wake.set()
            self._queues.pop(rid, None)

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._admit_and_abort()
            if not len(self.engine.scheduler):
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(self.engine.step)
            except Exception as exc:  # the engine unit failed: every open stream gets the error
                log.exception("engine step failed")
                for q in self._queues.values():
                    q.put_nowait(EngineFailedError(f"engine step failed: {exc}"))
                raise
            self.steps += 1
            self.last_step_s = time.perf_counter() - t0
            self._publish()

    def _admit_and_abort(self) -> None:
        for rid, prompt, params, resume in self._new:
            self.engine.scheduler.add(_sequence(rid, prompt, params, resume))
        self._new.clear()
        for rid in self._aborted:
            self.engine.abort(rid)
            self.engine.scheduler.finished.pop(rid, None)
            self._sent.pop(rid, None)
        self._aborted.clear()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        for seq in [*sched.running, *[sched.finished[r] for r in list(sched.finished) if r in self._queues]]:
            q = self._queues.get(seq.rid)
            if q is None:
                continue
            n_tok, n_txt = self._sent[seq.rid]
            done = seq.finish_reason is not None
            if len(seq.output) == n_tok and not done:
                continue
            text = seq.text[n_txt:] if done else _stable(seq.text[n_txt:], seq.params.stop)
            self._sent[seq.rid] = (len(seq.output), n_txt + len(text))
            q.put_nowait(Delta(text, seq.output[n_tok:], done, seq.finish_reason, len(seq.prompt),
                               len(seq.output), seq.steps, sum(seq.accepted)))
            if done:
                sched.finished.pop(seq.rid, None)
                self._sent.pop(seq.rid, None)

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.engine.shutdown()


def _stable(text: str, stops: tuple[str, ...]) -> str:
    """The part of new text that can be sent now: hold back a trailing replacement character (the
    rest of a multi-byte character is coming) and any tail that may be the start of a stop string
    (which must never reach the client)."""
    if text.endswith("\ufffd"):
        text = text[:-1]
    hold = max((n for s in stops for n in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:n])), default=0)
    return text[: len(text) - hold]


def _sequence(rid: int, prompt: list[int], params: SamplingParams, resume: list[int]):
    from actors.engine.sequence import Sequence

    return Sequence(rid, prompt, params, output=resume)


class OverloadedError(RuntimeError):
    """More requests in flight than the engine accepts (HTTP 429)."""


class EngineFailedError(RuntimeError):
    """The engine unit failed mid-step (HTTP 503; the client may retry)."""
