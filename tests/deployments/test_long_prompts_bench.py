"""`benchmarks/long_prompts.py` runs end to end on a tiny case: every output equals its table's
(the script checks), every cell of (forward, overlap) has a row per round, and its table is one
width."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_long_prompts_bench_runs_every_cell_and_writes_its_table(tmp_path):
    out = tmp_path / "long"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/long_prompts.py"), "--prompt-tokens", "400",
                           "--requests", "3", "--max-tokens", "10", "--prefill-chunk", "96", "--forward", "1",
                           "--rounds", "2", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())
    assert sorted((r["overlap"], r["round"]) for r in rows) == [(False, 0), (False, 1), (True, 0), (True, 1)]
    # 3 prompts of 400 tokens, two chunks of 96 a step: at least 7 steps feed them
    assert all(r["steps"] >= 7 and r["longest_ms"] >= r["median_ms"] > 0 for r in rows)
    table = (out / "table.md").read_text().splitlines()
    assert len({line.count("|") for line in table if line.startswith("|")}) == 1
