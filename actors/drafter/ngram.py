"""`NgramDrafter`: prompt-lookup drafting, no model.

For a request's token history, find earlier occurrences of its last n tokens (longest n first,
`max_n` down to `min_n`) and propose what followed the most recent one — copied on over itself
where it runs into the history's end (`History.after`: the text repeats). Each history keeps an
index of its n-grams as tokens are committed (`History`): a lookup does not rescan the context. Confidence of draft j
comes from the match statistics: of the occurrences found, the share whose continuation agrees
with the draft up to j, smoothed toward a prior that grows with n. The top-2 margin is the
share of the most common next token minus the runner-up, among occurrences agreeing so far.
The statistics count the `recent` most recent occurrences only: a common token in a long
context occurs thousands of times, and counting every continuation would cost milliseconds a
request (evidence that old says little of what follows now).

Where a request's own history has no match at all, the drafter looks in its `Corpus`: the
outputs of the requests it served before (what the target itself wrote), indexed by n-gram as
they finish; a match there drafts as one occurrence in the request's own text would. A model
repeats itself across requests as within one: on the mixed workload's training prompts the
corpus drafts at 14 % of steps that had no draft, and lifts the mean accepted length by ~10 % at
one request (docs/benchmarks.md, session 30). Drafts only propose, so outputs stay the target's;
what another request's output can change is how fast a request runs (a timing side channel
between tenants, as with a shared prefix cache): `corpus_tokens=0` turns it off.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate
from operator import sub

import numpy as np

from actors.drafter.base import DraftOutput


class NgramDrafter:
    """Prompt-lookup drafts with match-statistics confidences; owns each request's history."""

    def __init__(self, max_n: int = 4, min_n: int = 1, block_size: int = 16, prior_strength: float = 1.0,
                 recent: int = 32, corpus_tokens: int = 0) -> None:
        self.max_n, self.min_n, self.block = max_n, min_n, block_size
        self.prior_strength, self.recent = prior_strength, recent
        self._history: dict[int, History] = {}
        self.corpus = Corpus(corpus_tokens, max_n=max_n) if corpus_tokens > 0 else None
        self._finished: list[list[int]] = []  # released requests' outputs not yet in the corpus

    def commit(self, request_ids: list[int], tokens: list[list[int]], features=None) -> None:
        """Append newly committed tokens (prompt included) to each request's history."""
        for rid, toks in zip(request_ids, tokens, strict=True):
            if rid not in self._history:
                self._history[rid] = History(self.min_n, self.max_n)
            self._history[rid].extend(toks)

    def follow(self, request_ids: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """Bring each request's history up to its prompt and output so far (what it holds is a
        prefix of them: only the tokens past it are added). The coordinator's look-ahead
        follows its sequences this way, with no commit calls to make."""
        histories = self._history
        for rid, prompt, output in zip(request_ids, prompts, outputs, strict=True):
            history = histories.get(rid)
            if history is None:
                history = histories[rid] = History(self.min_n, self.max_n)
            have, fed = len(history.tokens), len(prompt)
            if have < fed:
                history.extend(prompt[have:])
                have = fed
            new = output[have - fed:]
            if new:
                history.extend(new)

    def ingest(self, rid: int, start: int, tokens: list[int], prompt_len: int) -> None:
        """Prompt tokens `start` on (of a prompt of `prompt_len`) into the request's history, if it
        ends at `start`: a chunk fed again after a rebuild, or one `follow` has taken in already,
        changes nothing."""
        history = self._history.get(rid)
        if history is None:
            history = self._history[rid] = History(self.min_n, self.max_n)
        if len(history.tokens) == start:
            history.extend(tokens)
            history.first = prompt_len  # what follows it is output (`release`)

    def truncate(self, lengths: dict[int, int]) -> None:
        for rid, n in lengths.items():
            self._history[rid].truncate(n)

    def release(self, request_ids: list[int]) -> None:
        """Forget the requests' histories; their outputs (the history past the prompt, with the
        prompt's last n-gram; nothing for a request released before its first token) wait for
        `absorb`."""
        for rid in request_ids:
            history = self._history.pop(rid, None)
            if history is not None and self.corpus is not None and len(history.tokens) > history.first:
                self._finished.append(history.tokens[max(0, history.first - self.max_n):])

    def absorb(self, keep: bool = True, leave: int = 0) -> None:
        """The released requests' outputs into the corpus (~0.6 µs a token here: the engine
        does it where it learns from a step, behind the next forward on a GPU), or dropped
        (`keep` False); the newest `leave` of them left waiting (a trace's walk as a closed loop
        at concurrency leave + 1 sees the corpus)."""
        finished = self._finished
        n = len(finished) - leave
        if n <= 0:  # the engine's usual step: nothing released
            return
        for tokens in (finished[:n] if leave else finished) if keep else ():
            self.corpus.add(tokens)
        del finished[:n]

    def forget_outputs(self) -> None:
        """Empty the corpus, and drop the outputs waiting for it."""
        self._finished.clear()
        if self.corpus is not None:
            self.corpus.clear()

    def held_requests(self) -> set[int]:
        return set(self._history)

    def draft(self, request_ids: list[int], last_tokens: list[int], lengths: list[int], temperature: float = 0.0,
              rng: np.random.Generator | None = None) -> DraftOutput:
        """Drafts follow each request's history, whose last token must be last_tokens[i]."""
        toks, confs, margins, counts = [], [], [], []
        for rid, last, want in zip(request_ids, last_tokens, lengths, strict=True):
            history = self._history.get(rid)
            if history is None or not history.tokens or history.tokens[-1] != last:
                raise ValueError(f"request {rid}: last token {last} is not the end of its committed history")
            d, c, m = self._lookup(history, min(want, self.block - 1))
            toks += d
            confs += c
            margins += m
            counts.append(len(d))
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        return DraftOutput(np.asarray(toks, dtype=np.int64), cu, np.asarray(confs, dtype=np.float64),
                           np.asarray(margins, dtype=np.float64))

    def peek(self, request_ids: list[int], lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [N], cu [R + 1]): the drafts `draft` would make for these requests, without
        their confidences (the continuation of the most recent match: a dict access or two a
        request, where the confidences of a many-times-repeated n-gram cost tens of µs)."""
        out, counts = [], []
        for rid, want in zip(request_ids, lengths, strict=True):
            history, want = self._history[rid], min(want, self.block - 1)
            n, starts = self._match(history, want, 1)
            if starts:
                d = history.after(starts[0] + n, want)
            else:
                d = self.corpus.follow(history.tokens, want)[1] if self.corpus is not None and want > 0 else []
            out += d
            counts.append(len(d))
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        return np.asarray(out, dtype=np.int64), cu

    def _match(self, history: History, want: int, recent: int) -> tuple[int, list[int]]:
        """(n, start positions newest first, at most `recent`) of the longest n-gram ending the
        history that occurred before with a token after it; (0, []) when none did or nothing is
        wanted."""
        return history.match(self.min_n, recent) if want > 0 else (0, [])

    def _lookup(self, history: History, want: int) -> tuple[list[int], list[float], list[float]]:
        h = history.tokens
        n, starts = self._match(history, want, self.recent)
        if starts:
            if len(starts) == 1:  # one occurrence (the common case): all its evidence agrees
                return self._one_occurrence(n, history.after(starts[0] + n, want))
            return self._statistics(n, [history.after(s + n, want) for s in starts])
        if self.corpus is not None and want > 0:  # another request's output: one occurrence, as of its own
            return self._one_occurrence(*self.corpus.follow(h, want))
        return [], [], []

    def _statistics(self, n: int, follow: list[list[int]]) -> tuple[list[int], list[float], list[float]]:
        """The draft (the most recent occurrence's continuation, `follow[0]`) with each position's
        confidence and margin among the occurrences that agree with it so far — each confidence
        is conditional on the drafts before it. An occurrence counts at every position up to the
        one where it leaves the draft (there it counts for its own token) or ends, so one pass
        over the occurrences finds each one's agreement length, and only the tokens that
        diverge at a position are tallied there: O(occurrences + draft), not their product."""
        draft = follow[0]
        size = len(draft)
        # Occurrences agreeing with the draft on exactly L tokens (one longer than the draft that
        # agrees with all of it counts at its own length: past the draft, nothing is asked).
        ends = [0] * (max(map(len, follow)) + 1)
        ends[size] = 1  # the draft's own
        leave: dict[int, list[int]] = {}  # position -> the tokens of the occurrences leaving the draft there
        for f in follow[1:]:
            if f[:size] == draft[:len(f)]:  # agrees as far as both go
                ends[len(f)] += 1
                continue
            j = 0
            while f[j] == draft[j]:
                j += 1
            ends[j] += 1
            leave.setdefault(j, []).append(f[j])
        prior, strength = self.prior_strength * (n / (n + 1.0)), self.prior_strength  # longer matches: more trust
        agree = list(accumulate(ends[:size], sub, initial=len(follow)))[1:]  # still agreeing past each position
        confs = [(a + prior) / (a + strength) for a in agree]
        margins = [1.0] * size
        for j, others in leave.items():  # where some leave the draft, they count for their own tokens
            total = agree[j] + len(others)
            top = sorted([agree[j], *Counter(others).values()], reverse=True)
            confs[j] = (agree[j] + prior) / (total + strength)
            margins[j] = (top[0] - top[1]) / total
        return list(draft), confs, margins

    def _one_occurrence(self, n: int, draft: list[int]) -> tuple[list[int], list[float], list[float]]:
        """A draft from one occurrence of an n-gram: all its evidence agrees."""
        one = (1 + self.prior_strength * n / (n + 1.0)) / (1 + self.prior_strength)
        return draft, [one] * len(draft), [1.0] * len(draft)


class History:
    """One request's committed tokens and, for each n-gram length, where every n-gram occurs
    with a token after it — kept up to date as tokens are appended, so a lookup costs a dict
    access instead of a scan of the whole context (which grows with it: 32 k tokens on a GPU).

    Per length n, as a compressor's match finder keeps them (hash chains): `head[key]` is the
    start of the n-gram's most recent occurrence and `prev[s]` the start of the occurrence before
    the one at s (−1: none), so the occurrences are a chain from the newest back. An n-gram's key
    is an int, its tokens' ids packed `BITS` bits apiece (the newest lowest): one rolling int holds
    the last `max_n` tokens and the key of the last n is its low n fields — a shift, an or and a
    mask a token. Nothing the index holds is an object the cyclic garbage collector tracks but
    its few lists: it had held a tuple key and a list of starts per n-gram, and at 1,024 requests
    those were most of what the collector scanned — and a dict of ints alone is untracked until
    a container goes in, then tracked anew in the youngest generation, so an index that grew a
    list now and then set off young collections that walked whole indexes (docs/benchmarks.md,
    session 40). Token ids must lie in [0, 2 ** BITS): a vocabulary's do (the engine refuses a
    prompt outside it)."""

    BITS = 32

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tokens: list[int] = []
        self.first = 0  # tokens in the first extend: the prompt, as the engine and a trace's walk feed it
        self.low = {n: (1 << self.BITS * n) - 1 for n in range(1, max_n + 1)}  # the key of the last n: last & low[n]
        # n -> (head: key -> newest start, prev: start -> the start before it of the same n-gram, or −1)
        self.chains: dict[int, tuple[dict[int, int], list[int]]] = {n: ({}, []) for n in range(min_n, max_n + 1)}
        self.lengths = [(n, head, prev, self.low[n]) for n, (head, prev) in self.chains.items()]  # n ascending
        self.longest, self.mask = max_n, self.low[max_n]
        self.last = 0  # the last max_n tokens, packed (fewer while the history is shorter: zeros above)

    def extend(self, tokens) -> None:
        h = self.tokens
        if not h:
            self.first = len(tokens)
        end, last, bits, mask, lengths = len(h), self.last, self.BITS, self.mask, self.lengths
        for t in tokens:  # the n-grams ending at `end` (just before the new token) now have a successor
            for n, head, prev, low in lengths:
                if end < n:
                    break
                key = last & low
                prev.append(head.get(key, -1))  # prev[end - n]: the n-gram at end − n's previous occurrence
                head[key] = end - n
            t = int(t)
            h.append(t)
            last = ((last << bits) | t) & mask
            end += 1
        self.last = last

    def _packed(self, end: int) -> int:
        """The packed key of the (up to max_n) tokens before position `end`."""
        key = 0
        for t in self.tokens[max(0, end - self.longest):end]:
            key = (key << self.BITS) | t
        return key

    def truncate(self, length: int) -> None:
        h = self.tokens
        while len(h) > length:
            end = len(h) - 1  # dropping h[end]: the n-grams ending before it lose their successor
            before = self._packed(end)
            for n, head, prev, low in self.lengths:
                if end < n:
                    break
                key, earlier = before & low, prev.pop()  # the newest occurrence, at end − n
                if earlier < 0:
                    del head[key]
                else:
                    head[key] = earlier
            h.pop()
        self.last = self._packed(len(h))

    def after(self, start: int, want: int) -> list[int]:
        """Up to `want` tokens from position `start` on, as a match there predicts them: where
        they run into the end of the history, the text repeats — a match P tokens back predicts
        that the next tokens copy the last P, so the copy goes on over what it has copied (an
        overlapping copy, as in LZ77). A model's greedy output falls into such loops: on the
        mixed workload's training trace a third of the n-gram drafts had stopped at the
        history's end, and copied on they were accepted 4.9 tokens deep instead of 2.2
        (docs/benchmarks.md, session 35)."""
        out = self.tokens[start:start + want]
        if 0 < len(out) < want:
            out = (out * (want // len(out) + 1))[:want]
        return out

    def match(self, least: int, recent: int) -> tuple[int, list[int]]:
        """(n, start positions newest first, at most `recent`) of the longest n-gram ending the
        history, of `least` tokens or more, that occurred before with a token after it; (0, [])
        when none did."""
        last, chains, low = self.last, self.chains, self.low
        for n in range(min(self.longest, len(self.tokens) - 1), least - 1, -1):
            head, prev = chains[n]
            at = head.get(last & low[n], -1)
            if at >= 0:
                starts = [at]
                at = prev[at]
                while at >= 0 and len(starts) < recent:
                    starts.append(at)
                    at = prev[at]
                return n, starts
        return 0, []


class Corpus:
    """Finished requests' outputs, with an index of their n-grams (`min_n` .. `max_n`) to where
    the most recent occurrence of each was followed: `follow` drafts from another request's
    output where a request's own history has no match. Bounded in two generations, each its
    tokens and their index: a request goes into the newer; once it would pass half the
    capacity, the older is dropped whole and the newer becomes the older. So at most `capacity`
    tokens are held (~0.5 KB each with the index), and adding a request is one C-level dict
    update per n-gram length — nothing is evicted key by key."""

    SEP = -1  # after each request's tokens: a draft never runs on into the next request's

    def __init__(self, capacity: int, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.half = capacity // 2  # a generation's tokens, each request's SEP included
        # (tokens, n-gram -> position in them of what followed its most recent occurrence)
        self.older: tuple[list[int], dict[tuple[int, ...], int]] = ([], {})
        self.newer: tuple[list[int], dict[tuple[int, ...], int]] = ([], {})

    def add(self, tokens: list[int]) -> None:
        """One finished request's tokens (their last half the capacity, less one, if longer)."""
        tokens = [int(t) for t in tokens[max(0, len(tokens) - (self.half - 1)):]] if self.half > 1 else []
        if len(tokens) <= self.min_n:
            return
        if len(self.newer[0]) + len(tokens) + 1 > self.half:
            self.older, self.newer = self.newer, ([], {})
        held, index = self.newer
        start = len(held)
        for n in range(self.min_n, self.max_n + 1):  # later occurrences overwrite earlier ones
            index.update(zip(self._grams(tokens, n), range(start + n, start + len(tokens)), strict=True))
        held += tokens
        held.append(self.SEP)

    @staticmethod
    def _grams(tokens: list[int], n: int):
        """The n-grams of `tokens` that a token follows, in order (tuples made by zip, in C)."""
        if len(tokens) <= n:
            return iter(())
        return zip(*(tokens[j:len(tokens) - n + j] for j in range(n)), strict=True)

    def follow(self, context: list[int], want: int) -> tuple[int, list[int]]:
        """(n, up to `want` tokens): what followed the most recent earlier occurrence of the
        longest n-gram ending `context`; (0, []) when none occurred."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            key = tuple(context[-n:])
            for held, index in (self.newer, self.older):
                at = index.get(key)
                if at is not None:
                    out = held[at:at + want]
                    return n, out[:out.index(self.SEP)] if self.SEP in out else out
        return 0, []

    def __len__(self) -> int:
        return len(self.older[0]) + len(self.newer[0])

    def clear(self) -> None:
        self.older, self.newer = ([], {}), ([], {})
