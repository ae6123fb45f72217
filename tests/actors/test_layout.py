"""Linear layers on the CPU (`actors/target/layout.py`): `cpu_linear` computes `F.linear` to
float32 rounding at every row count and shape; `for_cpu` swaps only the product (same weight
tensors, same state dict); a model's outputs keep their argmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actors.target.checkpoint import load_model
from actors.target.layout import SMALL, CpuLinear, cpu_linear, for_cpu
from actors.target.local import LocalTarget
from actors.target.model import ForwardBatch


@pytest.mark.parametrize("rows", [0, 1, 2, 3, SMALL, SMALL + 1, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_is_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    for shape in ((rows, 40), (1, rows, 40), (2, rows, 40)):
        x = torch.randn(*shape, generator=g)
        got, want = cpu_linear(x, w, b), F.linear(x, w, b)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 40, requires_grad=True)  # differentiable (the demo's training runs the experts' loop)
    cpu_linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(3, -1), atol=1e-4)


def test_for_cpu_swaps_the_product_not_the_weights(tiny_bundle):
    model = load_model(f"{tiny_bundle}/target").eval()
    weights = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    for_cpu(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is CpuLinear for m in linears)
    assert all(p is weights[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert for_cpu(model) is model and all(type(m) is CpuLinear for m in linears)  # idempotent
    head = nn.Linear(3, 7, bias=False)
    owner = nn.Module()
    owner.inner = nn.Linear(3, 3)
    for_cpu(owner, head)  # a borrowed head is swapped too
    assert type(head) is CpuLinear and type(owner.inner) is CpuLinear
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    assert for_cpu(meta) is meta and type(meta) is nn.Linear  # off the CPU nothing changes


def test_a_model_on_the_cpu_computes_what_f_linear_does(tiny_bundle):
    plain = load_model(f"{tiny_bundle}/target").eval()
    laid = for_cpu(load_model(f"{tiny_bundle}/target").eval())
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41], [3, 4, 3, 4, 3, 4]]
    with torch.inference_mode():
        a, _ = plain(ForwardBatch.from_lists([0, 1, 2, 3], prompts, "all"), plain.new_cache(256))
        b, _ = laid(ForwardBatch.from_lists([0, 1, 2, 3], prompts, "all"), laid.new_cache(256))
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5) and torch.equal(a.argmax(-1), b.argmax(-1))
    assert laid is LocalTarget(laid).model  # a local target swaps what it is given, in place
