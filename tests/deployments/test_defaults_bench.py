"""The serving-default benchmark (benchmarks/defaults.py) in its paired mode: every setting's
engine built once, the prompt groups run by each in turn, outputs checked against `ar`'s."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_paired_groups_run_every_setting_beside_ar_and_report_each_over_it(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/defaults.py"), "--paired", "2", "--concurrency", "1",
                           "--prompts", "2", "--max-tokens", "6", "--settings", "default", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # 1: an output differed from ar's
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["setting"], r["concurrency"], r["groups"], r["prompts_a_group"]) for r in rows] == [
        ("ar", 1, 2, 4), ("default", 1, 2, 4)]  # a group: at least 4·C prompts
    ar, default = rows
    assert ar["x_ar"] == ar["ar_median"] == 1.0 and ar["mat"] == 1.0  # plain decoding: one token a step
    assert default["first"] == "default" and default["x_first"] == default["first_median"] == 1.0
    assert default["tok_s"] > 0 and default["ar_min"] <= default["ar_median"] <= default["ar_max"]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len(table) == 2 + 2 + 2 and all(line.count("|") == 10 for line in table[:4])
    assert table[-1].endswith("in every group: True.")
