"""The start-up profile's cache key (actors/engine/costs.py, issue #29 item 6): a profile is
reused only by a deployment that would measure the same — same model, device, dtype, EP size,
threads and layout — never a CPU profile on a GPU, nor one GPU's on another."""

from __future__ import annotations

import dataclasses

import pytest

import actors.accelerator
from actors.engine.costs import deployment_key
from deployments.settings import ServeSettings


def test_the_key_tells_devices_and_shapes_apart(monkeypatch):
    cfg = ServeSettings().engine_config()
    gpu = {"name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(actors.accelerator, "detect",
                        lambda: actors.accelerator.Accelerator("h100", gpu["name"], 8, 80 << 30, "stand-in"))
    on_cpu = deployment_key(cfg)
    assert deployment_key(dataclasses.replace(cfg)) == on_cpu  # the same deployment: the same key
    on_h100 = deployment_key(dataclasses.replace(cfg, gpus_per_rank=1.0))
    gpu["name"] = "NVIDIA H200"
    on_h200 = deployment_key(dataclasses.replace(cfg, gpus_per_rank=1.0))
    others = {deployment_key(dataclasses.replace(cfg, **change))
              for change in ({"ep": 2}, {"threads_per_rank": cfg.threads_per_rank + 1}, {"in_process": False})}
    assert len({on_cpu, on_h100, on_h200, *others}) == 6


def test_fractional_gpus_are_refused_at_ep_above_one():
    """Two ranks of one NCCL group on one GPU fail at the group's first collective; refused when
    the configuration is made, with the reason (issue #29 item 4)."""
    cfg = ServeSettings().engine_config()
    dataclasses.replace(cfg, gpus_per_rank=0.5)  # EP 1: a rank may share its GPU
    dataclasses.replace(cfg, ep=2, gpus_per_rank=1.0)
    with pytest.raises(ValueError, match="whole number of GPUs"):
        dataclasses.replace(cfg, ep=2, gpus_per_rank=0.5)
