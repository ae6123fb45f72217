"""Hugging Face-format checkpoints: config.json + safetensors (single file or sharded index).

Expert weights come in two layouts, both read here:
- per-expert (transformers 4.x): `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`;
- fused (transformers 5.x): `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`
  [E, H, I].
An expert-parallel rank reads only its own experts (`get_slice` on fused tensors), so no rank
ever holds the whole expert set in memory.

FP8 block-scaled weights (the DeepSeek-V3 / Qwen3-FP8 layout: a float8_e4m3fn `weight` and a
float32 `weight_scale_inv` per `weight_block_size` block, `quantization_config.quant_method`
"fp8") are dequantized as they are read: w = fp8 · scale of its block, in float32, exactly as
the reference does. Every rank computes in the model's dtype (no FP8 matmul is used, here or on
a GPU yet).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from actors.target.config import MoEConfig
from actors.target.model import MoETransformer

LAYOUTS = ("fused", "per_expert")
# What a model computes in unless told otherwise: the CPU's serving dtype and the exactness
# reference of the tests. On an accelerator a rank serves in the checkpoint's dtype (`serving_dtype`).
COMPUTE_DTYPE = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Checkpoint names of other families, as the per-expert names read here (Mixtral's own layout:
# `block_sparse_moe`, experts w1 = gate, w3 = up, w2 = down).
_ALIASES = [(re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
            (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
            (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),  # GLM-4-MoE, DeepSeek-V3
            (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.e_score_correction_bias"),
            (re.compile(r"\.mlp\.gate\.wg\."), ".mlp.gate."),  # Hunyuan-MoE
            (re.compile(r"\.mlp\.shared_mlp\."), ".mlp.shared_expert."),
            (re.compile(r"\.self_attn\.query_layernorm\."), ".self_attn.q_norm."),
            (re.compile(r"\.self_attn\.key_layernorm\."), ".self_attn.k_norm.")]


def canonical(key: str) -> str:
    for pattern, repl in _ALIASES:
        key = pattern.sub(repl, key)
    return key


def _hf_name(ours: str) -> str:
    return ours if ours.startswith("lm_head.") else f"model.{ours}"


def _expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weights from FP8 ones and their per-block scales: weight [..., rows, cols] and
    scale_inv [..., ceil(rows / br), ceil(cols / bc)] (leading dims, such as fused experts', match)."""
    br, bc = block
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return weight.float() * scale


def fp8_block(model_dir: pathlib.Path) -> tuple[int, int] | None:
    """The FP8 block size of a checkpoint's `quantization_config`, None if not quantized; raises
    on a quantization this loader cannot read exactly."""
    q = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8" or len(q.get("weight_block_size") or ()) != 2:
        raise ValueError(f"unsupported quantization {q!r}: only fp8 with weight_block_size is read")
    return tuple(q["weight_block_size"])


def checkpoint_dtype(model_dir: str | pathlib.Path) -> torch.dtype:
    """The dtype the checkpoint is published in: config.json's `torch_dtype` (or `dtype`, as newer
    transformers writes it), else that of its stored floating-point weights; FP8 weights compute
    in bfloat16, as their publishers serve them."""
    model_dir = pathlib.Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    named = config.get("torch_dtype") or config.get("dtype")
    if named in DTYPES:
        return DTYPES[named]
    with ExitStack() as stack:
        tensors = _Tensors(model_dir, stack)
        for handle, key in tensors._where.values():
            dtype = handle.get_slice(key).get_dtype()
            if dtype in ("F8_E4M3", "F8_E5M2"):
                return torch.bfloat16
            if dtype in ("BF16", "F16", "F32"):
                return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
    return COMPUTE_DTYPE


def serving_dtype(setting: str, device: str, model_dir: str | pathlib.Path) -> torch.dtype:
    """What a rank computes in: `setting` by name, or for "auto" the checkpoint's dtype on an
    accelerator (the fused attention kernels need it, and it halves the weights' and KV's bytes)
    and float32 on the CPU (the exactness reference; sampling and acceptance are float32 anyway)."""
    if setting != "auto":
        if setting not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, not {setting!r}")
        return DTYPES[setting]
    return COMPUTE_DTYPE if device == "cpu" else checkpoint_dtype(model_dir)


