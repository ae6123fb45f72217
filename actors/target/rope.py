"""Rotary position embedding: plain RoPE and YaRN (the long-context scaling DeepSeek-V3 ships
with), as cos/sin tables for the rotate-half form in `layers.apply_rope`.

YaRN follows the YaRN paper and transformers' `_compute_yarn_parameters`: each frequency is
blended between the original and `factor`-interpolated one by a linear ramp over the dims whose
wavelength lies between `beta_fast` and `beta_slow` rotations of the original context, and cos/sin
are scaled by the attention factor (0.1 · mscale · ln(factor) + 1, over the same for
mscale_all_dim when both are given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Rotary:
    dim: int  # dims rotated per head
    theta: float
    yarn: tuple[tuple[str, object], ...] = ()  # a YaRN rope_parameters dict's items; () = plain RoPE

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [dim / 2] and the factor cos/sin are scaled by."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device="cpu") / self.dim
        if not self.yarn:
            return 1.0 / (self.theta ** exponents), 1.0
        p = dict(self.yarn)
        factor, original = float(p["factor"]), int(p["original_max_position_embeddings"])
        attention = p.get("attention_factor")
        if attention is None:
            mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim
                         else yarn_mscale(factor))
        fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns
            return self.dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_of(fast), dim_of(slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        dims = torch.arange(self.dim // 2, dtype=torch.float32, device="cpu")
        ramp = (dims - low) / (high - low if high != low else 0.001)
        keep = 1 - ramp.clamp(0, 1)  # 1: the original frequency (fast dims), 0: interpolated
        base = self.theta ** exponents
        return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, float(attention)

    @cached_property
    def _tables(self) -> dict[torch.device, tuple[torch.Tensor, float]]:
        return {}

    def _table(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """The inverse frequencies on `device`, computed and copied there once per Rotary (every
        attention layer of every forward asks: a host-to-device copy each time would be a
        synchronisation each time)."""
        table = self._tables.get(device)
        if table is None:
            inv, scale = self.inv_freq()
            table = self._tables[device] = (inv.to(device), scale)
        return table

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, dim] at integer positions [N]."""
        inv, scale = self._table(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        if scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * scale, emb.sin() * scale
