"""The cost model's view of the target families (issue #18): the shape read from a config.json
counts exactly the weights the checkpoint holds, and its KV term exactly what the paged cache
stores per token; config.json files of models this machine cannot hold give their published
sizes."""

from __future__ import annotations

import pathlib

import pytest

from actors.target.checkpoint import load_model
from actors.target.config import MoEConfig, model_shape
from dcut_core.cost_model import preset
from tests.actors.test_target_families import FAMILIES

MODELS = pathlib.Path(__file__).parents[2] / "cluster_configs" / "models"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shape_counts_every_weight_matrix_and_the_cache_row(tmp_path, family):
    hf, path = FAMILIES[family](tmp_path)
    shape = MoEConfig.load(path).shape()
    matrices = sum(p.numel() for name, p in hf.named_parameters()
                   if p.dim() >= 2 and not name.endswith("mlp.gate.weight") and "gate.wg" not in name)
    assert shape.total_params == matrices
    model = load_model(path)
    cache = model.new_cache(64)
    assert shape.layers * shape.kv_per_token == cache.spec.bytes_per_token


@pytest.mark.parametrize(("name", "total", "active", "kv_row", "param_bytes"), [
    ("deepseek-v3", 671e9, 37e9, 512 + 64, 1),  # DeepSeek-V3 report: 671 B, 37 B activated; FP8 weights
    ("hunyuan-a13b-class", 80e9, 13e9, 2 * 8 * 128, 2),  # Hunyuan-A13B model card: 80 B, 13 B active
])
def test_config_json_presets_have_their_published_sizes(name, total, active, kv_row, param_bytes):
    shape = model_shape(MODELS / f"{name}.json")
    assert shape.name == name and shape.param_bytes == param_bytes and shape.kv_per_token == kv_row
    assert abs(shape.total_params / total - 1) < 0.02 and abs(shape.active_params / active - 1) < 0.03
    cost = preset(shape, "h200", ep=8)
    assert cost.coef["kv_read"] == pytest.approx(shape.layers * kv_row * 2 / 4.8e12 / 8)


def test_latent_attention_reads_less_kv_but_attends_in_a_wider_space():
    """MLA's cache row (576 values a layer for DeepSeek-V3) is 1/71 of its 128 heads' expanded keys
    (192 wide) and values (128); its per-key score work grows with the latent rank instead."""
    mla = model_shape(MODELS / "deepseek-v3.json")
    expanded = mla.heads * (mla.qk_nope_head_dim + mla.head_dim) + mla.heads * mla.v_head_dim
    assert expanded == 40960 and 71 * mla.kv_per_token < expanded < 72 * mla.kv_per_token
    assert mla.attention_flops_per_key == 2 * 128 * (2 * 512 + 64)
