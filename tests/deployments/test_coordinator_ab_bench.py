"""The commit A/B of the coordinator's own time (benchmarks/coordinator_ab.py): coordinator.py in a
worktree of the base commit and in the working tree, alternating, the worktree removed after."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/coordinator_ab.py")


def worktrees() -> int:
    out = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.count("worktree ")


def test_both_sides_run_every_round_and_the_base_worktree_is_removed(tmp_path):
    before = worktrees()
    proc = subprocess.run([sys.executable, SCRIPT, "--base", "HEAD", "--rounds", "2", "--requests", "1",
                           "--policies", "ar:8", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["side"], r["round"]) for r in res["runs"]) == [("base", 0), ("base", 1), ("new", 0), ("new", 1)]
    (row,) = res["summary"]
    assert row["policy"] == "ar" and row["requests"] == 1 and row["rounds"] == 2
    assert row["own_base"] > 0 and row["own_new"] > 0 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert "| ar (7) | 1 | 2 |" in (tmp_path / "table.md").read_text()
    assert worktrees() == before


def test_a_base_that_is_no_commit_is_refused():
    proc = subprocess.run([sys.executable, SCRIPT, "--base", "no-such-revision-here"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "not a commit" in proc.stderr, proc.stderr[-2000:]
