"""The operator's dashboard and the GPU gauges: the dashboard is a Grafana dashboard whose every
query names a metric the server exports (the live check is in test_openai_api.py); the GPU gauges
come from NVML (nvidia-ml-py), here replaced by a stand-in with two devices."""

from __future__ import annotations

import json
import sys
import types

from actors.accelerator import device_usage
from deployments.metrics import Metrics
from tests.deployments.dashboard import DASHBOARD, exported, queried_metrics


def test_the_dashboard_is_a_grafana_dashboard_over_prometheus():
    d = json.loads(DASHBOARD.read_text())
    assert d["panels"] and d["templating"]["list"][0]["query"] == "prometheus"
    for p in d["panels"]:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"])
    wanted = {"dcut_generated_tokens_total", "dcut_ttft_seconds_bucket", "dcut_tpot_seconds_bucket", "dcut_engine_mat",
              "dcut_engine_drafter_drafts", "dcut_engine_verify_tokens_per_step", "dcut_engine_keep_ratio",
              "dcut_engine_waiting", "dcut_engine_ep_group_rebuilds", "dcut_engine_rank_step_seconds",
              "dcut_gpu_memory_used_bytes", "dcut_gpu_utilization_ratio", "dcut_engine_payoff_lead",
              "dcut_engine_payoff_arm"}
    assert wanted <= queried_metrics()


def stand_in_nvml() -> types.ModuleType:
    """Enough of pynvml for `device_usage`: two GPUs, the second busier."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"Stand-in H200"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 10 ** 9, total=141 * 10 ** 9)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=30 + 40 * h, memory=0)
    return m


def test_gpu_gauges_come_from_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", stand_in_nvml())
    gpus = device_usage()
    assert [(g.index, g.name, g.memory_used_bytes, g.utilization) for g in gpus] == [
        (0, "Stand-in H200", 10 ** 9, 0.3), (1, "Stand-in H200", 2 * 10 ** 9, 0.7)]
    text = Metrics().render({"gpus": [vars(g) for g in gpus], "rank_step_s": [0.012, 0.014],
                             "payoff_leads": {12: 0.93}}).decode()
    assert 'dcut_engine_payoff_lead{requests="12"} 0.93' in text
    assert 'dcut_gpu_utilization_ratio{gpu="1",name="Stand-in H200"} 0.7' in text
    assert 'dcut_gpu_memory_total_bytes{gpu="0",name="Stand-in H200"} 1.41e+11' in text
    assert 'dcut_engine_rank_step_seconds{rank="1"} 0.014' in text
    gpu_queries = {n for n in queried_metrics() if n.startswith("dcut_gpu_")}
    assert gpu_queries and gpu_queries <= exported(text)


def test_without_a_driver_there_are_no_gpu_gauges(monkeypatch):
    nvml = stand_in_nvml()

    def fail():
        raise nvml.NVMLError("NVML Shared Library Not Found")

    nvml.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert device_usage() == []
    assert "dcut_gpu_memory_used_bytes{" not in Metrics().render({"gpus": []}).decode()


def test_the_arm_each_band_plays_is_one_and_an_arm_it_left_is_zero():
    m = Metrics()
    first = m.render({"payoff_leaders": {12: "drafting", 24: "plain"}}).decode()
    assert 'dcut_engine_payoff_arm{arm="drafting",requests="12"} 1.0' in first
    assert 'dcut_engine_payoff_arm{arm="plain",requests="24"} 1.0' in first
    then = m.render({"payoff_leaders": {12: "kind:ngram", 24: "plain"}}).decode()
    assert 'dcut_engine_payoff_arm{arm="drafting",requests="12"} 0.0' in then
    assert 'dcut_engine_payoff_arm{arm="kind:ngram",requests="12"} 1.0' in then
    assert 'dcut_engine_payoff_arm{arm="plain",requests="24"} 1.0' in then
