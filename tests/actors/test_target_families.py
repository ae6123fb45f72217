"""More MoE families (issue #18): Mixtral, OLMoE, GLM-4-MoE, Hunyuan-MoE and DeepSeek-V3
checkpoints written by transformers itself, with tiny random weights, load and give transformers'
logits (fp32, within 1e-5), and decode greedily through the engine exactly as transformers'
`generate` does, at EP 1, 2 and 4."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.target.checkpoint import load_model
from actors.target.config import MoEConfig
from actors.target.model import ForwardBatch
from tests.actors.fp8_checkpoints import quantize, reference_dequantize, write_fp8
from tests.actors.test_target_model import assert_a_mixed_step_equals_its_parts

TOKENS = [3, 17, 5, 90, 41, 8, 8, 60, 2]
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def mixtral(tmp_path, seed: int = 0):
    cfg = transformers.MixtralConfig(**COMMON, head_dim=16, intermediate_size=32, num_local_experts=8)
    return _write(transformers.MixtralForCausalLM, cfg, tmp_path / "mixtral", seed)


def olmoe(tmp_path, seed: int = 0):
    cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, norm_topk_prob=False,
                                   eos_token_id=0, pad_token_id=1, bos_token_id=None)
    return _write(transformers.OlmoeForCausalLM, cfg, tmp_path / "olmoe", seed)


def _write(cls, cfg, path, seed: int, bias: bool = False):
    torch.manual_seed(seed)
    hf = cls(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # peaked distributions: greedy is not decided by rounding
        for name, t in hf.named_buffers():
            if bias and name.endswith("e_score_correction_bias"):  # zeros by default: make it matter
                t.copy_(0.3 * torch.randn_like(t))
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] == 8 and bias:  # zeros by default
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf, str(path)


def glm4_moe(tmp_path, seed: int = 0):
    """GLM-4-MoE: a dense first layer, sigmoid routing with a correction bias over 2 groups of 4
    experts (1 searched), routed weights scaled by 2.5, an ungated shared expert, q/k norms, q/k/v
    biases, RoPE on half of each head's dims."""
    cfg = transformers.Glm4MoeConfig(**COMMON, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                                     n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
                                     first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                                     partial_rotary_factor=0.5, routed_scaling_factor=2.5)
    cfg.num_hidden_layers = 3
    hf, path = _write(transformers.Glm4MoeForCausalLM, cfg, tmp_path / "glm4_moe", seed, bias=True)
    return hf, path


def hunyuan(tmp_path, seed: int = 0):
    """Hunyuan-MoE: a shared MLP beside the routed experts, the per-head q/k norm after RoPE."""
    cfg = transformers.HunYuanMoEV1Config(**COMMON, head_dim=16, intermediate_size=32, num_experts=8, moe_topk=2,
                                          eos_token_id=0, pad_token_id=1, bos_token_id=2)
    return _write(transformers.HunYuanMoEV1ForCausalLM, cfg, tmp_path / "hunyuan", seed)


YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def deepseek_v3(tmp_path, seed: int = 0, q_lora_rank: int | None = 24, interleave: bool = True, rope=None):
    """DeepSeek-V3: multi-head latent attention (queries through a rank-24 bottleneck, keys and
    values one rank-32 latent plus an 8-dim RoPE key), a dense first layer, grouped sigmoid
    routing with a correction bias, routed weights × 2.5, an ungated shared expert."""
    cfg = transformers.DeepseekV3Config(**(COMMON | {"num_key_value_heads": 4}), intermediate_size=48,
                                        moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, n_group=2,
                                        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12, rope_interleave=interleave,
                                        **({"rope_parameters": rope} if rope else {}))
    cfg.num_hidden_layers = 3
    return _write(transformers.DeepseekV3ForCausalLM, cfg, tmp_path / "deepseek_v3", seed, bias=True)


FAMILIES = {"mixtral": mixtral, "olmoe": olmoe, "glm4_moe": glm4_moe, "hunyuan_v1_moe": hunyuan,
            "deepseek_v3": deepseek_v3}
DENSE_FIRST = ("glm4_moe", "deepseek_v3")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(tmp_path, family):
    hf, path = FAMILIES[family](tmp_path)
    cfg = MoEConfig.load(path)
    assert cfg.model_type == family and cfg.moe_layers == cfg.num_hidden_layers - (family in DENSE_FIRST)
    model = load_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
        ours, _ = model(ForwardBatch.from_lists([0], [TOKENS]), model.new_cache(256))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    half = load_model(path, first_expert=4, local_experts=4)  # an EP rank reads only its own experts
    assert half.moe_blocks()[0].experts.gate_up.shape[0] == 4


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize(("family", "eps"), [("mixtral", (1, 2, 4)), ("olmoe", (1, 2)), ("glm4_moe", (1, 2)),
                                             ("hunyuan_v1_moe", (1, 2)), ("deepseek_v3", (1, 2))])
def test_engine_decodes_as_transformers_generate(tmp_path, family, eps):
    hf, path = FAMILIES[family](tmp_path)
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11], [40, 41, 42, 40, 41, 42, 40]]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    for ep in eps:
        eng = Engine(EngineConfig(target_dir=path, drafter="ngram", policy="full", block=4, ep=ep,
                                  cost_model_cache=str(tmp_path)))
        try:
            got = eng.generate(prompts, [SamplingParams(max_tokens=10, ignore_eos=True)] * len(prompts))
            assert [s.output for s in got] == want, ep
        finally:
            eng.shutdown()


