"""The flat verify batch (`actors/target/batch.py`): each rank's share of a step equals the
request-by-request reference — tokens, the rows asked for, per-row sampling, kept features,
log-probability rows, controls."""

from __future__ import annotations

import numpy as np

from actors.target.batch import VerifyBatch


def reference_share(idx, chunks, logits, sampling, keep, logprobs, controls):
    """What one rank's batch holds, written request by request."""
    tokens, index, temp, top_p, uniform, lp = [], [], [], [], [], []
    for i in idx:
        for p in logits[i]:
            index.append(len(tokens) + p)
            temp.append(sampling[i][0])
            top_p.append(sampling[i][1])
            lp.append(logprobs[i])
        uniform.extend(sampling[i][2] if sampling[i][2] is not None else [0.0] * len(logits[i]))
        tokens.extend(chunks[i])
    mine = tuple(controls[i] for i in idx)
    return (tokens, index, temp, top_p, uniform, [keep[i] for i in idx], lp,
            mine if any(c is not None for c in mine) else None)


def test_every_ranks_share_equals_the_request_by_request_reference():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        chunks = [rng.integers(0, 100, rng.integers(1, 7)).tolist() for _ in range(n)]
        logits = [sorted(rng.choice(len(c), rng.integers(0, len(c) + 1), replace=False).tolist()) for c in chunks]
        sampling = [(float(rng.choice([0.0, 0.7])), float(rng.uniform(0.5, 1)),
                     rng.uniform(size=len(p)) if rng.random() < 0.5 else None) for p in logits]
        sampling[0] = (0.9, 1.0, None)  # some request samples
        keep = rng.random(n) < 0.5
        logprobs = rng.random(n) < 0.3
        controls = [object() if rng.random() < 0.3 else None for _ in range(n)]
        batch = VerifyBatch.of(list(range(10, 10 + n)), chunks, logits, sampling=sampling, keep_features=keep,
                               logprobs=logprobs, controls=controls, capture_layers=(2,))
        owner = rng.integers(0, 2, n)
        for rank in (0, 1):
            whole = rng.random() < 0.2  # one rank holds every request (EP 1)
            idx = np.arange(n) if whole else np.flatnonzero(owner == rank)
            rb = batch.share(None if whole else idx, {10: 3} if rank == 0 else {})
            tokens, index, temp, top_p, uniform, kept, lp, ctl = reference_share(
                idx.tolist(), chunks, logits, sampling, keep, logprobs, controls)
            assert rb.request_ids == [10 + i for i in idx.tolist()]
            assert rb.tokens.tolist() == tokens and rb.logit_index.tolist() == index
            assert rb.cu.tolist() == np.concatenate([[0], np.cumsum([len(chunks[i]) for i in idx])]).tolist()
            assert np.allclose(rb.temperature, temp) and np.allclose(rb.top_p, top_p)
            assert np.allclose(rb.uniform, uniform) and rb.keep_features.tolist() == kept
            assert rb.logprob_rows.tolist() == lp and rb.controls == ctl
            assert rb.capture_layers == (2,) and rb.truncate == ({10: 3} if rank == 0 else None)


def test_a_greedy_batch_carries_no_sampling_and_last_rows_are_each_chunks_end():
    batch = VerifyBatch.of([1, 2], [[5, 6, 7], [8]], "last", sampling=[(0.0, 1.0, None), (0.0, 1.0, None)])
    rb = batch.share(None, {})
    assert rb.temperature is None and rb.uniform is None and rb.logprob_rows is None and rb.controls is None
    assert rb.logit_index.tolist() == [2, 3] and batch.row_counts.tolist() == [1, 1]


def test_the_ranks_answers_come_back_flat_in_the_batchs_order():
    """`EPGroup._assemble`: each rank answers its requests' rows in its order (features of the
    requests it does not keep, log-probabilities of those that asked); the output holds every
    request's rows at `rows(i)`, its features and log-probabilities per request."""
    from actors.target.group import EPGroup
    from actors.target.worker import RankResult

    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        chunks = [rng.integers(0, 50, size=int(rng.integers(1, 5))).tolist() for _ in range(n)]
        logits = [sorted(rng.choice(len(c), rng.integers(0, len(c) + 1), replace=False).tolist()) for c in chunks]
        keep, asks = rng.random(n) < 0.5, rng.random(n) < 0.5
        batch = VerifyBatch.of(list(range(n)), chunks, logits, keep_features=keep, logprobs=asks,
                               sampling=[(0.7, 1.0, None)] * n, with_logits=True)
        owner = rng.integers(0, 3, size=n)
        per_rank = [np.flatnonzero(owner == r) for r in range(3)]
        rows = {i: rng.integers(0, 99, size=len(logits[i])) for i in range(n)}  # what each request's rows say
        feats = {i: rng.random((len(chunks[i]), 2)) for i in range(n)}
        results = []
        for idx in per_rank:
            mine = idx.tolist()
            arg = np.concatenate([rows[i] for i in mine] or [np.zeros(0, np.int64)])
            shipped = [feats[i] for i in mine if not keep[i]]
            lp = [np.full((len(logits[i]), 4), float(i)) for i in mine if asks[i]]
            results.append(RankResult(arg, np.repeat(arg[:, None], 3, axis=1).astype(np.float32),
                                      {5: np.concatenate(shipped)} if shipped else {}, sampled=arg + 1000,
                                      logprobs=np.concatenate(lp) if lp else np.zeros((0, 4))))
        out = EPGroup._assemble(batch, per_rank, results, 0.0)
        for i in range(n):
            assert out.argmax[out.rows(i)].tolist() == rows[i].tolist()
            assert out.tokens(i).tolist() == (rows[i] + 1000).tolist() and out.logits[out.rows(i), 0].tolist() == \
                rows[i].tolist()
            assert (out.features[i] == {}) == bool(keep[i] or not results[owner[i]].features)
            if not keep[i]:
                assert np.array_equal(out.features[i][5], feats[i])
            assert (out.logprobs is None) == (not asks.any())
            assert asks[i] or out.logprobs is None or out.logprobs[i] is None
            if asks[i]:
                assert out.logprobs[i].shape == (len(logits[i]), 4) and (out.logprobs[i] == i).all()
