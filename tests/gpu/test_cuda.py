"""CUDA checks (skipped without a GPU): the target's rank code on the device gives the CPU's
logits, and expert dispatch keeps every index op on one device. `tests/gpu/run.sh` runs these
with a short bench on a GPU machine."""

from __future__ import annotations

import pathlib

import pytest
import torch

from actors.target.checkpoint import load_model
from actors.target.model import ForwardBatch
from actors.target.moe import StepStats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BUNDLED = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
PROMPTS = [[11, 12, 13, 14, 15], [40, 41], [7] * 37]


def forward_on(device: str) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Prefill then one 3-token verify step on `device`, moved there as the rank worker does."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(str(BUNDLED)).to(device).eval()
    cache = model.new_cache(4096)
    out = []
    for step, chunks in enumerate([PROMPTS, [[1, 2, 3]] * len(PROMPTS)]):
        b = ForwardBatch.from_lists(list(range(len(chunks))), chunks, "all")
        b = ForwardBatch(b.request_ids, b.tokens.to(device), b.cu, b.logit_index.to(device))
        logits, captured = model.forward(b, cache, StepStats(), capture_layers=(2,) if step else ())
        out.append(logits.float().cpu())
    return torch.cat(out), {k: v.float().cpu() for k, v in captured.items()}


def test_rank_forward_on_cuda_matches_cpu_fp32():
    cpu_logits, cpu_feats = forward_on("cpu")
    gpu_logits, gpu_feats = forward_on("cuda")
    assert torch.allclose(gpu_logits, cpu_logits, atol=2e-3, rtol=1e-3), (gpu_logits - cpu_logits).abs().max()
    assert torch.equal(gpu_logits.argmax(-1), cpu_logits.argmax(-1))
    assert torch.allclose(gpu_feats[2], cpu_feats[2], atol=2e-3, rtol=1e-3)


def test_expert_dispatch_stays_on_the_device():
    from actors.target.moe import Dispatch, LocalExperts

    experts = LocalExperts(16, 8, 0, 4).cuda()
    x = torch.randn(5, 16, device="cuda")
    idx = torch.tensor([[0, 3], [1, 1], [2, 0], [3, 2], [0, 1]], device="cuda")
    w = torch.full((5, 2), 0.5, device="cuda")
    y = Dispatch()(x, idx, w, experts, 4, StepStats())
    assert y.device.type == "cuda" and y.shape == (5, 16)
