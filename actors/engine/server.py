"""`AsyncEngine`: the single driver of an `Engine` behind an asyncio interface — many concurrent
streams, one step loop.

Requests arrive from the event loop already validated (`GenerateRequest`); the step loop runs
`Engine.step()` in a worker thread (a step blocks for milliseconds) and, between steps, admits
new requests, drops aborted ones and publishes each request's new output to its stream. Engine
state is only touched between steps, from the event loop, so no locks are needed.

One request never hurts another: a request that cannot be served gets an `EngineError` in its
own stream; a step that fails in a way no single request explains fails that step's requests
(retryably) and the engine rebuilds its target, as after an EP-group failure; the loop goes on.
`health()` is False when the loop died, when a rebuild failed, or when work has waited longer
than `stall_timeout_s` without a step finishing — Serve then replaces the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import numpy as np

from actors.accelerator import device_usage
from actors.engine.api import Delta, EngineError, ErrorKind, GenerateRequest, Health
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine

log = logging.getLogger(__name__)

Item = Delta | EngineError
MAX_FAILURES_IN_ROW = 3


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, max_waiting: int = 256, stall_timeout_s: float = 60.0) -> None:
        self.engine = Engine(cfg)
        self.max_waiting = max_waiting
        self.stall_timeout_s = stall_timeout_s
        self._queues: dict[int, asyncio.Queue[Item]] = {}
        self._sent: dict[int, tuple[int, int]] = {}  # rid -> (tokens sent, text chars sent)
        self._new: list[tuple[int, GenerateRequest]] = []  # (rid, request): enters the engine between steps
        self._aborted: set[int] = set()
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._idle = True  # the loop waits for work (its heartbeat is not expected to move)
        self._beat = time.monotonic()  # the loop's last sign of progress
        self._fatal: str | None = None  # a rebuild failed: this engine cannot serve any more
        self.steps = 0
        self.last_step_s = 0.0

    @property
    def load(self) -> int:
        return self.engine.pending + len(self._new)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Item]:
        """Deltas of one request until it finishes, or one `EngineError` that ends the stream.
        Closing the iterator early aborts the request."""
        refusal = self._refusal(request)
        if refusal is not None:
            yield refusal
            return
        rid = self.engine.new_rid()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[rid] = queue
        self._sent[rid] = (len(request.resume), len(self.engine.text_of(request.resume)) if request.resume else 0)
        self._new.append((rid, request))
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await queue.get()
                finished = isinstance(item, EngineError) or item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._aborted.add(rid)
                self._wake.set()
            self._queues.pop(rid, None)

    def _refusal(self, request: GenerateRequest) -> EngineError | None:
        """Why this request cannot enter the engine now, if it cannot."""
        if self._fatal is not None:
            return EngineError(ErrorKind.UNAVAILABLE, f"the engine is down: {self._fatal}")
        if self.load >= self.engine.cfg.max_running + self.max_waiting:
            return EngineError(ErrorKind.OVERLOADED, f"engine is full ({self.load} requests in flight)")
        why = self.engine.invalid(request.prompt, request.params, request.resume)
        if why is not None:
            return EngineError(ErrorKind.INVALID, why)
        return None

    def _ensure_loop(self) -> None:
        if self._idle:
            self._beat = time.monotonic()  # the stall clock starts when work arrives
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        failures = 0  # in a row: a fault that a rebuild does not cure must not loop forever
        while self._fatal is None:
            self._beat, self._idle = time.monotonic(), False
            try:
                self._admit_and_abort()
                if self.engine.pending:
                    t0 = time.perf_counter()
                    await asyncio.to_thread(self.engine.step)
                    self.steps += 1
                    self.last_step_s = time.perf_counter() - t0
                    failures = 0
                self._publish()  # also what finished without a step (refused at admission)
            except Exception as exc:  # a fault of the step, not of one request
                failures += 1
                await self._recover(exc, failures)
                continue
            # Sleep only when nothing at all is pending. Requests that arrived while the step ran
            # are in `_new`, not yet in the scheduler: the wake-up they set must not be cleared
            # (the hang of multi-choice requests whose first choice finished on its first token).
            if not self._pending():
                self._idle, self._beat = True, time.monotonic()
                self._wake.clear()
                await self._wake.wait()

    def _pending(self) -> bool:
        """Work the loop has not finished: queued, running, or not yet published."""
        return bool(self.engine.pending or self._new or self._aborted
                    or any(s.finish_reason is not None and s.rid in self._queues for s in self.engine.progress()))

    async def _recover(self, exc: Exception, failures: int) -> None:
        log.exception("engine step failed; failing its requests and rebuilding the target", exc_info=exc)
        try:
            if failures > MAX_FAILURES_IN_ROW:
                raise RuntimeError(f"{failures} failures in a row without a step between them") from exc
            failed = await asyncio.to_thread(self.engine.fail_running, exc)
        except Exception as fatal:
            log.exception("rebuilding the engine failed; it is down until the replica is replaced")
            self._fatal = f"{type(fatal).__name__}: {fatal}"
            failed = []
        for s in failed:
            self._deliver(s.rid, s.error)
        if self._fatal is not None:
            for rid in list(self._queues):
                self._deliver(rid, EngineError(ErrorKind.UNAVAILABLE, f"the engine is down: {self._fatal}"))

    def _deliver(self, rid: int, item: Item) -> None:
        """Put an error in a request's stream; the request is finished for this engine."""
        self._sent.pop(rid, None)
        self.engine.claim(rid)
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(item)

    def _admit_and_abort(self) -> None:
        for rid, r in self._new:
            self.engine.submit(rid, r.prompt, r.params, r.resume)
        self._new.clear()
        aborted, self._aborted = self._aborted, set()
        for rid in aborted:
            self.engine.claim(rid)
            self._sent.pop(rid, None)
            self.engine.abort(rid)

    def _publish(self) -> None:
        for seq in self.engine.progress():
            if seq.rid not in self._queues:
                continue
            n_tok, n_txt = self._sent[seq.rid]
            done = seq.finish_reason is not None
            if seq.error is not None:
                self._deliver(seq.rid, seq.error)
                continue
            if len(seq.output) == n_tok and not done:
                continue
            text = seq.text[n_txt:] if done else _stable(seq.text[n_txt:], seq.params.stop)
            self._sent[seq.rid] = (len(seq.output), n_txt + len(text))
            p = seq.params
            self._queues[seq.rid].put_nowait(Delta(
                text, seq.output[n_tok:], done, seq.finish_reason, len(seq.prompt), len(seq.output), seq.steps,
                seq.accepted_tokens, seq.logprobs[n_tok:] if p.logprobs is not None else None,
                seq.prompt_logprobs if p.prompt_logprobs is not None and n_tok == 0 else None))
            if done:
                self.engine.claim(seq.rid)
                self._sent.pop(seq.rid, None)

    # -- what the deployment reports ----------------------------------------------------------------

    def health(self) -> Health:
        in_flight = self.load
        # Work in flight and no progress since the last beat: a running step that takes too long,
        # or a loop asleep while requests wait (a bug, which must not look healthy).
        # A rebuild under way (`Engine.recover_target`) restarts the clock: loading a large model
        # again may take longer than a step ever should, and its own timeouts bound it.
        since = max(self._beat, self.engine.rebuilding_since or 0.0)
        idle = time.monotonic() - since if in_flight else 0.0
        facts = dict(in_flight=in_flight, steps=self.steps, idle_s=idle)
        if self._fatal is not None:
            return Health(False, f"the engine could not rebuild after a failed step: {self._fatal}", **facts)
        if self._loop_task is not None and self._loop_task.done():
            return Health(False, "the step loop is not running", **facts)
        if idle > self.stall_timeout_s:
            return Health(False, f"no step finished for {idle:.0f} s with {in_flight} requests in flight", **facts)
        # A broken EP group is not a failed unit: the step that met it is rebuilding it in place,
        # and a rebuild that fails sets `_fatal`. Reporting it sooner would have Serve kill the
        # unit mid-rebuild and turn one lost rank into a lost unit (benchmarks/chaos.py found it).
        return Health(True, "", **facts)

    def stats(self) -> dict:
        """Engine-level figures for /metrics: MAT, keep ratio, cost-model error, verify tokens and
        each rank's forward time over the recent steps; load, failures survived and steps since
        start; the node's GPUs as NVML sees them (none without a driver)."""
        recs = list(self.engine.history.recent)
        drafted = sum(r.drafted for r in recs)
        reqs = sum(r.requests for r in recs)
        errors = [abs(r.predicted_verify_s - r.measured_verify_s) / r.measured_verify_s
                  for r in recs if r.measured_verify_s > 0 and np.isfinite(r.predicted_verify_s)]
        return {
            "mat": (sum(r.accepted for r in recs) + reqs) / reqs if reqs else 0.0,
            "keep_ratio": sum(r.kept for r in recs) / drafted if drafted else 0.0,
            "cost_model_error": float(np.median(errors)) if errors else 0.0,
            "predicted_verify_s": float(np.mean([r.predicted_verify_s for r in recs])) if recs and errors else 0.0,
            "measured_verify_s": float(np.mean([r.measured_verify_s for r in recs])) if recs else 0.0,
            "in_flight": self.load,
            "steps": self.steps,
            "drafter_replicas_lost": self.engine.degraded["drafter_replica_lost"],
            "drafter_context_lost": self.engine.degraded["drafter_context_lost"],
            "ep_group_rebuilds": self.engine.degraded["ep_group_rebuilt"],
            "drafter_kinds": {k: dict(c) for k, c in self.engine.drafted_by_kind.items()},
            "payoff_leads": {r: lead for r, lead in (self.engine.payoff.leads() if self.engine.payoff else {}).items()
                             if lead is not None},
            "payoff_leaders": {r: arm for r, arm in (self.engine.payoff.leaders() if self.engine.payoff else {}).items()
                               if arm is not None},  # the arm each load band plays
            "verify_tokens_per_step": sum(r.verify_tokens for r in recs) / len(recs) if recs else 0.0,
            "running": self.engine.counts()[0],
            "waiting": self.engine.counts()[1] + len(self._new),
            "rank_step_s": [float(np.mean(t)) for t in zip(*(r.rank_compute_s for r in recs if r.rank_compute_s),
                                                           strict=False)],
            "gpus": [dataclasses.asdict(d) for d in device_usage()],
            "graph_captures": self.engine.history.totals.graph_captures,
            **self.engine.gc_pauses.stats(),
        }

    def placement(self) -> dict:
        return self.engine.placement()

    async def held(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Request state kept anywhere in the unit, by owner: the streams here, and every owner
        in the engine, its ranks and drafter replicas (`Engine.held`). Waits until nothing is in
        flight; then every count is 0 unless something leaked."""
        deadline = time.monotonic() + timeout_s
        while not self._idle or self._pending():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not go idle in {timeout_s:.0f} s ({self.load} in flight)")
            await asyncio.sleep(0.05)
        # The loop sleeps until woken, and nothing below awaits: no step can start meanwhile.
        return {"queues": len(self._queues), "sent": len(self._sent), "new": len(self._new),
                "aborted": len(self._aborted), **self.engine.held()}

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
