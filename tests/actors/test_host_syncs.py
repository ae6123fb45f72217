"""Host synchronisations per forward (issue #29 item 3), counted on CPU with a stand-in: every
call that copies a tensor's values to the host (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`int()`, `float()`, `bool()` of a tensor) while the model runs one decode step. On a GPU each of
these waits for the device; the budget is one per MoE layer (the expert counts, which size the
all-to-all and the expert loop) and none per attention layer — a regression fails here, not on
the first GPU."""

from __future__ import annotations

import collections

import pytest
import torch

from actors.target.model import ForwardBatch
from tests.conftest import tiny_model

HOST = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def syncs_per_decode_step(model) -> int:
    cache = model.new_cache(4096)
    with torch.no_grad():
        model(ForwardBatch.from_lists([0, 1, 2], [[5, 6, 7, 8], [9, 10], [11]], "all"), cache)  # prefill
    step = ForwardBatch.from_lists([0, 1, 2], [[3], [4], [12]], "all")  # built on the host, as ranks do
    counts = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST}

    def counting(name):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return call

    try:
        for name in HOST:
            setattr(torch.Tensor, name, counting(name))
        with torch.no_grad():
            model(step, cache)
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)
    return sum(counts.values())


@pytest.mark.parametrize("latent", [False, True])
def test_at_most_one_host_synchronisation_per_moe_layer(latent):
    extra = dict(model_type="deepseek_v3", kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
                 num_key_value_heads=4) if latent else {}
    small = tiny_model(0, num_hidden_layers=3, mlp_only_layers=(1,), **extra)  # 2 MoE layers, 3 attention
    large = tiny_model(0, num_hidden_layers=7, mlp_only_layers=(1,), **extra)  # 6 MoE layers, 7 attention
    a, b = syncs_per_decode_step(small), syncs_per_decode_step(large)
    assert b - a <= large.cfg.moe_layers - small.cfg.moe_layers, (a, b)  # per layer: ≤ 1, for MoE layers only
    assert a <= small.cfg.moe_layers + 2, a  # and two per forward: the batch's lengths and its token range
