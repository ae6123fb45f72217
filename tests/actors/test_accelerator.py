"""Accelerator detection degrades to the CPU preset where there is no GPU."""

from __future__ import annotations

import pytest

from actors.accelerator import detect, preset_for_name
from dcut_core.hardware import HARDWARE


def test_detect_never_raises_and_names_a_known_preset():
    acc = detect()
    assert acc.preset in HARDWARE
    assert acc.reason
    if acc.count == 0:
        assert acc.preset == "cpu" and acc.device_name is None


@pytest.mark.parametrize(
    ("name", "preset"),
    [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H20", "h20"),
     ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H800", "h100"), ("Tesla T4", None)],
)
def test_preset_for_device_names(name, preset):
    assert preset_for_name(name) == preset
