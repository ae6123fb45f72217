"""`benchmarks/mii_peer.py`, which tests/gpu/run.sh runs on a GPU (here on the CPU): without
deepspeed-mii or CUDA it measures nothing and says so (exit 3: NOT RUN); the engine's half — a
Mixtral-layout checkpoint written with the bundle's tokenizer, served as `dcut serve --model` serves
it, `ar` and `dcut` in waves — runs and checks `dcut`'s outputs against `ar`'s."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "mii_peer.py"


@pytest.mark.skipif(importlib.util.find_spec("mii") is not None and torch.cuda.is_available(),
                    reason="deepspeed-mii and CUDA are here: the peer would run")
def test_without_mii_or_cuda_nothing_is_measured_and_it_says_so(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 3 and "NOT RUN" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_engine_half_serves_a_mixtral_checkpoint_and_dcut_equals_ar(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backends", "engine", "--shape", "tiny", "--dtype", "float32",
                           "--concurrency", "1,3", "--num-prompts", "3", "--max-tokens", "6", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and (out / "checkpoint" / "tokenizer.json").exists()
    rows = json.loads((out / "results.json").read_text())
    assert {(r["system"], r["concurrency"]) for r in rows} == {(s, c) for s in ("engine ar", "engine dcut")
                                                               for c in (1, 3)}
    assert all(r["tokens"] == 3 * 6 and r["wall_s"] > 0 for r in rows)  # EOS ignored: every token made
    by = {(r["system"], r["concurrency"]): r["outputs"] for r in rows}
    assert by["engine dcut", 1] == by["engine ar", 1] and by["engine dcut", 3] == by["engine ar", 3]
    assert (out / "table.md").read_text().count("| engine ") == 4
