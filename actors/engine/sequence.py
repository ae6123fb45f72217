"""Requests and their lifecycle. The scheduler is the only owner of sequence state."""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from actors.engine.detokenize import IncrementalText
from actors.engine.errors import EngineError, ErrorKind
from actors.engine.logprobs import entries

if TYPE_CHECKING:
    from actors.engine.stages import Feed, Step

SAMPLING_EPS = 1e-5  # below this temperature a request decodes greedily (vLLM's threshold too)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # each committed token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo); then max_tokens may be 0
    # Controls on the target's distribution (actors/target/sampling.py), neutral by default:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # finish (reason "stop") after any of these
    min_tokens: int = 0  # no EOS or stop token id, and no stop string, before this many tokens
    constraint: tuple[str, str] | None = None  # structured output: (kind, spec), actors/engine/grammar.py
    drafters: tuple[str, ...] | None = None  # the drafter kinds this request may draft with (None: any served)

    def __post_init__(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError("max_tokens must be at least 1 (0 only when the prompt's log-probabilities are asked "
                             "for)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 20):
                raise ValueError(f"{name} must be an integer in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not 0 <= self.top_k < 2**31 or not 0.0 <= self.min_p <= 1.0 or self.min_tokens < 0:
            raise ValueError("top_k must be in [0, 2^31), min_tokens >= 0, min_p in [0, 1]")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError("top_p must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError("seed must be an integer")

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS decode greedily: their limit is the argmax, and the
        target computes in float32, where 1e-151 is 0 — one rule for the engine and the target."""
        return self.temperature < SAMPLING_EPS

    @cached_property
    def plain_commit(self) -> bool:
        """No stop string, stop token id or log-probabilities: committing its tokens needs only
        its room and the EOS (`Scheduler.append`'s fast path)."""
        return not self.stop and not self.stop_token_ids and self.logprobs is None

    @property
    def sampling(self) -> tuple[float, float]:
        """(temperature, top_p) as the target applies them: temperature 0 for a greedy request."""
        return (0.0 if self.greedy else self.temperature, self.top_p)

    def controls(self, eos: int | None):
        """The controls the target applies to this request's rows, or None when all are neutral."""
        from actors.target.sampling import Controls

        banned = tuple({*((eos,) if eos is not None and not self.ignore_eos else ()), *self.stop_token_ids})
        c = Controls(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.logit_bias,
                     self.min_tokens if banned else 0, banned if self.min_tokens else (), self.top_k, self.min_p)
        return c if c.changes_logits or c.top_k or c.min_p else None


def seed_sequence(seed: int | None) -> np.random.SeedSequence | None:
    """A request's generator seed from any integer the OpenAI API accepts, deterministically and
    one-to-one: a non-negative seed as numpy takes it (so `default_rng(seed)` reproduces it),
    a negative one in a stream of its own (numpy rejects negative seeds)."""
    if seed is None:
        return None
    if seed >= 0:
        return np.random.SeedSequence(seed)
    return np.random.SeedSequence(-seed, spawn_key=(1,))


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request that asks for several (`n`, `best_of`): the
    request's own for the first (so n = 1 is unchanged), then a distinct one derived from it —
    a seeded request reproduces every choice; an unseeded one stays unseeded."""
    if seed is None or index == 0:
        return seed
    ss = seed_sequence(seed)
    child = np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, 2, index))
    return int(child.generate_state(1, np.uint64)[0])


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its prompt, what it has committed, and its per-step record."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (then `error` says why)
    error: EngineError | None = None
    detokenize: Callable[[list[int]], str] | None = field(default=None, repr=False)  # token ids -> text
    rng: np.random.Generator = field(default=None, repr=False)
    steps: int = 0
    # (step, kind, drafted, kept, accepted) of each step that drafted for it; its per-step lists
    # (`drafted`, `kept`, `accepted`, `kinds`) are built from these when read. Four appends a
    # request every step had been a quarter of the commit's per-request Python at 1,024 requests,
    # and a plain step's records are all zero (docs/benchmarks.md, session 42).
    drafting_steps: list[tuple[int, int, int, int, int]] = field(default_factory=list, repr=False)
    # sum(accepted), kept as it grows: every streamed delta reports it, and summing the list there
    # was O(steps) a request a step (3 ms a step for 1,024 streams 500 steps long)
    accepted_tokens: int = 0
    controls: object = None  # sampling.Controls, set at admission (None: the target's plain distribution)
    grammar: object = None  # grammar.RequestGrammar, set at admission for a constrained request
    fed: int = 0  # tokens of `feed` already in the target's KV cache (while prefilling)
    prefilled: bool = False  # its feed is in the KV cache: it decodes from now on
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token (params.logprobs set)
    prompt_logprobs: list = field(default_factory=list)  # per prompt token (the first: None), with echo
    _uniforms: list[float] = field(default_factory=list, repr=False)
    _text: IncrementalText | None = field(default=None, repr=False)  # the output's text, as it grows
    # (the text's rewrites, its settled length) at the last stop-string search (`stop_hits`)
    _stop_seen: tuple[int, int] = field(default=(0, 0), repr=False)

    def __post_init__(self) -> None:
        if self.rng is None:
            self.rng = np.random.default_rng(seed_sequence(self.params.seed))
        if self.params.logprobs is not None and self.output and not self.logprobs:
            self.logprobs = [None] * len(self.output)  # resumed: those tokens' entries went out before

    @property
    def drafted(self) -> list[int]:
        """Per step: the drafts made for it (0: none)."""
        return self._per_step(2, 0)

    @property
    def kept(self) -> list[int]:
        """Per step: the drafts verified (kept by pruning)."""
        return self._per_step(3, 0)

    @property
    def accepted(self) -> list[int]:
        """Per step: the drafts accepted."""
        return self._per_step(4, 0)

    @property
    def kinds(self) -> list[int]:
        """Per step: the drafter kind (index) that drafted for it, -1 none."""
        return self._per_step(1, -1)

    def _per_step(self, column: int, none: int) -> list[int]:
        out = [none] * self.steps
        for row in self.drafting_steps:
            out[row[0]] = row[column]
        return out

    def uniforms(self, start: int, n: int) -> np.ndarray:
        """The sampling uniforms of output positions start .. start+n-1: drawn once per position,
        in order, from the request's seeded stream, and kept — so position t's uniform never
        depends on how many drafts earlier steps verified."""
        while len(self._uniforms) < start + n:
            self._uniforms.append(float(self.rng.random()))
        return np.asarray(self._uniforms[start:start + n])

    @property
    def text(self) -> str:
        """The output as text: decoded when read, and then only its newest tokens (a request
        nobody streams is decoded once, at its end, not every step; actors/engine/detokenize.py)."""
        if self._text is None:
            if self.detokenize is None:
                return ""
            self._text = IncrementalText(self.detokenize)
        return self._text.text(self.output)

    def stop_hits(self, stops: tuple[str, ...]) -> list[tuple[int, str]]:
        """(where, which) of each of `stops` found in the output's text, at its first occurrence:
        searched from where the last search left off, less the longest stop string (one may
        straddle that point) — the settled text before it never changes unless the text was
        worked out from the start again (then from the start). The whole text every step had
        cost O(length) a request a step: 9.6 ms a step at 1,024 requests of 8,000 characters
        with two stop strings (docs/benchmarks.md, session 41)."""
        text, inc = self.text, self._text
        if inc is None:
            return []
        rewrites, seen = self._stop_seen
        start = max(0, seen - max(map(len, stops)) + 1) if rewrites == inc.rewrites else 0
        self._stop_seen = (inc.rewrites, len(inc.settled))
        return [(at, s) for s in stops if (at := text.find(s, start if s else 0)) >= 0]

    def end_text(self, text: str) -> None:
        """The final text, shorter than the output's decoding (cut at a stop string)."""
        if self._text is None:
            self._text = IncrementalText(self.detokenize or (lambda ids: ""))
        self._text.end(len(self.output), text)

    @property
    def last(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def feed(self) -> list[int]:
        """What prefill puts in the KV cache: the prompt and, for a resumed request, the output
        it already has except the newest token (which its first decode step appends)."""
        return [*self.prompt, *self.output[:-1]]

    @property
    def feed_len(self) -> int:
        """len(feed), without building it."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    @property
    def cached(self) -> int:
        """Tokens in the target's KV cache: everything committed except the newest token."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    @cached_property
    def greedy(self) -> bool:
        """Its parameters' (fixed for its life): read for every request of every step."""
        return self.params.greedy


def _commit_plain(seq: Sequence, params: SamplingParams, tokens: list[int], eos: int | None) -> list[int]:
    """A batch's usual request (no stop strings or ids, no log-probabilities, no grammar): the
    tokens up to its room and its first EOS, in C-level list operations — token by token was ~1
    µs a request, a millisecond a step at 1,024 requests."""
    output = seq.output
    kept = tokens[:max(params.max_tokens - len(output), 0)]
    if not params.ignore_eos and eos is not None and eos in kept:
        del kept[kept.index(eos) + 1:]
        seq.finish_reason = "stop"
    output += kept
    if seq.finish_reason is None and len(output) >= params.max_tokens:
        seq.finish_reason = "length"
    return kept


@dataclass
class Census:
    """How many running requests have each need a step looks for, counted as requests enter and
    leave the running set (and as their prefill ends): where a count is 0 a step skips a pass
    over its batch that would find nothing (each pass had been 40–60 µs at 1,024 requests;
    docs/benchmarks.md, session 43). Above 0 the step looks at each request as before: a
    request counted need not be in this step's forward."""

    unfed: int = 0  # not prefilled yet (exact)
    sampling: int = 0  # temperature above SAMPLING_EPS
    logprobs: int = 0  # log-probabilities of its output or of its prompt
    controls: int = 0  # sampling controls (`Sequence.controls`) or a grammar
    drafters: int = 0  # names the drafter kinds it may use

    def count(self, seq: Sequence, sign: int) -> None:
        p = seq.params
        self.unfed += sign * (not seq.prefilled)
        self.sampling += sign * (not seq.greedy)
        self.logprobs += sign * (p.logprobs is not None or p.prompt_logprobs is not None)
        self.controls += sign * (seq.controls is not None or p.constraint is not None)
        self.drafters += sign * bool(p.drafters)


class Scheduler:
    """Admits waiting requests up to `max_running`; the one place sequences change state."""

    def __init__(self, max_running: int, detokenize: Callable[[list[int]], str], eos: int | None = None) -> None:
        self.max_running = max_running
        self.detokenize = detokenize  # token ids -> text: each admitted request's, and the stop-string search's
        self.eos = eos  # the model's end-of-sequence token: what a request's sampling controls ban before min_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self.census = Census()  # of `running`

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self, kv_budget: int | None = None, block: int = 0) -> list[Sequence]:
        """Move waiting requests into the running set, first come first served, while the running
        set's worst-case KV footprint (prompt + max_tokens + one block of drafts each) stays
        within kv_budget tokens; returns the newly admitted ones. A request that could never fit
        is finished with an error instead of blocking the queue."""
        new: list[Sequence] = []
        if not self.waiting:  # the usual step: nobody to admit, no footprint to add up
            return new
        used = sum(self.footprint(s, block) for s in self.running)
        while self.waiting and len(self.running) < self.max_running:
            need = self.footprint(self.waiting[0], block)
            if kv_budget is not None and need > kv_budget:
                self.fail([self.waiting[0]], EngineError(ErrorKind.INVALID, "request exceeds the KV cache"))
                continue
            if kv_budget is not None and used + need > kv_budget:
                break
            used += need
            seq = self.waiting.popleft()
            seq.status, seq.detokenize = Status.RUNNING, self.detokenize  # its text is decoded when read
            seq.controls = seq.params.controls(self.eos)
            self.running.append(seq)
            self.census.count(seq, +1)
            new.append(seq)
        return new

    @staticmethod
    def footprint(seq: Sequence, block: int) -> int:
        return len(seq.prompt) + seq.params.max_tokens + block

    def append(self, seq: Sequence, tokens: list[int], eos: int | None,
               logprob_rows: np.ndarray | None = None) -> list[int]:
        """Commit tokens to seq, applying stop conditions; returns the tokens actually kept.
        `logprob_rows[t]`: the target's log-softmax row of tokens[t] (for requests that asked)."""
        params, output = seq.params, seq.output
        if params.plain_commit and seq.grammar is None:
            return _commit_plain(seq, params, tokens, eos)
        room = params.max_tokens - len(output)
        eos = None if params.ignore_eos else eos
        kept: list[int] = []
        for t in tokens:
            if room <= 0:
                break
            output.append(t)
            kept.append(t)
            room -= 1
            if t == eos or t in params.stop_token_ids:
                seq.finish_reason = "stop"
                break
        least = max(1, params.min_tokens)  # no stop string before min_tokens
        hits = seq.stop_hits(params.stop) if params.stop and len(output) >= least else []
        if hits:
            text = seq.text
            # Keep the shortest output whose text holds the stop string: the tokens a step-by-step
            # decoder would have produced, whatever a speculative step committed past it. The
            # output before this call's tokens held none (its text was searched, or it was shorter
            # than min_tokens), so only this call's tokens are tried — every prefix from the
            # start had been ~190 ms at 2,000 tokens, on the step where the request stopped.
            first = max(least, len(seq.output) - len(kept) + 1)
            n = next(n for n in range(first, len(seq.output) + 1) if any(s in self.detokenize(seq.output[:n]) for s in
                                                                          seq.params.stop))
            kept = kept[: max(0, len(kept) - (len(seq.output) - n))]
            del seq.output[n:]
            seq.end_text(text[:min(a for a, _ in hits)])
            seq.finish_reason = "stop"
        if seq.finish_reason is None and len(seq.output) >= params.max_tokens:
            seq.finish_reason = "length"
        if seq.params.logprobs is not None and logprob_rows is not None:
            seq.logprobs.extend(entries(logprob_rows, kept, seq.params.logprobs))
        if seq.grammar is not None:
            seq.grammar.commit(kept)
        return kept

    def record_step(self, st: Step, eos: int | None) -> list[list[int]]:
        """A decode step's outcome for each request of its batch: its record (drafts made, the
        kind that made them, kept, accepted) and its new tokens (`append`: stop conditions,
        log-probabilities, grammar). Returns the tokens each request kept."""
        drafted, kept, kinds = st.drafts.counts.tolist(), st.pruned.kept.tolist(), st.drafts.kinds.tolist()
        accepted, emitted = st.accepted.counts, st.accepted.emitted
        n = len(st.batch)
        logprobs = st.out.logprobs[:n] if st.out.logprobs else [None] * n  # its rows: the batch's, then the feeds'
        committed: list[list[int]] = []
        committed_append, append = committed.append, self.append
        # One pass, the usual request's commit called directly (`append`'s call and arguments had
        # been ~0.2 µs a request of this loop's ~0.6 at 1,024 requests).
        for s, d, k, kind, a, tokens, rows in zip(st.batch, drafted, kept, kinds, accepted, emitted, logprobs,
                                                  strict=True):
            if d:  # accepted <= kept <= drafted: a step that drafted nothing for it leaves zeros
                s.drafting_steps.append((s.steps, kind, d, k, a))
                s.accepted_tokens += a
            s.steps += 1
            params = s.params
            committed_append(_commit_plain(s, params, tokens, eos) if params.plain_commit and s.grammar is None
                             else append(s, tokens, eos, rows))
        return committed

    def advance_prefill(self, st: Step, eos: int | None) -> list[tuple[Sequence, list[int], int]]:
        """Advance prefill by the step's chunks (the target's output rows after its decode
        batch's): a fresh prompt fed to its end draws its first token — the target's argmax, or
        its draw with the request's first uniform (made on the rank). Returns what the drafters
        must commit: (request, tokens, positions the target has processed, whose features its
        rank now holds)."""
        out, offset = st.out, len(st.batch)
        commits, fresh = [], []
        for j, f in enumerate(st.feeding):
            s, tokens = f.seq, list(f.tokens)
            if s.params.prompt_logprobs is not None and not s.output:
                _prompt_logprobs(s, f, out.logprobs[offset + j])
            s.fed += len(tokens)
            if s.fed == s.feed_len:
                s.prefilled = True
                self.census.unfed -= 1
                if s.output:  # resumed: its newest token is appended by its first decode step
                    tokens.append(s.output[-1])
                else:
                    first = out.tokens(offset + j)  # the argmax, or the request's draw where it samples
                    lp = out.logprobs[offset + j] if out.logprobs is not None else None
                    fresh.append((s, int(first[-1]), None if lp is None else lp[-1:]))
            commits.append((s, tokens, s.fed))
        for s, tok, lp in fresh:
            self.append(s, [tok], eos, lp)
        first = {s.rid: s.output[-1] for s, _, _ in fresh if s.output}  # (max_tokens 0: none)
        return [(s, [*t, first[s.rid]] if s.rid in first else t, h) for s, t, h in commits]

    def refeed(self) -> None:
        """Every running request is fed to the target again (a new EP group holds no KV)."""
        for s in self.running:
            s.fed, s.prefilled = 0, False
        self.census.unfed = len(self.running)

    def decoding(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decoding, not prefilled yet): the running requests split by their prefill, in order."""
        if not self.census.unfed:
            return list(self.running), []
        return [s for s in self.running if s.prefilled], [s for s in self.running if not s.prefilled]

    def finish_done(self) -> list[Sequence]:
        done = [s for s in self.running if s.finish_reason is not None]
        if not done:
            return done
        for s in done:
            s.status = Status.FINISHED
            self.finished[s.rid] = s
            self.census.count(s, -1)
        self.running = [s for s in self.running if s.finish_reason is None]
        return done

    def fail(self, seqs: list[Sequence], error: EngineError) -> None:
        """These waiting or running requests end with `error`: finished, kept until their
        result is claimed (`claim`)."""
        for seq in seqs:
            self._remove(seq)
            seq.status, seq.finish_reason, seq.error = Status.FINISHED, "error", error
            self.finished[seq.rid] = seq

    def abort(self, rid: int) -> Sequence | None:
        """Drop a waiting or running request (its client left; nobody claims it); returns it,
        finished, or None if it was neither."""
        seq = next((s for s in [*self.waiting, *self.running] if s.rid == rid), None)
        if seq is not None:
            self._remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return seq

    def claim(self, rid: int) -> Sequence | None:
        """A finished request's result, handed over once (None: not finished, or claimed)."""
        return self.finished.pop(rid, None)

    def _remove(self, seq: Sequence) -> None:
        """Out of the waiting or running set (by identity: a sequence's fields are no key)."""
        if seq.status is Status.RUNNING:
            self.running = [s for s in self.running if s is not seq]
            self.census.count(seq, -1)
        elif seq.status is Status.WAITING:
            self.waiting = deque(s for s in self.waiting if s is not seq)

    def get(self, rid: int) -> Sequence | None:
        return next((s for s in [*self.running, *self.waiting] if s.rid == rid), self.finished.get(rid))

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)


def _prompt_logprobs(seq: Sequence, feed: Feed, rows: np.ndarray) -> None:
    """Record the prompt tokens' log-probabilities from a prefill chunk's rows: row r (position
    start + r) is the target's distribution of the token at start + r + 1; the first prompt
    token has none (None)."""
    if feed.start == 0:
        seq.prompt_logprobs.append(None)
    end = min(len(feed.tokens), len(seq.prompt) - 1 - feed.start)  # rows that predict a prompt token
    if end > 0:
        nxt = seq.prompt[feed.start + 1:feed.start + 1 + end]
        seq.prompt_logprobs.extend(entries(rows[:end], nxt, seq.params.prompt_logprobs))
