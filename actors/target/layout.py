"""Weights laid out for the CPU's matrix multiply.

`F.linear(x, W)` with an `nn.Linear` weight W [out, in] multiplies by W's transpose. On this CPU
(torch 2.13, oneDNN/MKL, two threads) that product reads a weight from memory at about half the
speed of the same product by a [in, out] row-major matrix once the weights do not fit in the
caches, as a model's do (measured, 64 MB of weights cycled, one row: the bundled LM head 516 →
196 µs, an expert's gate-and-up 98 → 60 µs; four to 64 rows 10–30 % faster; docs/benchmarks.md
session 33). So on the CPU each matrix is stored with its transpose contiguous: same shape, same
values, other strides; every caller (`F.linear`, the experts' loop) is unchanged and now takes
the fast path. A product of one row (a decode step's projection, an expert given one token) may
round differently in the last bits, as the kernel sums in another order; the bundled model's
greedy outputs are unchanged on every test and benchmark prompt (and the bare loop, built on
`LocalTarget`, multiplies the same way).

GPU weights keep the checkpoint's layout (cuBLAS reads either at the same speed, and the grouped
expert matmul expects it): `for_cpu` does nothing to a module off the CPU.
"""

from __future__ import annotations

import torch
from torch import nn


def cpu_matrix(w: torch.Tensor) -> torch.Tensor:
    """A weight [..., out, in] on the CPU with its values laid out so that its transpose is
    contiguous (unchanged off the CPU, or laid out so already)."""
    if w.device.type != "cpu" or w.transpose(-2, -1).is_contiguous():
        return w
    return w.detach().transpose(-2, -1).contiguous().transpose(-2, -1)


def _laid_out(p: nn.Parameter) -> nn.Parameter:
    w = cpu_matrix(p)
    return p if w is p else nn.Parameter(w, requires_grad=p.requires_grad)


def for_cpu(module: nn.Module, *borrowed: nn.Linear) -> nn.Module:
    """Lay out `module`'s linear weights (and the experts' fused weights, and the `borrowed`
    linears it calls but does not own, such as a drafter's shared LM head) for the CPU, in place;
    a module off the CPU is returned as it is. A linear weight tied to an embedding gets its own
    copy: the embedding's rows stay contiguous for lookups."""
    from actors.target.moe import LocalExperts

    first = next(module.parameters(), None)
    if first is None or first.device.type != "cpu":
        return module
    for m in (*module.modules(), *borrowed):
        if isinstance(m, nn.Linear) and m.weight.dim() == 2 and m.weight.is_floating_point():
            m.weight = _laid_out(m.weight)  # a new tensor: a tied embedding keeps the one it has
        elif isinstance(m, LocalExperts):
            m.gate_up, m.down = _laid_out(m.gate_up), _laid_out(m.down)
    return module
