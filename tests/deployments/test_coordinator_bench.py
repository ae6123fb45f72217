"""The coordinator benchmark's real-target mode, as tests/gpu/run.sh runs it on a GPU (here on
the CPU): the bundled model's outputs are checked against its greedy ones, the engine's own time
per step is measured next to the real forward, and `dcut simulate` reads the results."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from dcut_core.own_time import OwnTime
from deployments.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_own_time_beside_the_real_target_feeds_the_simulator(tmp_path):
    out = tmp_path / "coordinator"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/coordinator.py"), "--target", "real", "--requests",
                           "1,3", "--policies", "ar:8,dcut:8", "--max-tokens", "10", "--num-prompts", "3", "--calls",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = json.loads((out / "results.json").read_text())
    assert {(r["policy"], r["requests"]) for r in records} == {("ar", 1), ("ar", 3), ("dcut", 1), ("dcut", 3)}
    assert all(r["forward"] == "real" and r["forward_ms"] > 0 and r["own_ms"] > 0 for r in records)
    # Function calls per step, counted in a wave of their own: a drafting step makes more of them.
    calls = {(r["policy"], r["requests"]): r["calls_per_step"] for r in records}
    assert all(c > 0 for c in calls.values()) and calls["dcut", 1] > calls["ar", 1], calls
    table = (out / "table.md").read_text().splitlines()
    assert len({line.count("|") for line in table}) == 1  # header, rule and rows: one width
    own = OwnTime.from_records(records, str(out))
    assert own.ms("dcut", 2) > 0
    sim = tmp_path / "sim"
    assert main(["simulate", "--model", "moe-35b-a3b", "--ep", "8", "--batch", "4", "--policies", "dcut", "--steps",
                 "40", "--coordinator-times", str(out / "results.json"), "--out", str(sim)]) == 0
    assert str(out / "results.json") in (sim / "tables.md").read_text()
