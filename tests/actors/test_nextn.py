"""A target checkpoint's own next-n layer (DeepSeek-V3, GLM-4-MoE) as the MTP drafter (issue
#18): found in the checkpoint under the family's names, built from the target's own layer code
(latent attention for DeepSeek-V3, a MoE block with every expert), chained exactly as a naive
recompute chains it, and lossless in the engine."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from actors.drafter import has_nextn
from actors.drafter.mtp import MTPDrafter
from actors.drafter.nextn import NextNModule
from actors.drafter.target_parts import shared_embeddings, target_final_norm
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.target.checkpoint import load_model
from actors.target.config import MoEConfig
from actors.target.local import LocalTarget
from actors.target.model import ForwardBatch
from deployments.bundle import Bundle
from tests.actors.test_mtp_drafter import naive_chain
from tests.actors.test_target_families import FAMILIES

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41], [3, 4, 3, 4, 3, 4]]


def add_nextn(path: str, seed: int = 0) -> NextNModule:
    """A random next-n layer written into the checkpoint as DeepSeek stores it: its own file,
    per-expert weights, `shared_experts`, the gate's correction bias, copies of the embedding and
    LM head; and `num_nextn_predict_layers: 1` in config.json."""
    config = pathlib.Path(path) / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"num_nextn_predict_layers": 1}))
    embed, head = shared_embeddings(path)
    torch.manual_seed(seed)
    module = NextNModule(MoEConfig.load(path), embed, head)
    prefix = f"model.layers.{module.index}."
    tensors = {prefix + "shared_head.head.weight": head.weight, prefix + "embed_tokens.weight": embed.weight}
    for name, p in module.state_dict().items():
        scale, base = (0.1, 1.0) if "norm" in name else (0.3, 0.0) if "bias" in name else (0.08, 0.0)
        p = base + scale * torch.randn_like(p)
        if name.startswith("mlp.experts."):  # per expert, as DeepSeek stores them
            inter = p.shape[-1] if name.endswith("down") else p.shape[1] // 2
            for e in range(p.shape[0]):
                parts = {"down_proj": p[e]} if name.endswith("down") else {"gate_proj": p[e, :inter],
                                                                          "up_proj": p[e, inter:]}
                tensors |= {f"{prefix}mlp.experts.{e}.{k}.weight": v for k, v in parts.items()}
            continue
        name = name.replace("mlp.shared_expert.", "mlp.shared_experts.")
        tensors[prefix + name.replace("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias")] = p
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              str(pathlib.Path(path) / "nextn.safetensors"))
    return NextNModule.load(path, embed, head)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_the_next_n_layer_chains_as_a_naive_recompute(tmp_path, family):
    _, path = FAMILIES[family](tmp_path)
    assert not has_nextn(path)  # transformers writes no next-n layer
    module = add_nextn(path)
    assert has_nextn(path) and module.is_moe and module.cfg.latent == (family == "deepseek_v3")
    assert float(module.mlp.e_score_correction_bias.abs().sum()) > 0  # read through the family's names
    model, norm = load_model(path), target_final_norm(path)
    n = model.cfg.num_hidden_layers
    drafter = MTPDrafter(module, norm, n, capacity_tokens=4096, block=6)
    local = LocalTarget(model)
    for rid, p in enumerate(PROMPTS):
        rows = local.forward([rid], [p[:-1]], capture_layers=(n,)).features[0][n]
        drafter.commit([rid], [p], [{n: rows}])
    lengths = [5, 3, 1, 4]
    got = drafter.draft(list(range(len(PROMPTS))), [p[-1] for p in PROMPTS], lengths)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            _, captured = model(ForwardBatch.from_lists([0], [p[:-1]], "last"), model.new_cache(256),
                                capture_layers=(n,))
        assert got.tokens[got.cu[i]:got.cu[i + 1]].tolist() == naive_chain(module, p, norm(captured[n]), lengths[i])
    assert np.all((got.confidence > 0) & (got.confidence <= 1))


def test_a_next_n_layer_of_another_model_is_refused(tmp_path):
    _, path = FAMILIES["deepseek_v3"](tmp_path)
    add_nextn(path)
    embed, head = shared_embeddings(path)
    other = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    with pytest.raises(ValueError, match="differs from the target"):
        NextNModule.load(path, embed, other)


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("ep", [1, 2])
def test_deepseek_drafts_with_its_own_next_n_layer_losslessly(tmp_path, ep):
    hf, path = FAMILIES["deepseek_v3"](tmp_path)
    add_nextn(path)
    bundle = Bundle(pathlib.Path(path))
    assert bundle.has("mtp") and "mtp" in bundle.kinds("auto")
    want = []
    for p in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    eng = Engine(EngineConfig(target_dir=path, drafter="mtp", drafter_dir=bundle.drafter_dir("mtp"), block=4,
                              policy="full", ep=ep, cost_model_cache=str(tmp_path)))
    try:
        got = eng.generate(PROMPTS, [SamplingParams(max_tokens=10, ignore_eos=True)] * len(PROMPTS))
        assert [s.output for s in got] == want
        assert sum(sum(s.drafted) for s in got) > 0
    finally:
        eng.shutdown()
