"""tests/gpu/run.sh tells the truth (issue #29 item 7), checked here without a GPU: with none
it exits non-zero saying nothing was checked; with a stand-in interpreter that claims CUDA, a
failing, skipping or timing-out check makes it exit 1 and name the check, and only all-pass
exits 0."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).with_name("run.sh")


def run(tmp_path, python: str | None = None) -> tuple[int, str]:
    env = os.environ | {"OUT": str(tmp_path / "out")} | ({"PYTHON": python} if python else {})
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_fails_and_says_nothing_was_checked(tmp_path):
    rc, out = run(tmp_path)
    assert rc == 2 and "NOTHING WAS CHECKED" in out


def stand_in(tmp_path, pytest_says: str, pytest_rc: int, ray: bool, bench_rc: int, coordinator_rc: int = 0,
             rank_step_rc: int = 0, mii_rc: int = 3) -> str:
    """An interpreter that claims a GPU and answers each call of the script as told."""
    path = tmp_path / "python"
    path.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *"import ray"*) exit {0 if ray else 1} ;;
  *"cuda.is_available"*) exit 0 ;;
  *"get_device_name"*) echo "torch stand-in cuda 12 Fake GPU"; exit 0 ;;
  *deployments.cli*) echo bench; exit {bench_rc} ;;
  *benchmarks/coordinator.py*) echo coordinator; exit {coordinator_rc} ;;
  *benchmarks/rank_step.py*) echo rank_step; exit {rank_step_rc} ;;
  *benchmarks/mii_peer.py*) echo mii_peer; exit {mii_rc} ;;
  *"-m pytest"*) printf '%s\\n' "{pytest_says}"; exit {pytest_rc} ;;
esac
exit 3
""")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(("pytest_says", "pytest_rc", "ray", "bench_rc", "coordinator_rc", "failing"), [
    ("5 passed in 3.0s", 0, True, 0, 0, None),
    ("FAILED tests/gpu/test_cuda.py::test_x - boom\n1 failed, 4 passed", 1, True, 0, 0, "cuda-tests"),
    ("SKIPPED [1] tests/gpu/test_cuda.py:35: needs CUDA\n4 passed, 1 skipped", 0, True, 0, 0, "cuda-tests"),
    ("5 passed in 3.0s", 0, True, 1, 0, "engine"),  # an output differs from ar
    ("5 passed in 3.0s", 0, True, 124, 0, "engine"),  # timed out
    ("5 passed in 3.0s", 0, False, 0, 0, "engine"),  # not checked is not passed
    ("5 passed in 3.0s", 0, True, 0, 1, "coordinator"),  # an output differed from greedy, or it crashed
    ("5 passed in 3.0s", 0, True, 0, 124, "coordinator"),  # timed out
    ("5 passed in 3.0s", 0, False, 0, 0, "coordinator"),  # not measured is not passed
    ("5 passed in 3.0s", 0, True, 0, 0, "rank-step"),  # benchmarks/rank_step.py crashed (rc 1 below)
])
def test_any_failing_check_fails_the_script_and_is_named(tmp_path, pytest_says, pytest_rc, ray, bench_rc,
                                                         coordinator_rc, failing):
    rank_step_rc = 1 if failing == "rank-step" else 0
    rc, out = run(tmp_path, stand_in(tmp_path, pytest_says, pytest_rc, ray, bench_rc, coordinator_rc, rank_step_rc))
    summary = (tmp_path / "out" / "summary.txt").read_text()
    if failing is None:
        assert rc == 0 and "FAIL" not in summary, out
    else:
        assert rc == 1 and f"{failing}: FAIL" in summary, out


@pytest.mark.parametrize(("mii_rc", "status", "rc"),
                         [(0, "PASS", 0), (3, "NOT RUN", 0), (1, "FAIL", 1), (124, "FAIL", 1)])
def test_the_mii_peer_fails_the_script_only_when_it_ran_and_failed(tmp_path, mii_rc, status, rc):
    """deepspeed-mii is the optional `gpu` extra: absent (exit 3), the check is NOT RUN and fails
    nothing; present, a crash, an output of `dcut` unlike `ar`'s or a timeout fails the script."""
    got, out = run(tmp_path, stand_in(tmp_path, "5 passed in 3.0s", 0, True, 0, mii_rc=mii_rc))
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert got == rc and f"mii-peer: {status}" in summary, out
