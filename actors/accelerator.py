"""Which accelerator this process sees, and which cost-model hardware preset matches it.

Uses NVML (nvidia-ml-py) because it answers without initialising CUDA or importing torch, so
the coordinator can ask cheaply. Where there is no NVIDIA driver (CPU machines, CI) NVML is
absent or fails to initialise; that is a normal answer here, reported as the "cpu" preset with
the reason, never an exception.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dcut_core.hardware import HARDWARE

log = logging.getLogger(__name__)

# Substrings of NVML device names, most specific first.
_NAME_TO_PRESET = (("H200", "h200"), ("H100", "h100"), ("H800", "h100"), ("H20", "h20"), ("A100", "a100"))


@dataclass(frozen=True)
class Accelerator:
    """What NVML reported (or why it could not)."""

    preset: str  # key of dcut_core.hardware.HARDWARE
    device_name: str | None
    count: int
    memory_bytes: int
    reason: str  # how the preset was chosen


def preset_for_name(device_name: str) -> str | None:
    """Cost-model preset for an NVML device name, or None if we have no figures for it."""
    upper = device_name.upper()
    return next((preset for key, preset in _NAME_TO_PRESET if key in upper), None)


def detect() -> Accelerator:
    """Inspect GPU 0 through NVML; falls back to the CPU preset with a logged reason."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError as exc:  # the dependency is declared; guard anyway for minimal installs
        return _cpu(f"nvidia-ml-py not importable: {exc}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return _cpu(f"NVML unavailable: {exc}")
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return _cpu("NVML reports no GPU")
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    finally:
        pynvml.nvmlShutdown()
    preset = preset_for_name(name)
    if preset is None:
        log.warning("no cost-model preset for GPU %r; using h100 figures until profiled", name)
        return Accelerator("h100", name, count, memory, f"unknown GPU {name!r}; h100 figures")
    assert preset in HARDWARE
    return Accelerator(preset, name, count, memory, f"NVML: {count} × {name}")


def _cpu(reason: str) -> Accelerator:
    log.info("no GPU: %s; using the cpu cost preset", reason)
    return Accelerator("cpu", None, 0, 0, reason)


@dataclass(frozen=True)
class DeviceUsage:
    """One GPU's memory and utilisation as NVML reports them now."""

    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1: share of the last sample period a kernel ran


def device_usage() -> list[DeviceUsage]:
    """Every GPU this process's node has, by NVML index; [] where there is no NVIDIA driver (the
    same normal answer as `detect`). Cheap enough for each /metrics scrape."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            out.append(DeviceUsage(i, name.decode() if isinstance(name, bytes) else name, int(memory.used),
                                   int(memory.total), float(util.gpu) / 100.0))
        return out
    except pynvml.NVMLError as exc:
        log.warning("NVML failed while reading device usage: %s", exc)
        return []
    finally:
        pynvml.nvmlShutdown()
