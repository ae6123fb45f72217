"""FP8 block-scaled checkpoints for tests: DeepSeek's layout written from float weights, and a
block-by-block reference dequantization (no transformers needed: the GPU checks use these too)."""

from __future__ import annotations

import json
import pathlib

import torch


def reference_dequantize(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block by block, as written: each (br × bc) tile times its own scale."""
    out = torch.empty(w.shape, dtype=torch.float32)
    br, bc = block
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in w.shape[:-2]]) if w.dim() > 2 else [()]:
        lead = tuple(torch.atleast_1d(torch.as_tensor(idx)).tolist())
        for i in range(s.shape[-2]):
            for j in range(s.shape[-1]):
                tile = (*lead, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
                out[tile] = w[tile].float() * s[(*lead, i, j)]
    return out


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights and per-block scales as DeepSeek's layout stores them (amax / 448 per block)."""
    br, bc = block
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros((*w.shape[:-2], nr * br, nc * bc))
    padded[..., :rows, :cols] = w
    tiles = padded.view(*w.shape[:-2], nr, br, nc, bc)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / 448.0  # [..., nr, nc]
    q = (tiles / scale[..., :, None, :, None]).view_as(padded)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def write_fp8(src: pathlib.Path, tmp_path: pathlib.Path, block: tuple[int, int]) -> tuple[pathlib.Path, pathlib.Path]:
    """An FP8 copy of checkpoint `src` (every `*_proj` weight quantized per block, with the
    quantization_config that says so), and a float32 one of exactly its dequantized weights."""
    from safetensors.torch import load_file, save_file

    quantized, dequantized = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if name.endswith("_proj.weight") or name.endswith("_proj"):
                q, s = quantize(t.float(), block)
                quantized[name], quantized[f"{name}_scale_inv"] = q, s
                dequantized[name] = reference_dequantize(q, s, block)
            else:
                quantized[name] = dequantized[name] = t
    config = json.loads((src / "config.json").read_text())
    for folder, weights, extra in (("fp8", quantized, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}}),
            ("dequantized", dequantized, {})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config | extra))
        save_file(weights, str(tmp_path / folder / "model.safetensors"))
    return tmp_path / "fp8", tmp_path / "dequantized"
