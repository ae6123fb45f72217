"""`benchmarks/rank_step.py`, which tests/gpu/run.sh runs on a GPU (here on the CPU): every
(dtype, R, q) row is measured, each step sees the same context (the cache rolled back), and the
table is written."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("rank_step", ROOT / "benchmarks" / "rank_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_step_sees_the_same_context_and_every_row_is_written(tmp_path):
    bench = load_bench()
    rig = bench.StepRig(str(bench.BUNDLED), "cpu", torch.float32, requests=3, context=20)
    for q in (1, 4):
        assert rig.step(q) > 0
        assert [rig.cache.length(r) for r in rig.ids] == [20, 20, 20]
    assert bench.main(["--device", "cpu", "--dtypes", "float32", "--requests", "1,2", "--tokens", "1,3",
                       "--steps", "2", "--context", "8,16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["context"], r["requests"], r["tokens"]) for r in rows] == [
        (c, r, q) for c in (8, 16) for r in (1, 2) for q in (1, 3)]
    assert all(r["wall_ms"] >= r["host_ms"] > 0 and r["top_ops"] for r in rows)
    assert (tmp_path / "table.md").read_text().count("| float32 |") == 8


def test_the_graphed_step_is_measured_only_on_a_gpu():
    bench = load_bench()
    rig = bench.StepRig(str(bench.BUNDLED), "cpu", torch.float32, requests=2, context=8)
    assert bench.measure_graph(rig, 1, 1) == {"graph_error": "CUDA graphs need a CUDA device, not cpu"}
