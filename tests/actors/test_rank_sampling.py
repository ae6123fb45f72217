"""A rank draws sampling requests' tokens itself (issue #29: no vocabulary-sized copies to the
host): given each sampling row's uniform, it hands back one token a row, not the distribution —
and that token is exactly `dcut_core.rules.inverse_cdf` of the target's sampling distribution,
the draw acceptance used to make on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.target import wire
from actors.target.checkpoint import load_model
from actors.target.sampling import target_probs
from actors.target.worker import RankBatch, TargetRank, WorkerSpec
from dcut_core import rules

pytestmark = pytest.mark.usefixtures("local_ray")  # a rank's setup reports where it runs (Ray's context)


def rank_batch(requests: int, rows: int, sampling: np.ndarray, rng) -> RankBatch:
    n = requests * rows
    temp = np.repeat(np.where(sampling, 0.8, 0.0), rows).astype(np.float32)
    return RankBatch(list(range(requests)), rng.integers(3, 90, n), np.arange(0, n + 1, rows), np.arange(n),
                     temperature=temp, top_p=np.full(n, 0.9, dtype=np.float32), uniform=rng.random(n))


def test_a_rank_hands_back_a_token_per_row_drawn_as_the_host_would(tiny_checkpoint):
    rank = TargetRank(WorkerSpec(tiny_checkpoint, 0, 1, kv_capacity_tokens=4096))
    rank.setup(("127.0.0.1", 0))
    rng = np.random.default_rng(0)
    sampling = np.arange(64) % 3 == 0  # a third of the requests sample, the rest are greedy
    rb = rank_batch(64, 17, sampling, rng)
    res = rank.forward(rb)
    assert res.sampled.shape == (64 * 17,) and res.logits is None and res.logprobs is None
    size = len(wire.pack(res))
    assert size <= 64 << 10, size  # 64 requests × 17 rows, some sampling: no row of the vocabulary
    # The draws are the host's: inverse_cdf of the target's distribution at each row's uniform.
    model = load_model(tiny_checkpoint)
    from actors.target.model import ForwardBatch

    with torch.no_grad():
        logits, _ = model(ForwardBatch.from_lists(rb.request_ids, [rb.tokens[rb.cu[j]:rb.cu[j + 1]].tolist()
                                                                     for j in range(64)], "all"), model.new_cache(4096))
    rows = np.repeat(sampling, 17)
    probs = target_probs(logits[torch.from_numpy(rows)], torch.full((int(rows.sum()),), 0.8),
                         torch.full((int(rows.sum()),), 0.9)).numpy().astype(np.float64)
    want = rules.inverse_cdf(probs, rb.uniform[rows])
    assert np.array_equal(res.sampled[rows], want)
    assert np.array_equal(res.sampled[~rows], res.argmax[~rows])  # greedy rows: the argmax


def test_a_rank_with_grouped_experts_reports_its_expert_counts_from_the_one_download(tiny_checkpoint):
    """At EP 1 with grouped experts a MoE layer leaves its counts on the device; the rank reads
    them back with the step's results and reports what the per-expert loop reports."""
    from actors.target.moe import grouped_mm_runs

    if not grouped_mm_runs("cpu", torch.float32):
        pytest.skip(f"torch {torch.__version__} has no grouped matmul on the CPU")
    rb = rank_batch(4, 3, np.zeros(4, dtype=bool), np.random.default_rng(1))
    results = {}
    for grouped in (False, True):
        rank = TargetRank(WorkerSpec(tiny_checkpoint, 0, 1, kv_capacity_tokens=1024))
        rank.setup(("127.0.0.1", 0))
        for block in rank.model.moe_blocks():
            block.experts.grouped = grouped
        results[grouped] = rank.forward(rb)
    loop, grouped = results[False], results[True]
    assert np.array_equal(loop.argmax, grouped.argmax)
    assert not grouped.stats.unread and grouped.stats.per_layer == loop.stats.per_layer
    assert grouped.stats.moe_layers == loop.stats.moe_layers > 0
    assert wire.unpack(wire.pack(grouped)).stats.per_layer == loop.stats.per_layer  # crosses the wire as before
