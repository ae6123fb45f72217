"""Weights laid out for the CPU's matmul (`actors/target/layout.py`): same values and shapes, the
transpose contiguous, a tied head untied from its embedding, and a model's outputs kept."""

from __future__ import annotations

import torch
from torch import nn

from actors.target.checkpoint import load_model
from actors.target.layout import cpu_matrix, for_cpu
from actors.target.local import LocalTarget
from actors.target.moe import LocalExperts


def test_linear_and_expert_weights_keep_their_values_with_the_transpose_contiguous(tiny_bundle):
    model = load_model(f"{tiny_bundle}/target").eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tied = model.lm_head.weight is model.embed_tokens.weight
    for_cpu(model)
    after = dict(model.named_parameters())
    for n, p in after.items():
        assert torch.equal(p, before[n]) and p.shape == before[n].shape, n
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    experts = [m for m in model.modules() if isinstance(m, LocalExperts)]
    assert linears and experts
    for w in [m.weight for m in linears] + [t for m in experts for t in (m.gate_up, m.down)]:
        assert w.transpose(-2, -1).is_contiguous() and not w.is_contiguous()
    assert model.embed_tokens.weight.is_contiguous()  # lookups read its rows
    if tied:
        assert model.lm_head.weight is not model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    again = {n: p for n, p in model.named_parameters()}
    for_cpu(model)  # idempotent: nothing is copied twice
    assert all(p is again[n] for n, p in model.named_parameters())
    w = torch.randn(5, 3)
    laid = cpu_matrix(w)
    assert torch.equal(laid, w) and laid.transpose(0, 1).is_contiguous() and cpu_matrix(laid) is laid
    tiny = nn.Module()
    tiny.embed, tiny.head = nn.Embedding(7, 3), nn.Linear(3, 7, bias=False)
    tiny.head.weight = tiny.embed.weight  # tied
    for_cpu(tiny)
    assert tiny.head.weight is not tiny.embed.weight and torch.equal(tiny.head.weight, tiny.embed.weight)
    assert tiny.embed.weight.is_contiguous() and tiny.head.weight.t().is_contiguous()
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    assert for_cpu(meta) is meta and meta.weight.is_contiguous()  # off the CPU nothing moves


def test_a_laid_out_model_computes_what_the_checkpoint_layout_does(tiny_bundle):
    """Equal to float32 rounding (a product of one row, such as an expert given one token, sums in
    another order), and the same argmax at every position of every prompt."""
    from actors.target.model import ForwardBatch

    plain = load_model(f"{tiny_bundle}/target").eval()
    laid = for_cpu(load_model(f"{tiny_bundle}/target").eval())
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41], [3, 4, 3, 4, 3, 4]]
    with torch.inference_mode():
        a, _ = plain(ForwardBatch.from_lists([0, 1, 2, 3], prompts, "all"), plain.new_cache(256))
        b, _ = laid(ForwardBatch.from_lists([0, 1, 2, 3], prompts, "all"), laid.new_cache(256))
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5) and torch.equal(a.argmax(-1), b.argmax(-1))
    assert laid is LocalTarget(laid).model  # a local target lays out what it is given, in place