def _logits(hf, path, tokens):
    model = load_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        cache = model.new_cache(256)
        ours, _ = model(ForwardBatch.from_lists([0], [tokens[:5]]), cache)  # a prefix, then the rest cached
        rest, _ = model(ForwardBatch.from_lists([0], [tokens[5:]]), cache)
    return torch.cat([ours, rest]), ref, model, cache


@pytest.mark.parametrize(("q_lora_rank", "interleave"), [(None, True), (24, False)])
def test_latent_attention_variants_and_the_cache_holds_the_latent(tmp_path, q_lora_rank, interleave):
    """Queries from one projection or through the bottleneck, RoPE dims interleaved or not; the
    paged cache holds one row of kv_lora_rank + qk_rope_head_dim per token and layer, no values
    (40 numbers against 2 · 4 heads · 28 for the same model with expanded keys and values)."""
    hf, path = deepseek_v3(tmp_path, q_lora_rank=q_lora_rank, interleave=interleave)
    ours, ref, model, cache = _logits(hf, path, TOKENS * 3)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert cache.k.shape[2:] == (1, 32 + 8) and cache.v.shape[-1] == 0
    assert cache.spec.bytes_per_token == 3 * 40 and model.cfg.latent


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_yarn_rope_scaling(tmp_path, family):
    """YaRN (DeepSeek-V3's long-context RoPE; its mscale also scales MLA's softmax) matches
    transformers, and it matters: the same weights read as plain RoPE give other logits."""
    if family == "deepseek_v3":
        hf, path = deepseek_v3(tmp_path, rope=YARN)
    else:
        cfg = transformers.MixtralConfig(**COMMON, head_dim=16, intermediate_size=32, num_local_experts=8,
                                         rope_parameters=YARN)
        hf, path = _write(transformers.MixtralForCausalLM, cfg, tmp_path / "mixtral", 0)
    tokens = TOKENS * 4
    ours, ref, model, _ = _logits(hf, path, tokens)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert dict(model.cfg.rope_yarn)["factor"] == 40.0
    config = pathlib.Path(path) / "config.json"
    d = json.loads(config.read_text())
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": YARN["rope_theta"]}
    config.write_text(json.dumps(d))
    plain, _, _, _ = _logits(hf, path, tokens)
    assert (plain - ref).abs().max() > 1e-3


def test_unsupported_variants_are_refused_by_name(tmp_path):
    _, path = mixtral(tmp_path)
    d = json.loads((pathlib.Path(path) / "config.json").read_text())
    with pytest.raises(ValueError, match="sliding"):
        MoEConfig.from_dict(d | {"sliding_window": 4096})
    with pytest.raises(ValueError, match="clip_qkv"):
        MoEConfig.from_dict(d | {"model_type": "olmoe", "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="rope scaling"):
        MoEConfig.from_dict(d | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="noaux_tc"):
        MoEConfig.from_dict(d | {"model_type": "deepseek_v3", "topk_method": "greedy", "qk_rope_head_dim": 8})


def test_fp8_block_dequantization_is_exact():
    from actors.target.checkpoint import dequantize_fp8

    torch.manual_seed(0)
    for shape, block in (((200, 300), (128, 128)), ((3, 70, 50), (32, 16)), ((128, 128), (128, 128))):
        q, s = quantize(torch.randn(shape), block)
        assert torch.equal(dequantize_fp8(q, s, block), reference_dequantize(q, s, block))


def test_an_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, make_tiny):
    """Every linear weight of the tiny model stored in FP8 with per-block scales (and the
    quantization_config that says so): loading gives exactly the dequantized weights, and the
    same logits as a float32 checkpoint of those weights."""
    from actors.target.checkpoint import save_model

    save_model(make_tiny(2), tmp_path / "fp32")
    fp8_dir, plain_dir = write_fp8(tmp_path / "fp32", tmp_path, (32, 32))
    fp8, plain = load_model(fp8_dir), load_model(plain_dir)
    for (name, a), (_, b) in zip(fp8.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        la, _ = fp8(ForwardBatch.from_lists([0], [TOKENS]), fp8.new_cache(256))
        lb, _ = plain(ForwardBatch.from_lists([0], [TOKENS]), plain.new_cache(256))
    assert torch.equal(la, lb)
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported quantization"):
        load_model(fp8_dir)


def test_a_sharded_deepseek_checkpoint_loads_and_a_rank_reads_only_its_experts(tmp_path):
    """transformers' own sharding (index + shards): the same logits, and an EP rank's load asks
    the reader for no other rank's expert tensor."""
    from actors.target import checkpoint

    hf, _ = deepseek_v3(tmp_path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    model = load_model(sharded)
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
        ours, _ = model(ForwardBatch.from_lists([0], [TOKENS]), model.new_cache(256))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    read = []
    original = checkpoint._Tensors._tensor

    def spy(self, key, start=None, stop=None):
        read.append(key)
        return original(self, key, start, stop)

    checkpoint._Tensors._tensor = spy
    try:
        load_model(sharded, first_expert=4, local_experts=4)
    finally:
        checkpoint._Tensors._tensor = original
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
    assert experts == {4, 5, 6, 7}


def test_latent_attention_in_a_step_mixing_decoding_rows_and_long_prompt_chunks(tmp_path):
    """Multi-head latent attention attends group by group too (`AttentionPlan.attend`)."""
    _, path = deepseek_v3(tmp_path)
    assert_a_mixed_step_equals_its_parts(load_model(path))
