"""CUDA checks (skipped without a GPU): the target's rank code on the device gives the CPU's
logits, and expert dispatch keeps every index op on one device. `tests/gpu/run.sh` runs these
with a short bench on a GPU machine."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from actors.target.checkpoint import load_model
from actors.target.model import ForwardBatch
from actors.target.moe import StepStats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BUNDLED = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
PROMPTS = [[11, 12, 13, 14, 15], [40, 41], [7] * 37]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the tests here that need one (a second `ray.init` in a process raises:
    the first GPU run's second failure), shut down after them."""
    import ray

    from actors.ray_env import start_local_ray

    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


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


LATENT = dict(model_type="deepseek_v3", kv_lora_rank=128, qk_nope_head_dim=16, v_head_dim=16, head_dim=16,
              num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128)


@pytest.mark.parametrize("latent", [False, True])
def test_fp8_weights_stay_fp8_on_a_gpu_that_multiplies_them(tmp_path, latent):
    """On capability ≥ 9.0: the FP8 checkpoint's 128-wide layers and experts are swapped for FP8
    ones using `F.scaled_mm` block-wise (the device check passes), and the logits are the
    dequantized model's up to the activations' FP8 rounding — for standard attention and for
    DeepSeek-V3's latent attention, whose `kv_b_proj` stays dequantized (it reads that weight
    itself). Below 9.0 nothing is swapped."""
    from actors.target.checkpoint import save_model
    from actors.target.fp8 import Fp8Experts, Fp8Linear, device_supports_fp8, keep_fp8
    from tests.actors.fp8_checkpoints import write_fp8
    from tests.conftest import tiny_model

    shape = LATENT if latent else dict(head_dim=32)
    model = tiny_model(3, hidden_size=128, moe_intermediate_size=128, intermediate_size=128, **shape)
    save_model(model, tmp_path / "fp32", layout="per_expert")
    fp8_dir, plain_dir = write_fp8(tmp_path / "fp32", tmp_path, (128, 128))
    tokens = [3, 17, 5, 90, 41, 8, 8, 60, 2, 33, 71]

    def logits(path, keep):
        m = load_model(str(path)).to("cuda").eval()
        swapped = keep_fp8(m, path, 0, 8) if keep else 0
        b = ForwardBatch.from_lists([0], [tokens])
        with torch.no_grad():
            out = m(ForwardBatch(b.request_ids, b.tokens.cuda(), b.cu, b.logit_index.cuda()), m.new_cache(64))[0]
        return out.float().cpu(), swapped, m

    plain, _, _ = logits(plain_dir, False)
    kept, swapped, m = logits(fp8_dir, True)
    if not device_supports_fp8("cuda"):
        assert swapped == 0
        return
    assert swapped > 0 and any(isinstance(x, Fp8Experts) for x in m.modules())
    if latent:
        names = {n.rsplit(".", 1)[-1] for n, x in m.named_modules() if isinstance(x, Fp8Linear)}
        assert "q_b_proj" in names and "kv_b_proj" not in names
    assert float((kept - plain).norm() / plain.norm()) < 0.05


def test_bf16_serving_on_cuda_parts_from_plain_decoding_only_at_near_ties(tmp_path, local_ray):
    """The demo model served in bf16 with the rank on the GPU (EP 1, in this process): greedy
    `full` drafting against `ar`, and bf16 `ar` against float32 `ar`, may differ only where the two
    tokens' float32 logits are within bf16's rounding (tests/actors/test_dtype.py); the KV cache
    is bf16 and sized from the GPU's free memory; drafts were accepted."""
    from tests.actors.test_dtype import bf16_against_plain

    prompts = [[11, 12, 13, 14, 15] * 4, [40, 41, 42] * 5, [7] * 37, list(range(100, 140))]
    diverged, far, accepted = bf16_against_plain(str(BUNDLED), str(tmp_path), prompts, 48, gpus_per_rank=1)
    assert accepted > 0
    assert not far, (diverged, far)


def test_nvml_reports_the_gpus_for_the_dashboard():
    """The /metrics GPU gauges read NVML: on a GPU machine it must see the devices torch sees."""
    from actors.accelerator import device_usage

    gpus = device_usage()
    assert len(gpus) >= torch.cuda.device_count() >= 1
    assert all(g.memory_total_bytes > 0 and 0.0 <= g.utilization <= 1.0 for g in gpus)


