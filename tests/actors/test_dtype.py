"""The serving dtype (issue #29 item 1): a rank computes in the checkpoint's dtype on an
accelerator and float32 on the CPU unless told otherwise; its KV cache is in that dtype and sized
from the device's free memory on a GPU; argmax, sampling and acceptance stay float32. In bf16 the
greedy output of a drafting policy may part from plain decoding's only where the two candidates'
logits are within bf16's rounding of each other (a verify step computes a position in a batch of
another shape): `divergences_are_near_ties` checks every such place against the float32 model and
the bf16 model's own error there."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.costs import deployment_key
from actors.engine.sequence import SamplingParams
from actors.target.checkpoint import checkpoint_dtype, load_model, save_model, serving_dtype
from actors.target.kv_cache import tokens_for_memory
from actors.target.local import LocalTarget
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("local_ray")
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4], [20, 21, 22, 23, 20, 21],
           [30, 31, 30, 31], [40, 41, 42, 43, 44, 40, 41], [50, 51], [60, 61, 62, 60, 61, 62]]


def test_the_checkpoints_dtype_is_read_from_its_config_or_its_weights(tmp_path):
    model = tiny_model()
    save_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    save_model(model, tmp_path / "f32")
    assert checkpoint_dtype(tmp_path / "bf16") == torch.bfloat16  # no torch_dtype: the stored weights'
    assert checkpoint_dtype(tmp_path / "f32") == torch.float32
    config = json.loads((tmp_path / "f32" / "config.json").read_text())
    (tmp_path / "f32" / "config.json").write_text(json.dumps(config | {"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path / "f32") == torch.float16  # what the publisher declared wins
    assert serving_dtype("auto", "cpu", tmp_path / "bf16") == torch.float32
    assert serving_dtype("auto", "cuda", tmp_path / "bf16") == torch.bfloat16
    assert serving_dtype("bfloat16", "cpu", tmp_path / "f32") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        serving_dtype("float64", "cpu", tmp_path / "f32")


def test_kv_tokens_fill_what_the_weights_and_the_reserve_leave():
    gib = 2**30
    # 80 GiB device, 0.9 of it: 72 GiB; 20 GiB of weights, 2 GiB reserve: 50 GiB at 100 KiB a token
    assert tokens_for_memory(80 * gib, 20 * gib, 0.9, 100 * 1024, 16, 2 * gib) == 50 * gib // (100 * 1024) // 16 * 16
    assert tokens_for_memory(80 * gib, 20 * gib, 0.9, 100 * 1024, 16, 2 * gib) % 16 == 0
    assert tokens_for_memory(80 * gib, 75 * gib, 0.9, 1024, 16) == 0  # nothing left: never negative
    assert tokens_for_memory(1000, 0, 1.0, 10, 16) == 96  # whole blocks only


def test_a_closed_ranks_cached_gpu_memory_counts_as_free(monkeypatch, tiny_checkpoint):
    """torch's caching allocator keeps a closed rank's KV cache, and the device reports it used;
    the next rank in the process must count it free (the first GPU run's failure: a second engine
    in one process found "room for only 0 KV tokens"). The CUDA calls are stood in for here;
    tests/gpu/test_cuda.py builds two engines in one process on a real GPU."""
    from actors.target.gpu import memory_in_use
    from actors.target.worker import TargetRank, WorkerSpec

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 100 * gib))  # 90 used
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 85 * gib)  # this process holds 85
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * gib)  # 5 in live tensors
    assert memory_in_use(torch.device("cuda")) == (10 * gib, 100 * gib)  # 90 - (85 - 5) idle
    rank = TargetRank(WorkerSpec(tiny_checkpoint, 0, 1, device="cuda"))
    rank.model = load_model(tiny_checkpoint)
    spec = rank.model.cache_spec(16, 16)
    per_token = spec.bytes_per_token * 4
    assert rank._kv_tokens() == tokens_for_memory(100 * gib, 10 * gib, 0.9, per_token, 16, 2 * gib) > 0
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * gib)  # nothing idle: 90 in use
    with pytest.raises(RuntimeError, match="room for only 0 KV tokens"):
        rank._kv_tokens()


def test_the_profile_of_one_dtype_is_never_reused_for_another(tiny_bundle):
    f32 = EngineConfig(target_dir=f"{tiny_bundle}/target", dtype="float32")
    assert deployment_key(f32) == deployment_key(EngineConfig(target_dir=f"{tiny_bundle}/target"))  # auto on CPU
    assert deployment_key(f32) != deployment_key(EngineConfig(target_dir=f"{tiny_bundle}/target", dtype="bfloat16"))


def divergences_are_near_ties(target_dir: str, prompts: list[list[int]], a: list[list[int]],
                              b: list[list[int]]) -> tuple[int, list[str]]:
    """Where outputs a and b of one prompt first differ (tokens x and y), the two must be a tie
    as far as bf16 can tell: the float32 model's logits of x and y within twice the bf16 model's
    own error there (the largest |bf16 − float32| of that position's logits: two bf16
    computations of another batch shape can each be off by that much), and both that close to
    the top. Returns (divergences, the places that were not such ties)."""
    models = [LocalTarget(load_model(target_dir, dtype=d).eval(), kv_capacity_tokens=8192)
              for d in (torch.float32, torch.bfloat16)]
    diverged, far = 0, []
    for i, (p, x, y) in enumerate(zip(prompts, a, b, strict=True)):
        t = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
        if t is None:
            continue
        diverged += 1
        rows = []
        for m in models:
            rows.append(m.forward([i], [p + x[:t]], logits="last", with_logits=True).logits[-1].astype(np.float64))
            m.release([i])
        l32, l16 = rows
        err = float(np.abs(l16 - l32).max())
        gap, below_top = abs(l32[x[t]] - l32[y[t]]), l32.max() - min(l32[x[t]], l32[y[t]])
        if gap > 2 * err or below_top > 2 * err:
            far.append(f"prompt {i} at {t}: {x[t]} vs {y[t]}, float32 logits {l32[x[t]]:.4f} / {l32[y[t]]:.4f}, "
                       f"top {l32.max():.4f}, bf16 error there {err:.4f}")
    return diverged, far


def bf16_against_plain(target_dir: str, cache: str, prompts: list[list[int]], max_tokens: int,
                       **engine) -> tuple[int, list[str], int]:
    """Serve `prompts` in bf16 with `ar` and then `full` drafting (the same engine) and check each
    divergence against the float32 model; also bf16 `ar` against float32 `ar`. Returns (divergences
    seen, those that were not near-ties, tokens accepted from drafts)."""
    cfg = EngineConfig(target_dir=target_dir, drafter="ngram", block=6, policy="full", dtype="bfloat16",
                       cost_model_cache=cache, max_running=len(prompts), **engine)
    params = [SamplingParams(max_tokens=max_tokens)] * len(prompts)
    eng = Engine(cfg)
    try:
        (rank,) = eng.target.ranks
        assert rank["dtype"] == "bfloat16" and eng.target.local.model.lm_head.weight.dtype == torch.bfloat16
        assert eng.target.local.cache.k.dtype == torch.bfloat16
        eng.set_policy("ar")
        plain = [s.output for s in eng.generate(prompts, params)]
        eng.set_policy("full")
        drafted = eng.generate(prompts, params)
    finally:
        eng.shutdown()
    ref = Engine(EngineConfig(target_dir=target_dir, policy="ar", dtype="float32", cost_model_cache=cache, **engine))
    try:
        fp32 = [s.output for s in ref.generate(prompts, params)]
    finally:
        ref.shutdown()
    n1, far1 = divergences_are_near_ties(target_dir, prompts, plain, [s.output for s in drafted])
    n2, far2 = divergences_are_near_ties(target_dir, prompts, fp32, plain)
    return n1 + n2, far1 + far2, sum(sum(s.accepted) for s in drafted)


@pytest.mark.parametrize("model", ["tiny", "demo"])
def test_bf16_serving_parts_from_plain_decoding_only_at_near_ties(tiny_bundle, tmp_path, model):
    """The tiny model, and the bundled demo model on 16 prompts of its training draw (on this
    code: 5 places where outputs part, each a tie within the bf16 model's own error)."""
    if model == "tiny":
        target, prompts, n = f"{tiny_bundle}/target", PROMPTS, 24
    else:
        from tokenizers import Tokenizer

        from deployments.bundle import BUNDLED
        from deployments.workload import mixed_prompts

        tok = Tokenizer.from_file(f"{BUNDLED}/tokenizer.json")
        target, prompts, n = f"{BUNDLED}/target", [tok.encode(t).ids[:120] for _, t in mixed_prompts(16, seed=23)], 48
    diverged, far, accepted = bf16_against_plain(target, str(tmp_path), prompts, n)
    assert accepted > 0  # it speculated
    assert not far, (diverged, far)
