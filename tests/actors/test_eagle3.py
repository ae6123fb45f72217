"""EAGLE-3 drafters (issue #18): both published layouts load and compute what their reference
library computes (fixtures written by speculators 0.9.0 and SpecForge 0.2.0 themselves, see
tests/fixtures/eagle3/make_reference.py), incremental drafting equals a naive recompute, and
the engine stays lossless whatever an EAGLE-3 drafter proposes."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from actors.drafter.eagle3 import Eagle3Drafter, Eagle3Module
from actors.drafter.target_parts import shared_embeddings
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from tests.actors.test_mtp_drafter import naive_chain
from tests.conftest import tiny_eagle3

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "eagle3"
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41], [3, 4, 3, 4, 3, 4]]


def reference(layout: str) -> tuple[dict[str, torch.Tensor], str]:
    path = FIXTURES / f"{layout}.reference.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, next(iter(f.metadata().items()))  # noqa: SIM118


def own_embedding(folder: pathlib.Path) -> torch.nn.Embedding:
    return torch.nn.Embedding.from_pretrained(load_file(str(folder / "model.safetensors"))["embed_tokens.weight"])


def ttt_logits(module: Eagle3Module, features: dict, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The libraries' training-time forward, written out with the module's parts: step k feeds
    the tokens shifted by k and the previous step's outputs, at positions moved on by k; the
    query at i sees step 0's keys up to i and each later step's key at i. [steps, T, draft V]."""
    t, rep = len(ids), module.heads // module.kv_heads
    hidden, step_ids, keys, values, out = module.features(features), ids, [], [], []
    for k in range(steps):
        x = module.combine(step_ids, hidden)
        q, kk, v = module.qkv(x, torch.arange(t) + k)
        keys.append(kk.repeat_interleave(rep, 1))
        values.append(v.repeat_interleave(rep, 1))
        rows = []
        for i in range(t):
            ks = torch.cat([keys[0][:i + 1]] + [s[i:i + 1] for s in keys[1:]])  # [n, H, D]
            vs = torch.cat([values[0][:i + 1]] + [s[i:i + 1] for s in values[1:]])
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], ks) / module.head_dim ** 0.5, dim=-1)
            rows.append(torch.einsum("hn,nhd->hd", w, vs).reshape(-1))
        hidden = module.finish(x, torch.stack(rows))
        out.append(module.draft_logits(hidden))
        step_ids = torch.cat([step_ids[1:], step_ids.new_zeros(1)])
    return torch.stack(out)


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_each_layout_computes_what_its_library_computes(layout):
    folder = FIXTURES / layout
    ref, (library, version) = reference(layout)
    assert library == layout and version
    module = Eagle3Module.load(folder, own_embedding(folder), target_layers=8)
    assert module.cfg.prefix == {"speculators": "layers.0.", "specforge": "midlayer."}[layout]
    layers = module.cfg.target_layers
    assert layers == ((1, 2, 3) if layout == "speculators" else (2, 4, 5))  # stated, or vLLM's default for 8
    h = ref["hidden"]
    features = {layer: h[:, i * 64:(i + 1) * 64] for i, layer in enumerate(layers)}
    with torch.no_grad():
        got = ttt_logits(module, features, ref["input_ids"], steps=3)
    torch.testing.assert_close(got, ref["logits"], rtol=1e-5, atol=1e-5)
    # over the target vocabulary, draft id d sits at target id d + d2t[d]; the rest can never be drafted
    with torch.no_grad():
        full = module.logits(module.features(features)[:2])
    ids = torch.arange(64) + module.d2t
    torch.testing.assert_close(full[:, ids], module.draft_logits(module.features(features)[:2]))
    assert torch.isinf(full).sum() == 2 * (96 - 64)