def test_hosted_drafters_draft_on_the_gpu_with_device_features():
    """A drafter hosted by a GPU rank moves there (`Drafter.to`, done by `attach`) and takes the
    rank's features as device tensors: every kind of the bundle drafts on CUDA what it drafts on
    the CPU (greedy; float32 weights on both), and its weights and caches are on the GPU."""
    import numpy as np

    from actors.engine.backlog import CatchUp
    from actors.engine.replica import Drafter
    from actors.target.local import LocalTarget
    from deployments.settings import ServeSettings

    spec = ServeSettings(drafter="auto").engine_config().drafter_spec()
    gpu, cpu = Drafter(spec).to("cuda"), Drafter(spec)
    model = LocalTarget(load_model(spec.target_dir))
    history = {0: list(range(100, 140)), 1: [11, 12, 13, 14, 15] * 6}
    layers = gpu.target_layers()
    feats = [model.forward([r], [h[:-1]], capture_layers=layers).features[0] for r, h in history.items()]
    rids, last = list(history), [h[-1] for h in history.values()]
    gpu.commit(CatchUp(rids, list(history.values()), [{k: torch.as_tensor(v).half().cuda() for k, v in f.items()}
                                                      for f in feats]))
    cpu.commit(CatchUp(rids, list(history.values()), [{k: torch.as_tensor(v).half().numpy() for k, v in f.items()}
                                                      for f in feats]))
    for k, d in enumerate(gpu.drafters):
        if hasattr(d, "cache"):
            assert d.cache.k.is_cuda, spec.kinds[k]
        a, b = gpu.draft(rids, last, [6, 6], None, [k, k]), cpu.draft(rids, last, [6, 6], None, [k, k])
        assert len(a.tokens) == len(b.tokens) > 0, spec.kinds[k]
        assert np.mean(a.tokens == b.tokens) >= 0.9, (spec.kinds[k], a.tokens, b.tokens)


def test_experts_run_as_a_grouped_matmul_in_bf16():
    """On SM >= 8.0 a bf16 rank's experts run as two grouped matmuls (`F.grouped_mm`), and their
    rows agree with one matmul per expert to bf16's resolution (different kernels round apart)."""
    from actors.target.moe import LocalExperts, grouped_mm_runs

    capable = torch.cuda.get_device_capability() >= (8, 0)
    assert grouped_mm_runs("cuda:0", torch.bfloat16) == capable
    torch.manual_seed(0)
    experts = LocalExperts(256, 384, 0, 8).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(experts.gate_up, std=0.05)
    torch.nn.init.normal_(experts.down, std=0.05)
    counts = [5, 0, 17, 1, 0, 64, 3, 2]
    rows = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    assert experts.uses_grouped(rows) == capable
    experts.grouped = False
    loop = experts(rows, counts).float()
    experts.grouped = None
    grouped = experts(rows, counts, torch.tensor(counts, device="cuda")).float()
    assert torch.allclose(grouped, loop, atol=2e-2, rtol=2e-2), (grouped - loop).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_decode_forward_synchronises_once_per_moe_layer(dtype):
    """`torch.cuda.set_sync_debug_mode` counts what waits for the device in one decode step of
    the bundled model, its batch uploaded and checked as the rank does (the token range on the
    host array): with grouped experts at most one in the whole forward (at EP 1 the expert
    counts stay on the device), else at most one per MoE layer (the expert counts) and one per
    forward (the batch's lengths). float16 (the demo checkpoint's, as served): torch's grouped
    matmul has no kernel for it and waits twice a call in its fallback (12 a forward on the
    2026-12-04 run; still faster than one matmul per expert), so two per MoE layer there."""
    import warnings

    from actors.target.host import upload

    model = load_model(str(BUNDLED)).to("cuda", dtype).eval()
    cache = model.new_cache(4096)

    def batch(chunks):
        b = ForwardBatch.from_lists(list(range(len(chunks))), chunks, "all")
        return ForwardBatch(b.request_ids, upload(b.tokens, "cuda"), b.cu, upload(b.logit_index, "cuda")), b.tokens

    with torch.no_grad():
        model.forward(batch(PROMPTS)[0], cache, StepStats())
        torch.cuda.synchronize()
        step, host = batch([[1], [2], [3]])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model.forward(model.prepare(step, cache, host.numpy()), cache, StepStats())
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    from actors.target.moe import grouped_mm_runs

    # EP 1 with grouped experts: no MoE layer reads its counts back (session 25); else one each
    if grouped_mm_runs("cuda", dtype, without_host=True):
        budget = 1
    else:  # the fallback's two copies of the groups' ends, or the counts' one copy
        budget = (2 if grouped_mm_runs("cuda", dtype) else 1) * model.cfg.moe_layers + 1
    assert len(syncs) <= budget, syncs


