"""Host synchronisations per forward (issue #29 item 3), counted on CPU with a stand-in: every
call that copies a tensor's values to the host (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`int()`, `float()`, `bool()` of a tensor) while the model runs one decode step, and every call
whose output's size depends on a tensor's values, which on a GPU reads them to the host inside
torch (`bincount`, `nonzero`, `unique`, `masked_select`, indexing by a boolean mask,
`repeat_interleave` by a tensor without `output_size`). On a GPU each of these waits for the
device; the budget is one per MoE layer (the expert counts, which size the all-to-all and the
expert loop) and none per attention layer — a regression fails here, not on
the first GPU."""

from __future__ import annotations

import collections

import pytest
import torch

from actors.target.model import ForwardBatch
from tests.conftest import tiny_model

HOST = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
VALUE_SIZED = ("bincount", "nonzero", "unique", "masked_select")  # torch.X and Tensor.X alike


def _value_sized_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _repeats_by_tensor(args, kwargs) -> bool:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and kwargs.get("output_size") is None


def _counting(counts, original, name, when=None):
    def call(*args, **kwargs):
        if when is None or when(args, kwargs):
            counts[name] += 1
        return original(*args, **kwargs)
    return call


def syncs_per_decode_step(model) -> int:
    cache = model.new_cache(4096)
    with torch.no_grad():
        model(ForwardBatch.from_lists([0, 1, 2], [[5, 6, 7, 8], [9, 10], [11]], "all"), cache)  # prefill
    step = ForwardBatch.from_lists([0, 1, 2], [[3], [4], [12]], "all")  # built on the host, as ranks do
    host_tokens = step.tokens.numpy().copy()  # the host array a rank uploads the tokens from
    counts = collections.Counter()
    patched = [(torch.Tensor, name, _counting(counts, getattr(torch.Tensor, name), name)) for name in HOST]
    patched += [(owner, name, _counting(counts, getattr(owner, name), name))
                for owner in (torch, torch.Tensor) for name in VALUE_SIZED]
    index = torch.Tensor.__getitem__
    patched.append((torch.Tensor, "__getitem__",
                    _counting(counts, index, "mask index", lambda args, _: _value_sized_index(args[1]))))
    patched += [(owner, "repeat_interleave", _counting(counts, owner.repeat_interleave, "repeat_interleave",
                                                        _repeats_by_tensor)) for owner in (torch, torch.Tensor)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    try:
        for owner, name, f in patched:
            setattr(owner, name, f)
        with torch.no_grad():  # as a rank runs it: the token range checked on the host array it uploads
            model(model.prepare(step, cache, host_tokens), cache)
    finally:
        for owner, name, f in originals:
            setattr(owner, name, f)
    return counts


@pytest.mark.parametrize("latent", [False, True])
def test_at_most_one_host_synchronisation_per_moe_layer(latent):
    extra = dict(model_type="deepseek_v3", kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
                 num_key_value_heads=4) if latent else {}
    small = tiny_model(0, num_hidden_layers=3, mlp_only_layers=(1,), **extra)  # 2 MoE layers, 3 attention
    large = tiny_model(0, num_hidden_layers=7, mlp_only_layers=(1,), **extra)  # 6 MoE layers, 7 attention
    small_counts, large_counts = syncs_per_decode_step(small), syncs_per_decode_step(large)
    a, b = sum(small_counts.values()), sum(large_counts.values())
    # per layer: <= 1, for MoE layers only
    assert b - a <= large.cfg.moe_layers - small.cfg.moe_layers, (small_counts, large_counts)
    assert a <= small.cfg.moe_layers + 1, small_counts  # and one per forward: the batch's lengths


def test_one_rank_with_grouped_experts_reads_nothing_back_per_moe_layer():
    """At EP 1 with grouped experts (a GPU rank in bf16) no host code needs the expert counts:
    the grouped matmul reads the groups' ends on the device, so a MoE layer synchronises not at
    all; its counts ride back with the step's results (`StepStats.settle`) and give the loop's
    statistics. Forced here on the CPU, where torch runs the grouped matmul too."""
    from actors.target.moe import StepStats, grouped_mm_runs

    if not grouped_mm_runs("cpu", torch.float32):
        pytest.skip(f"torch {torch.__version__} has no grouped matmul on the CPU")
    model = tiny_model(0, num_hidden_layers=7, mlp_only_layers=(1,))  # 6 MoE layers
    loop_counts = syncs_per_decode_step(model)
    for block in model.moe_blocks():
        block.experts.grouped = True
    grouped_counts = syncs_per_decode_step(model)
    assert sum(grouped_counts.values()) <= 1, grouped_counts  # the forward's own, none per layer
    assert sum(loop_counts.values()) - sum(grouped_counts.values()) >= model.cfg.moe_layers

    stats = {}
    for grouped in (False, True):
        for block in model.moe_blocks():
            block.experts.grouped = grouped
        cache, s = model.new_cache(512), StepStats()
        with torch.no_grad():
            model(ForwardBatch.from_lists([0, 1], [[5, 6, 7, 8], [9, 10]], "all"), cache, s)
        assert bool(s.unread) == grouped  # counted on the device, not yet read
        stats[grouped] = s.settle()
        assert not s.unread
    assert stats[True].per_layer == stats[False].per_layer and len(stats[True].per_layer) == model.cfg.moe_layers
    assert (stats[True].distinct_experts, stats[True].moe_layers) == (stats[False].distinct_experts,
                                                                      stats[False].moe_layers)
