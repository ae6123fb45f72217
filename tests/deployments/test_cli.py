"""The command-line contract: every subcommand exists; unfinished ones say so and fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dcut_core.cost_model import CostModel, StepShape
from deployments.cli import PENDING, SUBCOMMANDS, build_parser, main


def test_every_contract_subcommand_is_declared():
    assert set(SUBCOMMANDS) == {"serve", "generate", "bench", "profile", "simulate"}


def test_generate_accepts_the_contract_options():
    args = build_parser().parse_args(
        ["generate", "a", "b", "--prompts-file", "f", "--policy", "fixed-4", "--block", "8",
         "--drafter", "ngram", "--max-tokens", "5", "--temperature", "0.7", "--seed", "3",
         "--ep", "2", "--drafters", "2", "--json"]
    )
    assert args.prompts == ["a", "b"] and args.ep == 2 and args.json


@pytest.mark.parametrize("command", sorted(PENDING))
def test_pending_subcommands_exit_nonzero_with_the_issue(command, capsys):
    assert main([command]) == 2
    assert f"issue #{PENDING[command][0]}" in capsys.readouterr().err


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "deployments.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout


def test_profile_writes_a_cost_model(tmp_path, tiny_checkpoint):
    out = tmp_path / "cm.json"
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "profile", "--model", tiny_checkpoint,
                           "--out", str(out), "--ep", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out shapes" in proc.stdout
    model = CostModel.from_json(out.read_text())
    assert model.ep == 2 and model.source == "fitted"
    assert model.predict(StepShape(4, 16, 4 * 64)) > model.predict(StepShape(1, 1, 16)) > 0
