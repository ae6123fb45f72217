"""The verify stage's forward: what one step asks of the target (decoding rows, kept drafts,
prefill chunks, sampling controls, log-probabilities, which drafter features to capture and
where they stay)."""

from __future__ import annotations

import numpy as np

from actors.engine.constraints import grammar_allowed, request_controls
from actors.engine.sequence import Sequence
from actors.engine.stages import Drafts, Feed, accept_tokens


def verify_forward(target, pool, capture: tuple[int, ...], batch: list[Sequence], drafts: Drafts,
                   kept: np.ndarray, feeding: list[Feed] = ()):
    """One forward for the step: each decoding request's last token and kept drafts (every row
    judged), then this step's prefill chunks (a row only where a fresh prompt ends). `capture`:
    the target layers whose outputs the drafters read (none under `ar`); the features come back
    for requests that drafted this step when drafters are actors (`keep_features`)."""
    tokens, cu, kept = drafts.tokens.tolist(), drafts.cu.tolist(), np.asarray(kept).tolist()  # Python from here
    chunks = [[s.last, *tokens[cu[i]:cu[i] + kept[i]]] for i, s in enumerate(batch)]
    rows = [list(range(len(c))) for c in chunks] + [f.logit_rows for f in feeding]
    seqs = [*batch, *(f.seq for f in feeding)]
    sampling = sampling_rows(batch, chunks, feeding)
    logprobs = [s.params.logprobs is not None for s in batch] + [f.wants_logprobs for f in feeding]
    controls = [request_controls(s, drafts=chunks[i][1:]) for i, s in enumerate(batch)]
    controls += [request_controls(f.seq, feed=f) for f in feeding]
    return target.forward([s.rid for s in seqs], chunks + [f.tokens for f in feeding], logits=rows,
                          capture_layers=capture,
                          sampling=sampling if any(t > 0 for t, _, _ in sampling) else None,
                          keep_features=keep_features(pool, batch, drafts, feeding) if capture else None,
                          logprobs=logprobs if any(logprobs) else None,
                          controls=controls if any(c is not None for c in controls) else None)


def sampling_rows(batch: list[Sequence], chunks: list[list[int]], feeding: list[Feed]) -> list[tuple]:
    """(temperature, top_p, uniforms or None) of each forward request: a sampling request's rows
    carry the uniforms of the output positions they may fill (a decoding request: the next ones,
    one per row; a prefill chunk: the first output position at its last row, where a fresh
    prompt ends), so its rank draws the target's token there and hands back a token a row."""
    out = []
    for s, chunk in zip(batch, chunks, strict=True):
        out.append((*s.params.sampling, None if s.greedy else s.uniforms(len(s.output), len(chunk))))
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
    drafted = np.diff(drafts.cu) > 0
    return [not (drafted[i] and pool.drafting(s.rid)) for i, s in enumerate(batch)] + [True] * len(feeding)


def oracle_lengths(verify, target, batch: list[Sequence], drafts: Drafts) -> np.ndarray:
    """True accepted lengths, learned by verifying every draft (`verify`, the engine's stage) and
    rolling back (the `oracle` policy, benchmarks only; this extra pass is not counted in the
    step's measured time)."""
    all_kept = np.diff(drafts.cu)
    allowed = grammar_allowed(batch, drafts)
    all_kept = all_kept if allowed is None else allowed
    out = verify(batch, drafts, all_kept)
    accepted = accept_tokens(batch, drafts, all_kept, out).counts
    target.truncate({s.rid: s.cached for s in batch})
    return np.asarray(accepted, dtype=np.int64)