def test_decode_and_verify_steps_replay_as_cuda_graphs():
    """bf16 at EP 1 (`actors/target/graphs.py`): each bucket met is captured once; a replayed step
    gives the same step padded and run eagerly bit for bit (the same kernels on the same shapes),
    the unpadded forward's argmax except where its two best logits are near-tied, the same
    features and cache lengths; and a graphed step waits for the host nowhere."""
    import warnings

    from actors.target.graphs import StepGraphs
    from actors.target.host import upload

    model = load_model(str(BUNDLED)).to("cuda", torch.bfloat16).eval()
    assert StepGraphs.wanted("auto", model, 1, "cuda:0")
    caches = [model.new_cache(8192) for _ in range(3)]
    graphed, padded = StepGraphs(model, caches[0], "auto"), StepGraphs(model, caches[1], "padded")

    def prepare(cache, ids, chunks):
        b = ForwardBatch.from_lists(ids, chunks, "all")
        batch = ForwardBatch(b.request_ids, upload(b.tokens, "cuda"), b.cu, upload(b.logit_index, "cuda"))
        return model.prepare(batch, cache, b.tokens.numpy())

    ids = list(range(len(PROMPTS)))
    for cache in caches:
        model.forward(prepare(cache, ids, PROMPTS), cache)
    steps = [[[1], [2], [3]], [[4, 5, 6], [7], [8, 9]], [[1], [2], [3]], [list(range(20, 31)), [5], [6, 7]]]
    syncs = 0
    for chunks in steps:
        prep = prepare(caches[0], ids, chunks)
        captures = graphed.captures
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                got, feats = graphed.forward(prep, StepStats(), capture_layers=(2,))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if graphed.captures == captures:  # a capture itself synchronises (torch.cuda.graph); a replay must not
            syncs += sum("synchroniz" in str(w.message) for w in caught)
        same, same_feats = padded.forward(prepare(caches[1], ids, chunks), StepStats(), capture_layers=(2,))
        want = model.forward(prepare(caches[2], ids, chunks), caches[2], capture_layers=(2,))[0].float()
        assert torch.equal(got, same) and torch.equal(feats[2], same_feats[2])
        # where the argmax differs, the unpadded forward rates the graphed pick within twice the
        # row's rounding difference of its own best (bf16 spacing near the top logits is 1/16)
        pick = got.float().argmax(-1)
        gap = want.max(-1).values - want.gather(1, pick[:, None])[:, 0]
        noise = (got.float() - want).abs().max(-1).values
        assert bool((gap <= 2 * noise).all()), "an argmax differs beyond the padded shapes' rounding"
    assert syncs == 0
    assert [caches[0].length(r) for r in ids] == [caches[2].length(r) for r in ids]
    # buckets (requests, queries, keys): (4, 1, 256), (4, 4, 256), (4, 16, 256); the third step replays the first's
    assert graphed.stats() | {"capture_s": 0} == {"mode": "auto", "graphs": 3, "captures": 3, "replays": 4,
                                                  "capture_s": 0}