def test_broken_folders_are_refused_with_the_reason(tmp_path):
    folder = tmp_path / "e"
    shutil.copytree(FIXTURES / "speculators", folder)
    embed = own_embedding(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"speculators_model_type": "mlp"}))
    with pytest.raises(ValueError, match="not EAGLE-3"):
        Eagle3Module.load(folder, embed, 8)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 folder"):
        Eagle3Module.load(folder, embed, 8)
    (folder / "config.json").write_text(json.dumps(config | {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}))
    with pytest.raises(ValueError, match="layer 0, the embeddings"):
        Eagle3Module.load(folder, embed, 8)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not fit"):
        Eagle3Module.load(folder, torch.nn.Embedding(128, 64), 8)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "d2t": tensors["d2t"] + 40}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        Eagle3Module.load(folder, embed, 8)
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        Eagle3Module.load(folder, embed, 8)


def naive_drafts(module: Eagle3Module, model, tokens: list[int], k: int) -> list[int]:
    """From scratch: the target's three feature layers at every committed position, then the chain."""
    from actors.target.model import ForwardBatch

    with torch.no_grad():
        _, captured = model(ForwardBatch.from_lists([0], [tokens[:-1]], "last"), model.new_cache(256),
                            capture_layers=(1, 2, 3))
        return naive_chain(module, tokens, module.features(captured), k)


def test_incremental_drafting_equals_a_naive_full_recompute(tiny_bundle, tmp_path):
    target_dir = f"{tiny_bundle}/target"
    tiny_eagle3(target_dir, tmp_path / "eagle3")
    embed, _ = shared_embeddings(target_dir)
    module = Eagle3Module.load(tmp_path / "eagle3", embed, 3)
    model = load_model(target_dir).eval()
    drafter = Eagle3Drafter(module, capacity_tokens=4096, block=6)
    assert drafter.target_layers == (1, 2, 3)
    local = LocalTarget(model)
    pieces = []
    for rid, p in enumerate(PROMPTS):  # each prompt committed in two pieces, all requests per call
        rows = local.forward([rid], [p[:-1]], capture_layers=(1, 2, 3)).features[0]
        half = max(1, len(p) // 2)
        first = {layer: r[:half] for layer, r in rows.items()}
        rest = {layer: r[half:] for layer, r in rows.items()} if len(p) - 1 > half else {}
        pieces.append(((p[:half], first), (p[half:], rest)))
    for piece in (0, 1):
        drafter.commit(list(range(len(PROMPTS))), [x[piece][0] for x in pieces], [x[piece][1] for x in pieces])
    lengths = [5, 3, 1, 4]
    got = drafter.draft(list(range(len(PROMPTS))), [p[-1] for p in PROMPTS], lengths)
    allowed = set((torch.arange(64) + module.d2t).tolist())
    for i, p in enumerate(PROMPTS):
        drafts = got.tokens[got.cu[i]:got.cu[i + 1]].tolist()
        assert drafts == naive_drafts(module, model, p, lengths[i]) and set(drafts) <= allowed
    assert np.all((got.confidence > 0) & (got.confidence <= 1))


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("ep", [1, 2])
def test_eagle3_drafts_are_verified_losslessly(tiny_bundle, tmp_path, ep):
    target_dir = f"{tiny_bundle}/target"
    reference_out = greedy_decode(LocalTarget(load_model(target_dir)), list(range(len(PROMPTS))), PROMPTS, 12)
    eng = Engine(EngineConfig(target_dir=target_dir, drafter="eagle3", drafter_dir=f"{tiny_bundle}/eagle3", block=6,
                              policy="full", ep=ep, cost_model_cache=str(tmp_path)))
    try:
        for policy in ("full", "dcut", "ar"):
            eng.set_policy(policy)
            out = eng.generate(PROMPTS, [SamplingParams(max_tokens=12)] * len(PROMPTS))
            assert [s.output for s in out] == reference_out, policy
            if policy == "full":
                assert sum(sum(s.drafted) for s in out) > 0
    finally:
        eng.shutdown()
