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
    sampling = [s.params.sampling for s in seqs]
    logprobs = [s.params.logprobs is not None for s in batch] + [f.wants_logprobs for f in feeding]
    controls = [request_controls(s, drafts=chunks[i][1:]) for i, s in enumerate(batch)]
    controls += [request_controls(f.seq, feed=f) for f in feeding]
    return target.forward([s.rid for s in seqs], chunks + [f.tokens for f in feeding], logits=rows,
                          capture_layers=capture,
                          sampling=sampling if any(t > 0 for t, _ in sampling) else None,
                          keep_features=keep_features(pool, batch, drafts, feeding) if capture else None,
                          logprobs=logprobs if any(logprobs) else None,
                          controls=controls if any(c is not None for c in controls) else None)


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
    accepted, _ = accept_tokens(batch, drafts, all_kept, out)
    target.truncate({s.rid: s.cached for s in batch})
    return np.asarray(accepted, dtype=np.int64)