def test_a_world_size_one_nccl_group_dispatches_and_agrees():
    """The data group on NCCL, world size 1 (one GPU): the MoE exchanges go through its
    all-to-all and give the local dispatch's logits; the all-reduce of `all_agree` takes a device
    flag; and the group is made with NCCL's errors raised in the calling thread (unless the
    operator set otherwise), so a failed collective reaches the step and the engine rebuilds."""
    import os
    import socket

    from actors.target.parallel import all_agree, apply_expert_parallel, join_groups

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    preset = {k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")}
    _, data, _ = join_groups(("127.0.0.1", port), 0, 1, "nccl", timeout_s=60, rendezvous_s=30)
    if preset["TORCH_NCCL_ASYNC_ERROR_HANDLING"] is None:
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    if preset["TORCH_NCCL_BLOCKING_WAIT"] is None:
        assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert all_agree(data, True, "cuda") and not all_agree(data, False, "cuda")
    local = load_model(str(BUNDLED)).to("cuda").eval()
    parallel = load_model(str(BUNDLED)).to("cuda").eval()
    apply_expert_parallel(parallel, 0, 1, data)
    batch = ForwardBatch.from_lists([0, 1], [PROMPTS[0], PROMPTS[1]], "all")
    batch = ForwardBatch(batch.request_ids, batch.tokens.cuda(), batch.cu, batch.logit_index.cuda())
    with torch.no_grad():
        want, _ = local.forward(batch, local.new_cache(4096), StepStats())
        got, _ = parallel.forward(batch, parallel.new_cache(4096), StepStats())
    assert torch.equal(got, want)


def test_a_rank_forward_on_cuda_equals_the_cpu_with_sampling_controls_grammar_and_logprobs(local_ray):
    """`TargetRank.forward` — the rank's whole step, not only the model — on CUDA against the CPU,
    both float32: a greedy request with log-probabilities, a sampling one with penalties, a
    logit bias, top-k and min-p, and a sampling one under a grammar's mask. The argmax and the
    draws agree (a draw may flip only where float32 rounding moves a uniform across a token's
    edge: at most one row), the log-probabilities to float32's accuracy, and every drawn token
    under the grammar is one it allows."""
    import numpy as np

    from actors.target.sampling import Controls, RequestControls
    from actors.target.worker import RankBatch, TargetRank, WorkerSpec

    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(0)
    chunks = [list(range(20, 32)), [7, 8, 9, 7, 8, 9, 7, 8], list(range(100, 110))]
    tokens = np.array([t for c in chunks for t in c], dtype=np.int64)
    cu = np.cumsum([0] + [len(c) for c in chunks])
    m = len(tokens)
    vocab = load_model(str(BUNDLED)).cfg.vocab_size
    owner = np.repeat(np.arange(3), np.diff(cu))
    mask = np.zeros((len(chunks[2]), (vocab + 31) // 32 * 32), dtype=bool)
    for row in mask:  # each row allows 40 tokens
        row[rng.choice(vocab, 40, replace=False)] = True
    allowed = np.packbits(mask, axis=-1, bitorder="little").view(np.int32)  # the grammar's bitmask format
    penal = Controls(0.4, 0.2, 1.3, ((5, 2.0), (17, -3.0)), 0, (), 20, 0.05)
    controls = (None, RequestControls(penal, np.zeros(0, dtype=np.int64), 4),
                RequestControls(Controls(top_k=50), np.zeros(0, dtype=np.int64), 3, allowed))
    temperature = np.where(owner == 0, 0.0, 0.9).astype(np.float32)
    rb = RankBatch([0, 1, 2], tokens, cu, np.arange(m), temperature=temperature,
                   top_p=np.full(m, 0.95, dtype=np.float32), logprob_rows=owner == 0, controls=controls,
                   uniform=rng.random(m))
    results = {}
    for device in ("cpu", "cuda"):
        rank = TargetRank(WorkerSpec(str(BUNDLED), 0, 1, kv_capacity_tokens=4096, device=device, dtype="float32"))
        rank.setup(("127.0.0.1", 0))
        results[device] = rank.forward(rb)
    cpu, gpu = results["cpu"], results["cuda"]
    assert np.array_equal(gpu.argmax, cpu.argmax)
    assert (gpu.sampled != cpu.sampled).sum() <= 1, (gpu.sampled, cpu.sampled)
    assert np.allclose(gpu.logprobs, cpu.logprobs, atol=2e-3)
    drawn = gpu.sampled[owner == 2]
    assert mask[np.arange(len(drawn)), drawn].all(), drawn


def test_attention_groups_on_cuda_give_what_one_padded_batch_gives(monkeypatch):
    """Requests of 6-300 context tokens and 1-4 new ones attending in groups that pad fewer pairs
    (on CPU ranks by default: `GROUP_DEVICES`) give on the GPU, in float32, the logits one padded
    batch gives: the path is ready to be switched on there once its trade is measured."""
    import actors.target.layers as layers

    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(str(BUNDLED)).to("cuda").eval()
    g = torch.Generator().manual_seed(3)
    contexts = [6 + (i * 97) % 295 for i in range(40)]
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in contexts]
    steps = [torch.randint(0, model.cfg.vocab_size, (1 + i % 4,), generator=g).tolist() for i in range(40)]

    assert len(prompts) >= layers.GROUP_FROM and len(layers.split_padded(
        np.arange(40), np.array(contexts) + [len(s) for s in steps], np.array([len(s) for s in steps]))) > 1

    def step() -> torch.Tensor:
        cache = model.new_cache(32768)
        for chunks in (prompts, steps):
            b = ForwardBatch.from_lists(list(range(40)), chunks, "all")
            b = ForwardBatch(b.request_ids, b.tokens.to("cuda"), b.cu, b.logit_index.to("cuda"))
            logits, _ = model.forward(b, cache, StepStats())
        return logits.float().cpu()

    one = step()
    monkeypatch.setattr(layers, "GROUP_DEVICES", ("cpu", "cuda"))
    grouped = step()
    assert torch.allclose(grouped, one, atol=2e-3, rtol=1e-3), (grouped - one).abs().max()
    assert torch.equal(grouped.argmax(-1), one.argmax(-1))