class _Tensors:
    """Lazy view over every tensor of a checkpoint, single-file or sharded (FP8 block-scaled
    weights dequantized on read)."""

    def __init__(self, model_dir: pathlib.Path, stack: ExitStack) -> None:
        self.block = fp8_block(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no safetensors files in {model_dir}")
        self._where: dict[str, tuple[object, str]] = {}  # our name -> (file handle, its name there)
        for f in files:
            handle = stack.enter_context(safe_open(str(model_dir / f), framework="pt"))
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                self._where[canonical(key)] = (handle, key)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(f"checkpoint has no tensor {key!r}")
        return self._dequantized(key, self._tensor(key), self._tensor)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self._dequantized(key, self._tensor(key, start, stop), lambda s: self._tensor(s, start, stop))

    def raw(self, key: str, start: int | None = None,
            stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor as stored and, for an FP8 one, its block scales (else None); rows
        start..stop of the leading dimension if given."""
        t = self._tensor(key, start, stop)
        scale = f"{key}_scale_inv"
        if self.block is None or t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scale not in self._where:
            return t, None
        return t, self._tensor(scale, start, stop)

    def _tensor(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        handle, name = self._where[key]
        return handle.get_tensor(name) if start is None else handle.get_slice(name)[start:stop]

    def _dequantized(self, key: str, t: torch.Tensor, scale_of) -> torch.Tensor:
        if self.block is None or t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        scale = f"{key}_scale_inv"  # weight -> weight_scale_inv (DeepSeek-V3, Qwen3-FP8)
        if scale not in self._where:
            raise KeyError(f"FP8 tensor {key!r} has no {scale!r}")
        return dequantize_fp8(t, scale_of(scale), self.block)


def load_model(model_dir: str | pathlib.Path, first_expert: int = 0, local_experts: int | None = None,
               dtype: torch.dtype = COMPUTE_DTYPE) -> MoETransformer:
    """Build the model from a checkpoint, holding experts [first_expert, first_expert + local)."""
    model_dir = pathlib.Path(model_dir)
    cfg = MoEConfig.load(model_dir)
    count = cfg.num_experts if local_experts is None else local_experts
    if first_expert < 0 or first_expert + count > cfg.num_experts:
        raise ValueError(f"expert range {first_expert}+{count} outside 0..{cfg.num_experts}")
    with torch.device("meta"):
        model = MoETransformer(cfg, first_expert, count)
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        tensors = _Tensors(model_dir, stack)
        for name, _ in model.named_parameters():
            if ".mlp.experts." in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            state[name] = tensors.get(_hf_name(name))
        for layer, block in enumerate(layer.mlp if layer.is_moe else None for layer in model.layers):
            if block is not None:
                gate_up, down = _load_experts(tensors, layer, first_expert, count)
                state[f"layers.{layer}.mlp.experts.gate_up"] = gate_up
                state[f"layers.{layer}.mlp.experts.down"] = down
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for {missing[:5]}")
    return model.eval()


def _load_experts(tensors: _Tensors, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = _expert_prefix(layer)
    if f"{prefix}.gate_up_proj" in tensors:
        return tensors.rows(f"{prefix}.gate_up_proj", first, first + count), \
            tensors.rows(f"{prefix}.down_proj", first, first + count)
    if f"{prefix}.{first}.gate_proj.weight" not in tensors:
        raise KeyError(f"layer {layer}: no expert weights in either the fused or the per-expert layout")
    gate_up = [torch.cat([tensors.get(f"{prefix}.{e}.gate_proj.weight"), tensors.get(f"{prefix}.{e}.up_proj.weight")])
               for e in range(first, first + count)]
    down = [tensors.get(f"{prefix}.{e}.down_proj.weight") for e in range(first, first + count)]
    return torch.stack(gate_up), torch.stack(down)


def raw_experts(tensors: _Tensors, layer: int, first: int, count: int):
    """FP8 expert weights of one layer as stored, with their block scales: ((gate_up [E, 2I, H],
    scales), (down [E, H, I], scales)); None if they are not FP8 or gate/up would not split on a
    block boundary."""
    prefix = _expert_prefix(layer)
    if f"{prefix}.gate_up_proj" in tensors:
        gate_up, down = (tensors.raw(f"{prefix}.{n}", first, first + count) for n in ("gate_up_proj", "down_proj"))
    elif f"{prefix}.{first}.gate_proj.weight" in tensors:
        parts = {n: [tensors.raw(f"{prefix}.{e}.{n}.weight") for e in range(first, first + count)]
                 for n in ("gate_proj", "up_proj", "down_proj")}
        if any(s is None for p in parts.values() for _, s in p) or parts["gate_proj"][0][0].shape[0] % 128:
            return None
        gate_up = (torch.stack([torch.cat([g, u]) for (g, _), (u, _) in zip(parts["gate_proj"], parts["up_proj"],
                                                                                strict=True)]),
                   torch.stack([torch.cat([g, u]) for (_, g), (_, u) in zip(parts["gate_proj"], parts["up_proj"],
                                                                                strict=True)]))
        down = (torch.stack([w for w, _ in parts["down_proj"]]), torch.stack([s for _, s in parts["down_proj"]]))
    else:
        return None
    return None if gate_up[1] is None or down[1] is None else (gate_up, down)


def _hf_state(model: MoETransformer, layout: str) -> Iterator[tuple[str, torch.Tensor]]:
    cfg = model.cfg
    for name, p in model.state_dict().items():
        if ".mlp.experts." in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        yield _hf_name(name), p
    for layer, dec in enumerate(model.layers):
        if not dec.is_moe:
            continue
        ex, prefix = dec.mlp.experts, _expert_prefix(layer)
        if layout == "fused":
            yield f"{prefix}.gate_up_proj", ex.gate_up.data
            yield f"{prefix}.down_proj", ex.down.data
            continue
        inter = ex.down.shape[2]
        for local in range(ex.count):
            e = ex.first + local
            yield f"{prefix}.{e}.gate_proj.weight", ex.gate_up.data[local, :inter]
            yield f"{prefix}.{e}.up_proj.weight", ex.gate_up.data[local, inter:]
            yield f"{prefix}.{e}.down_proj.weight", ex.down.data[local]


def save_model(model: MoETransformer, model_dir: str | pathlib.Path, layout: str = "fused",
               max_shard_bytes: int | None = None, dtype: torch.dtype | None = None) -> None:
    """Write a full model (all experts) as config.json + safetensors in `layout`, optionally cast
    to `dtype` (the bundled demo weights are stored in float16)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    if model.moe_blocks() and model.moe_blocks()[0].experts.count != model.cfg.num_experts:
        raise ValueError("only a model holding every expert can be saved")
    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in _hf_state(model, layout):
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and size + nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][key] = t.detach().to(dtype or t.dtype).contiguous().clone()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
