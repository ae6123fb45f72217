"""The verify stage's forward: what one step asks of the target (decoding rows, kept drafts,
prefill chunks, sampling controls, log-probabilities, which drafter features to capture and
where they stay)."""

from __future__ import annotations

import dataclasses

import numpy as np

from actors.engine.constraints import grammar_allowed, request_controls
from actors.engine.sequence import Sequence
from actors.engine.stages import Drafts, Feed, Pruned, Step, accept_tokens
from actors.target.batch import VerifyBatch, per_row_sampling
from dcut_core import ragged


def verify_forward(target, pool, capture: tuple[int, ...], st: Step):
    """One forward for step `st`, as one flat batch (`VerifyBatch`): each decoding request's last
    token and kept drafts (every row judged), then this step's prefill chunks (a row only where a
    fresh prompt ends). `capture`: the target layers whose outputs the drafters read (none under
    `ar`); the features come back for requests that drafted this step when drafters are actors
    (`keep_features`)."""
    return target.run(verify_batch(pool, capture, st))


def verify_batch(pool, capture: tuple[int, ...], st: Step) -> VerifyBatch:
    """Step `st`'s `VerifyBatch`, its decoding part built with whole-array operations; a
    per-request fact the running set's census (`Scheduler.census`) says nobody has is not
    looked for."""
    batch, drafts, feeding, census = st.batch, st.drafts, st.feeding, st.census
    r, kept = len(batch), np.asarray(st.pruned.kept, dtype=np.int64)
    counts = 1 + kept  # the last token, then the kept drafts
    cu = np.zeros(r + 1 + len(feeding), dtype=np.int64)
    counts.cumsum(out=cu[1:r + 1])
    if feeding:
        cu[r + 1:] = cu[r] + np.cumsum([len(f.tokens) for f in feeding])
    tokens = np.empty(int(cu[-1]), dtype=np.int64)
    tokens[cu[:r]] = [s.last for s in batch]
    if kept.any():  # each request's first kept drafts, after its last token
        starts = np.asarray(drafts.cu[:-1], dtype=np.int64)
        within = ragged.positions(ragged.offsets_from_lengths(kept))
        tokens[np.repeat(cu[:r] + 1, kept) + within] = drafts.tokens[np.repeat(starts, kept) + within]
    rows, rows_cu = np.arange(int(cu[r]), dtype=np.int64), cu  # every decoding row
    if feeding:  # a prefill chunk's rows: where a fresh prompt ends (or all, for its log-probabilities)
        chunks = [f.logit_rows for f in feeding]
        for j, f in enumerate(feeding):
            tokens[cu[r + j]:cu[r + j + 1]] = f.tokens
        rows = np.concatenate([rows, *(cu[r + j] + np.asarray(c, dtype=np.int64) for j, c in enumerate(chunks))])
        rows_cu = np.concatenate([cu[:r + 1], cu[r] + np.cumsum([len(c) for c in chunks], dtype=np.int64)])
    seqs = [*batch, *(f.seq for f in feeding)] if feeding else batch
    # (lists, not generators, inside any and all: a call fewer a request)
    sampling = per_row_sampling(sampling_rows(batch, counts.tolist(), feeding), ragged.lengths(rows_cu)) \
        if census.sampling and not all([s.greedy for s in seqs]) else {}
    logprobs = None
    if census.logprobs:
        wants = [s.params.logprobs is not None for s in batch] + [f.wants_logprobs for f in feeding]
        logprobs = np.array(wants) if any(wants) else None
    controls = None
    if census.controls and any([s.controls is not None or s.grammar is not None for s in seqs]):
        drafted = tokens.tolist()
        controls = tuple([request_controls(s, drafts=drafted[cu[i] + 1:cu[i + 1]]) for i, s in enumerate(batch)]
                         + [request_controls(f.seq, feed=f) for f in feeding])
    keep = np.asarray(keep_features(pool, batch, drafts, feeding), dtype=bool) if capture else None
    rids = st.rids.tolist() + [f.seq.rid for f in feeding]
    return VerifyBatch(rids, tokens, cu, rows, rows_cu, False, tuple(capture), **sampling, keep_features=keep,
                       logprobs=logprobs, controls=None if controls is None or all(c is None for c in controls)
                       else controls)


def sampling_rows(batch: list[Sequence], rows: list[int], feeding: list[Feed]) -> list[tuple]:
    """(temperature, top_p, uniforms or None) of each forward request: a sampling request's rows
    carry the uniforms of the output positions they may fill (a decoding request: the next ones,
    one per row; a prefill chunk: the first output position at its last row, where a fresh
    prompt ends), so its rank draws the target's token there and hands back a token a row."""
    out = []
    for s, n in zip(batch, rows, strict=True):
        out.append((*s.params.sampling, None if s.greedy else s.uniforms(len(s.output), n)))
    for f in feeding:
        s, n = f.seq, len(f.logit_rows)
        u = None if s.greedy or not n else np.concatenate([np.zeros(n - 1), s.uniforms(0, 1)])
        out.append((*s.params.sampling, u))
    return out


def keep_features(pool, batch: list[Sequence], drafts: Drafts, feeding: list[Feed]) -> list[bool]:
    """Per forward row: True keeps its features on the rank (prefill, requests that did not
    draft, orphans: bounded by the request and freed at its release); False ships them back.
    Drafters hosted by the ranks read every feature where it is."""
    if pool.hosted:
        return [True] * (len(batch) + len(feeding))
    drafted = ragged.lengths(drafts.cu) > 0
    return [not (drafted[i] and pool.drafting(s.rid)) for i, s in enumerate(batch)] + [True] * len(feeding)


def oracle_lengths(verify, target, st: Step) -> np.ndarray:
    """True accepted lengths of step `st`'s drafts, learned by verifying every draft (`verify`, the
    engine's stage, of a copy of the step that keeps them all and feeds no prompt) and rolling
    back (the `oracle` policy, benchmarks only; this extra pass is not counted in the step's
    measured time)."""
    batch, drafts = st.batch, st.drafts
    all_kept = ragged.lengths(drafts.cu)
    allowed = grammar_allowed(st)
    all_kept = all_kept if allowed is None else allowed
    out = verify(dataclasses.replace(st, feeding=[], pruned=Pruned(np.asarray(all_kept, dtype=np.int64))))
    accepted = accept_tokens(batch, drafts, all_kept, out).counts
    target.truncate({s.rid: s.cached for s in batch})
    return np.asarray(accepted, dtype=np.int64)
