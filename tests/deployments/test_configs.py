"""Serve and cluster-launcher YAMLs: parsed by Ray's own schemas, plus our cross-field checks."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml
from ray.autoscaler._private.util import validate_config
from ray.serve.schema import ServeDeploySchema

from deployments.settings import ServeSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTERS = sorted((ROOT / "cluster_configs").glob("*.yaml"))


def test_serve_config_parses_with_serves_schema_and_our_settings():
    raw = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app"
    ServeSettings(**app.args)  # the app's args are valid settings
    by_name = {d.name: d for d in app.deployments}
    assert set(by_name) == {"ingress", "engine"}
    for d in by_name.values():
        auto = d.autoscaling_config
        assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
        assert auto["upscale_delay_s"] <= 10 and auto["downscale_delay_s"] <= 300  # minutes, not tens of
    assert by_name["engine"].autoscaling_config["target_ongoing_requests"] <= app.args["max_running"]


def cross_field_problems(cfg: dict) -> list[str]:
    problems = []
    types = cfg["available_node_types"]
    if cfg["head_node_type"] not in types:
        problems.append("head_node_type is not an available node type")
    total_min = 0
    for name, t in types.items():
        lo, hi = t.get("min_workers", 0), t.get("max_workers", 0)
        if lo > hi:
            problems.append(f"{name}: min_workers > max_workers")
        if name != cfg["head_node_type"]:
            total_min += lo
    if total_min > cfg["max_workers"]:
        problems.append("the node types' min_workers exceed the cluster's max_workers")
    return problems


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_configs_validate(path):
    cfg = yaml.safe_load(path.read_text())
    validate_config(cfg)
    assert cross_field_problems(cfg) == []


def test_gpu_cluster_has_a_gpu_node_per_ep_rank():
    cfg = yaml.safe_load((ROOT / "cluster_configs" / "aws-gpu.yaml").read_text())
    gpu_nodes = [t for t in cfg["available_node_types"].values() if t["resources"].get("GPU")]
    assert sum(t["min_workers"] for t in gpu_nodes) >= 2  # EP across two GPU nodes


def test_validation_rejects_broken_configs():
    cfg = yaml.safe_load((ROOT / "cluster_configs" / "local-fake.yaml").read_text())
    bad = copy.deepcopy(cfg) | {"no_such_key": 1}
    with pytest.raises(Exception, match=r"no_such_key|Additional properties"):
        validate_config(bad)
    bad = copy.deepcopy(cfg)
    bad["max_workers"] = "many"
    with pytest.raises(Exception):  # noqa: B017 - jsonschema's error type
        validate_config(bad)
    bad = copy.deepcopy(cfg)
    bad["available_node_types"]["ray.worker.cpu"]["min_workers"] = 5
    assert cross_field_problems(bad)
    bad = copy.deepcopy(cfg)
    del bad["head_node_type"]
    with pytest.raises(Exception):  # noqa: B017
        validate_config(bad)


@pytest.mark.parametrize("load_block", [(0, 8), (4, 1), "4", "x,8"])
def test_a_malformed_load_block_is_refused(load_block):
    with pytest.raises(ValueError, match="load_block"):
        ServeSettings(load_block=load_block)


def test_the_block_defaults_by_kind_and_an_explicit_one_is_kept():
    """The n-gram kind alone: block 16 while one request decodes alone, 8 above; any other kind 8; a
    block or load_block set is used as set (null: one block at every load); the environment's
    text form; and what an engine is built with."""
    assert (ServeSettings().block, ServeSettings().load_block) == (16, (1, 8))
    assert ServeSettings().engine_config().load_block == (1, 8)
    assert (ServeSettings(drafter="mtp").block, ServeSettings(drafter="mtp").load_block) == (8, None)
    assert (ServeSettings(block=8).block, ServeSettings(block=8).load_block) == (8, None)
    assert ServeSettings(load_block=None).load_block is None and ServeSettings(load_block=None).block == 16
    assert ServeSettings(load_block="3,6").load_block == (3, 6) and ServeSettings(load_block="none").load_block is None
    again = ServeSettings(**ServeSettings().model_dump())
    assert (again.block, again.load_block) == (16, (1, 8))

