"""DFlash drafters (issue #18): a folder written by the `dflash` library itself (tests/fixtures/
dflash/make_reference.py) loads into the block drafter and drafts what the library's forward
computes; variants the block drafter cannot express are refused by name; in the engine a DFlash
folder serves as the block kind, losslessly."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors import safe_open

from actors.drafter import is_dflash
from actors.drafter.block import BlockDrafter
from actors.drafter.dflash import load_block_model, load_dflash
from actors.drafter.target_parts import shared_embeddings
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "dflash"
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41], [3, 4, 3, 4, 3, 4]]


def reference() -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(FIXTURE / "reference.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def shared(ref) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    head = torch.nn.Linear(64, 96, bias=False)
    head.weight = torch.nn.Parameter(ref["head"], requires_grad=False)
    return torch.nn.Embedding.from_pretrained(ref["embed"]), head


def test_a_dflash_folder_drafts_what_the_library_computes():
    ref, meta = reference()
    assert meta == {"dflash": "0.1.0"} and is_dflash(FIXTURE / "drafter")
    model = load_block_model(FIXTURE / "drafter", *shared(ref))
    assert model.cfg.target_layers == (1, 3) and model.cfg.block_size == 4 and model.cfg.qk_norm
    drafter = BlockDrafter(model, capacity_tokens=256, cut=False)
    context = ref["target_hidden"]  # [10, 2H]: outputs of target layers 1 and 3 (1-based)
    drafter.commit([0], [[]], [{1: context[:, :64], 3: context[:, 64:]}])
    block = ref["block"]
    with torch.no_grad():
        ctx_kv = [(drafter.cache.k[i][drafter.cache.slots(0, 0, 10)][None],
                   drafter.cache.v[i][drafter.cache.slots(0, 0, 10)][None]) for i in range(2)]
        hidden = model.block_hidden(block[:1], torch.tensor([10]), ctx_kv, torch.ones(1, 10, dtype=torch.bool), 4)
    torch.testing.assert_close(hidden[0], ref["hidden"], rtol=1e-5, atol=1e-5)
    out = drafter.draft([0], [int(block[0])], [3])
    assert out.tokens.tolist() == ref["logits"].argmax(-1).tolist()  # the library's greedy block
    torch.testing.assert_close(torch.as_tensor(out.confidence), ref["logits"].softmax(-1).max(-1).values.double(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("change", "reason"), [
    ({"architectures": ["DFlash2DraftModel", "DFlashDraftModel"]}, "DFlash-2"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "sliding-window"),
    ({"is_causal": True}, "causal"),
    ({"attention_bias": True}, "biases"),
    ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 95, "output_multiplier": 2.0}}, "multiplier"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "mask_token_id"),
])
def test_variants_the_block_drafter_cannot_express_are_refused(tmp_path, change, reason):
    ref, _ = reference()
    folder = tmp_path / "d"
    shutil.copytree(FIXTURE / "drafter", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=reason):
        load_dflash(folder, *shared(ref))


@pytest.mark.usefixtures("local_ray")
def test_a_dflash_folder_serves_as_the_block_kind_losslessly(tiny_bundle, tmp_path):
    """The fixture's weights over the tiny target (same widths; layers 1 and 3 exist): whatever it
    drafts, the output is the target's own."""
    target_dir = f"{tiny_bundle}/target"
    folder = tmp_path / "dflash"
    shutil.copytree(FIXTURE / "drafter", folder)
    embed, head = shared_embeddings(target_dir)
    assert load_block_model(folder, embed, head).cfg.target_layers == (1, 3)
    want = greedy_decode(LocalTarget(load_model(target_dir)), list(range(len(PROMPTS))), PROMPTS, 12)
    eng = Engine(EngineConfig(target_dir=target_dir, drafter="block", drafter_dir=str(folder), block=4,
                              policy="full", cost_model_cache=str(tmp_path)))
    try:
        out = eng.generate(PROMPTS, [SamplingParams(max_tokens=12)] * len(PROMPTS))
        assert [s.output for s in out] == want
        assert sum(sum(s.drafted) for s in out) > 0
    finally:
        eng.shutdown()
