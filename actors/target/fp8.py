"""FP8 block-scaled weights kept in FP8 where the device multiplies them.

What runs where:
- CPU (here, and CI), GPUs below compute capability 9.0, and torch builds without block-wise
  `F.scaled_mm`: the weights are dequantized as they are read (`checkpoint.py`) and every matmul
  runs in the model's dtype. On CPU torch's `scaled_mm` takes only tensor- and row-wise scales.
- CUDA at capability ≥ 9.0 (Hopper, Blackwell): `keep_fp8` swaps, before the rank's model moves
  to the device (so only FP8 bytes travel and the device never holds both), every linear layer and
  every expert whose checkpoint weight is FP8 for that weight and its 128 × 128 block scales —
  except layers whose weight their owner multiplies itself (a module's `reads_weights_of`: latent
  attention's kv_b_proj), which keep the dequantized weight.
  Each matmul quantizes its input per token and 128 columns (the activation scheme DeepSeek-V3
  was trained with) and runs `F.scaled_mm` with BlockWise1x128 ×
  BlockWise128x128 scaling. Before swapping anything, one layer is checked on the device: its FP8
  output against the dequantized matmul on random input; if the kernel errs or is off by more
  than FP8 rounding explains (`TOLERANCE`), nothing is swapped and the dequantized weights serve.
  Only layers whose widths are multiples of 128 are swapped.

Status: written against torch 2.13's documented `scaled_mm`; the kernel call has not run on a GPU
yet (none was lent to this work); `tests/gpu/test_cuda.py` checks it on the first one. The input
quantization and the scale layout are tested here against a block-by-block reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
BLOCK = 128
FP8_MAX = 448.0  # largest float8_e4m3fn
TOLERANCE = 0.05  # relative error of an FP8 matmul (both operands rounded to 3 mantissa bits)


def device_supports_fp8(device: torch.device | str) -> bool:
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available() and hasattr(F, "scaled_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) as float8_e4m3fn and one float32 scale per row and 128
    columns [M, K / 128]: x ≈ q · scale."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (groups / scale[..., None]).view(m, k).to(torch.float8_e4m3fn), scale


def blockwise_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] fp8 with scales [M, K/128] times w [N, K] fp8 with scales [N/128, K/128], transposed:
    [M, N] in out_dtype, through `F.scaled_mm` (cuBLAS wants M a multiple of 4, the activation
    scales column-major and the weight's K blocks a multiple of 4)."""
    m = a.shape[0]
    pad = -m % 4
    if pad:
        a = F.pad(a.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        a_scale = F.pad(a_scale, (0, 0, 0, pad), value=1.0)
    kb = w_scale.shape[1]
    ws = F.pad(w_scale, (0, -kb % 4), value=1.0) if kb % 4 else w_scale
    out = F.scaled_mm(a, w.t(), a_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128, ws.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m]


def reference_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """What `blockwise_mm` computes, block by block in float32 (the CPU stand-in for tests)."""
    from actors.target.checkpoint import dequantize_fp8

    x = (a.float().view(a.shape[0], -1, BLOCK) * a_scale[..., None]).view(a.shape)
    return (x @ dequantize_fp8(w, w_scale, (BLOCK, BLOCK)).t()).to(out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, mm: Callable = blockwise_mm) -> torch.Tensor:
    a, a_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return mm(a, a_scale, w, w_scale, x.dtype).view(*x.shape[:-1], w.shape[0])


class Fp8Linear(nn.Module):
    """A bias-free linear layer over an FP8 weight [N, K] and its block scales [N/128, K/128]."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, mm: Callable = blockwise_mm) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", scale.float())
        self.mm = mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.mm)


class Fp8Experts(nn.Module):
    """`LocalExperts` over FP8 weights: gate_up [E, 2I, H] and down [E, H, I] with block scales."""

    def __init__(self, first: int, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 mm: Callable = blockwise_mm) -> None:
        super().__init__()
        self.first, self.count = first, gate_up[0].shape[0]
        self.register_buffer("gate_up", gate_up[0])
        self.register_buffer("gate_up_scale", gate_up[1].float())
        self.register_buffer("down", down[0])
        self.register_buffer("down_scale", down[1].float())
        self.mm = mm

    def uses_grouped(self, rows: torch.Tensor) -> bool:
        return False  # no grouped FP8 path yet (torch's `_scaled_grouped_mm` would be one)

    def forward(self, rows: torch.Tensor, counts: list[int], on_device: torch.Tensor | None = None) -> torch.Tensor:
        """As `LocalExperts.forward`, one block-scaled matmul per expert (`on_device` unused)."""
        out = torch.empty_like(rows)
        start = 0
        for e, c in enumerate(counts):
            if c:
                h = fp8_linear(rows[start:start + c], self.gate_up[e], self.gate_up_scale[e], self.mm)
                gate, up = h.chunk(2, dim=-1)
                out[start:start + c] = fp8_linear(F.silu(gate) * up, self.down[e], self.down_scale[e], self.mm)
                start += c
        return out


def _fits(weight: torch.Tensor) -> bool:
    return weight.shape[-1] % BLOCK == 0 and weight.shape[-2] % BLOCK == 0


def fp8_layers(model: nn.Module, tensors, first: int, count: int) -> tuple[dict[str, tuple], dict[int, tuple]]:
    """The FP8 weights of `model` in the checkpoint (`checkpoint._Tensors`): linear layers by
    module name -> (weight, scales), and MoE layers by index -> ((gate_up, scales), (down, scales))."""
    from actors.target.checkpoint import _hf_name, raw_experts

    linears = {}
    for name, module in model.named_modules():
        parent, _, attr = name.rpartition(".")
        if attr in getattr(model.get_submodule(parent) if parent else model, "reads_weights_of", ()):
            continue  # its owner multiplies the weight itself: an Fp8Linear's raw FP8 weight would be wrong
        if isinstance(module, nn.Linear) and module.bias is None and name != "lm_head":
            raw = tensors.raw(_hf_name(f"{name}.weight"))
            if raw[1] is not None and _fits(raw[0]):
                linears[name] = raw
    experts = {}
    for i, layer in enumerate(model.layers):
        if layer.is_moe:
            pair = raw_experts(tensors, i, first, count)
            if pair is not None and _fits(pair[0][0]) and _fits(pair[1][0]):
                experts[i] = pair
    return linears, experts


def keep_fp8(model: nn.Module, model_dir: str | Path, first: int, count: int,
             mm: Callable = blockwise_mm, check: bool = True, device: torch.device | str | None = None) -> int:
    """Swap the model's FP8-stored linear layers and experts for FP8 ones (see the module doc)
    where the model is, for serving on `device` (default: where it is): the check runs there.
    Swapped on the host before the move, only the FP8 weights travel to the device, never their
    dequantized copies (twice the bytes). Returns how many were swapped (0 when the device
    cannot, or the check fails)."""
    from actors.target.checkpoint import _Tensors, fp8_block

    here = next(model.parameters()).device
    device = torch.device(device) if device is not None else here
    if fp8_block(Path(model_dir)) != (BLOCK, BLOCK) or (mm is blockwise_mm and not device_supports_fp8(device)):
        return 0
    with ExitStack() as stack:
        linears, experts = fp8_layers(model, _Tensors(Path(model_dir), stack), first, count)
    if not linears and not experts:
        return 0
    if check and not _check(model, linears, device, mm):
        return 0
    dtype = next(model.parameters()).dtype
    for name, (w, s) in linears.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, Fp8Linear(w.to(here), s.to(here), mm))
    for i, ((gu, gus), (d, ds)) in experts.items():
        model.layers[i].mlp.experts = Fp8Experts(first, (gu.to(here), gus.to(here)), (d.to(here), ds.to(here)), mm)
    log.info("FP8 weights kept on %s: %d linear layers, %d expert sets (activations %s)", device, len(linears),
             len(experts), dtype)
    return len(linears) + len(experts)


@torch.inference_mode()
def _check(model: nn.Module, linears: dict, device, mm: Callable) -> bool:
    name, (w, s) = next(iter(linears.items())) if linears else (None, (None, None))
    if name is None:
        return True
    ref = model.get_submodule(name).weight  # one layer's dequantized weight, copied to the device for the check
    x = torch.randn(5, w.shape[1], device=device, dtype=ref.dtype)
    try:
        got = fp8_linear(x, w.to(device), s.to(device), mm).float()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        log.warning("FP8 matmul unavailable on %s (%s): serving dequantized weights", device, exc)
        return False
    want = F.linear(x, ref.to(device)).float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    if not err < TOLERANCE:
        log.warning("FP8 matmul on %s is off by %.3f (relative) on %s: serving dequantized weights", device, err, name)
        return False
    return True
