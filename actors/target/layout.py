"""Linear layers on the CPU: the product that streams the weight fastest for the rows at hand.

`F.linear(x, W)` with an `nn.Linear` weight W [out, in] multiplies x by W's transpose. On this CPU
(torch 2.13, oneDNN/MKL, two threads) a model's weights do not stay in the caches between uses,
so a decode or verify step's products are bound by reading weights, and how fast they are read
depends on how the product is posed. Measured on 64 MB of weights cycled (`benchmarks/
cpu_layout.py`, µs a product, `F.linear` → this module's): an expert's gate-and-up [256 → 768] at
one row 98 → 40, at four rows 131 → 45; the bundled LM head [256 → 4,096] 497 → 183 at one row,
707 → 290 at four (docs/benchmarks.md, session 33). What wins up to `SMALL` rows is `(W @ xᵀ)ᵀ`:
the weight stays as stored (row by row) and the few input rows are the product's narrow side; one
row is doubled first, since a one-column product takes the slow matrix-vector path. Past `SMALL`
rows `F.linear` is as fast or faster, and is used.

A product posed this way may round differently in the last bits (the kernel sums in another
order): logits agree with `F.linear`'s to ~1e-5, and no greedy output of the test suite or the
benchmarks changed. The bare loop of `benchmarks/peer.py` is built on `LocalTarget`, so it
multiplies the same way and ratios to it still measure the engine.

Off the CPU nothing changes (cuBLAS poses products itself; CUDA graphs capture `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL = 16  # rows up to which (W @ xᵀ)ᵀ is posed: it wins up to 8 here, ties at 16–32, trails from 64


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, posed for the CPU where x has at most `SMALL` rows."""
    if x.device.type != "cpu" or weight.dim() != 2:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m == 0 or m > SMALL:
        return F.linear(x, weight, bias)
    both = torch.cat([rows, rows]) if m == 1 else rows
    y = (weight @ both.t())[:, :m].t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


class CpuLinear(nn.Linear):
    """An `nn.Linear` whose product is `cpu_linear`'s (same weights, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias)


def for_cpu(module: nn.Module, *borrowed: nn.Linear) -> nn.Module:
    """Make `module`'s linear layers (and the `borrowed` ones it calls but does not own, such as a
    drafter's shared LM head) multiply by `cpu_linear`, in place: their class becomes `CpuLinear`,
    their weights stay the same tensors. A module off the CPU is returned as it is."""
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cpu":
        return module
    for m in (*module.modules(), *borrowed):
        if type(m) is nn.Linear:
            m.__class__ = CpuLinear
    return module
