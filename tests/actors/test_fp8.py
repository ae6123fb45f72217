"""FP8 weights kept in FP8 (actors/target/fp8.py, issue #18). The device kernel (`F.scaled_mm`
with block-wise scales) exists only on CUDA at capability ≥ 9.0 and is checked by
tests/gpu/test_cuda.py; here the same code runs with `reference_mm`, its block-by-block float32
stand-in, so the input quantization, the scale layout, which layers are swapped (both expert
layouts) and the fall-back are tested on CPU."""

from __future__ import annotations

import pytest
import torch

from actors.target.checkpoint import load_model, save_model
from actors.target.fp8 import Fp8Experts, Fp8Linear, keep_fp8, quantize_rows, reference_mm
from actors.target.model import ForwardBatch
from tests.actors.fp8_checkpoints import write_fp8
from tests.conftest import tiny_model

TOKENS = [3, 17, 5, 90, 41, 8, 8, 60, 2, 33, 71]


def test_inputs_are_quantized_per_row_and_128_columns():
    torch.manual_seed(0)
    x = torch.randn(5, 256) * torch.tensor([1.0, 100.0]).repeat_interleave(128)  # blocks of other ranges
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    for r in range(5):
        for b in range(2):
            block = x[r, b * 128:(b + 1) * 128]
            assert s[r, b] == pytest.approx(float(block.abs().max()) / 448.0)
            back = q[r, b * 128:(b + 1) * 128].float() * s[r, b]
            assert torch.all((back - block).abs() <= block.abs() / 16 + 1e-6 * float(block.abs().max()))


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """A model with 128-wide blocks (hidden 128, experts 128 wide, q and o projections 128 wide)
    stored in FP8, per-expert layout, and its exact dequantized twin."""
    tmp = tmp_path_factory.mktemp("fp8")
    model = tiny_model(3, hidden_size=128, head_dim=32, moe_intermediate_size=128, intermediate_size=128)
    save_model(model, tmp / "fp32", layout="per_expert")
    return write_fp8(tmp / "fp32", tmp, (128, 128))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(ForwardBatch.from_lists([0], [TOKENS]), model.new_cache(64))[0]


def test_fp8_layers_and_experts_are_swapped_and_compute_the_dequantized_model(fp8_pair):
    fp8_dir, plain_dir = fp8_pair
    plain = logits(load_model(plain_dir))
    for first, count in ((0, 8), (4, 4)):  # the whole model, and an EP rank's half of the experts
        model = load_model(fp8_dir, first, count)
        swapped = keep_fp8(model, fp8_dir, first, count, mm=reference_mm)
        fp8_linears = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
        fp8_experts = [n for n, m in model.named_modules() if isinstance(m, Fp8Experts)]
        assert {n.rsplit(".", 1)[-1] for n in fp8_linears} >= {"q_proj", "o_proj", "gate_proj", "up_proj"}
        assert len(fp8_experts) == model.cfg.moe_layers and swapped == len(fp8_linears) + len(fp8_experts)
        assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in ("layers.0.self_attn.k_proj",
                                                                                 "lm_head"))  # 64 wide; the head
        assert model.moe_blocks()[0].experts.first == first and model.moe_blocks()[0].experts.count == count
    ours = logits(load_model(fp8_dir))  # dequantized, as on CPU
    model = load_model(fp8_dir)
    keep_fp8(model, fp8_dir, 0, 8, mm=reference_mm)
    kept = logits(model)
    assert torch.equal(ours, plain)
    assert float((kept - plain).norm() / plain.norm()) < 0.05  # only the activations' FP8 rounding differs
    assert not torch.equal(kept, plain)


def test_a_failing_or_wrong_kernel_leaves_the_dequantized_weights(fp8_pair):
    fp8_dir, _ = fp8_pair

    def broken(*_args):
        raise RuntimeError("no kernel for this device")

    def wrong(a, a_scale, w, w_scale, out_dtype):
        return 2 * reference_mm(a, a_scale, w, w_scale, out_dtype)

    for mm in (broken, wrong):
        model = load_model(fp8_dir)
        assert keep_fp8(model, fp8_dir, 0, 8, mm=mm) == 0
        assert not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())
    model = load_model(fp8_dir)
    assert keep_fp8(model, fp8_dir, 0, 8) == 0  # the real kernel: not on a CPU


def test_latent_attention_keeps_the_weights_it_reads_itself(tmp_path):
    """DeepSeek-V3's latent attention multiplies kv_b_proj's weight itself (absorbed into the
    queries and the output), so that layer must stay a plain linear: swapped for an FP8 one, its
    raw FP8 weight would be read without its scales. Every other 128-wide projection is swapped,
    and the model computes what its dequantized twin does up to the activations' FP8 rounding."""
    model = tiny_model(3, hidden_size=128, moe_intermediate_size=128, intermediate_size=128, model_type="deepseek_v3",
                       kv_lora_rank=128, qk_nope_head_dim=16, v_head_dim=16, head_dim=16, num_attention_heads=8,
                       num_key_value_heads=8, q_lora_rank=128)
    save_model(model, tmp_path / "fp32", layout="per_expert")
    fp8_dir, plain_dir = write_fp8(tmp_path / "fp32", tmp_path, (128, 128))
    plain = logits(load_model(plain_dir))
    model = load_model(fp8_dir)
    assert model.layers[0].self_attn.kv_b_proj.weight.shape == (256, 128)  # 8 heads × (16 + 16): it would fit
    assert keep_fp8(model, fp8_dir, 0, 8, mm=reference_mm) > 0
    swapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert {"q_a_proj", "q_b_proj", "o_proj"} <= swapped and "kv_b_proj" not in swapped
    kept = logits(model)
    assert float((kept - plain).norm() / plain.norm()) < 0.05


def test_fp8_layers_are_swapped_on_the_host_before_the_model_moves(fp8_pair, monkeypatch):
    """#29 item 5: a rank swaps its FP8-stored layers before moving the model to its device, so
    what travels (and the device's peak) is the FP8 model, not the dequantized one. The bytes
    handed to `Module.to` are counted: those of the swapped model, well under the dequantized
    model's, and the served logits are the kept-FP8 model's."""
    from actors.target.fp8 import reference_mm
    from actors.target.layout import for_cpu
    from actors.target.worker import load_rank_model

    fp8_dir, _ = fp8_pair
    moved = []
    to = torch.nn.Module.to

    def counting_to(self, *args, **kwargs):
        if self.__class__.__name__ == "MoEModel" or hasattr(self, "layers"):
            moved.append(sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers())))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", counting_to)
    model = load_rank_model(fp8_dir, 0, 8, torch.float32, "cpu", mm=reference_mm)
    dequantized = load_model(fp8_dir)
    full = sum(t.numel() * t.element_size() for t in (*dequantized.parameters(), *dequantized.buffers()))
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    assert len(moved) == 1 and moved[0] < 0.6 * full, (moved, full)
    plain = load_model(fp8_dir)
    keep_fp8(plain, fp8_dir, 0, 8, mm=reference_mm)
    assert torch.equal(logits(model), logits(for_cpu(plain)))  # as a CPU rank lays weights out
