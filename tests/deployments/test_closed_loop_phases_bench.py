"""The closed loop's phases (benchmarks/closed_loop_phases.py): each system's run split into full
decode steps, steps that feed prompts and the drain tail; outputs checked equal across systems."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/closed_loop_phases.py")


def test_every_step_is_in_one_phase_and_plain_decoding_drafts_nothing():
    proc = subprocess.run([sys.executable, SCRIPT, "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "8",
                           "--systems", "ar,default"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows] == ["ar", "default"]
    for r in rows:
        decoded = sum(r[k][2] for k in ("full", "prefill", "tail"))
        assert 0 < decoded <= 4 * 8 and r["tok_s"] > 0
        assert r["prefill"][0] >= 2  # two waves of two prompts at least
    ar = rows[0]
    assert ar["leads"] == {}  # plain decoding has no payoff check


def test_the_reported_prompts_are_refused():
    proc = subprocess.run([sys.executable, SCRIPT, "--seed", "11"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2 and "training draw" in proc.stderr, proc.stderr[-2000:]
