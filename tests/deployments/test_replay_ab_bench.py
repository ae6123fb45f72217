"""The replay A/B benchmark (benchmarks/replay_ab.py): variants of the engine's settings over the
replay target, every output checked against the bundled model's greedy one."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/replay_ab.py")


def test_variants_run_beside_ar_and_are_reported_over_it(tmp_path):
    from dcut_core.cost_model import CostModel, preset

    variants = {"gated": {}, "ungated, block 4": {"drafting_gate": False, "block": 4}}
    truth = tmp_path / "truth.json"  # a forward of 0.2 ms plus a concave token cost
    truth.write_text(CostModel(preset("moe-35b-a3b", "cpu").model, 1, {"fixed": 2e-4, "batching": 1e-5}).to_json())
    proc = subprocess.run([sys.executable, SCRIPT, "--variants", json.dumps(variants), "--concurrency", "1,2",
                           "--rounds", "2", "--num-prompts", "3", "--max-tokens", "8", "--out", str(tmp_path),
                           "--forward-model", str(truth)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["variant"], r["concurrency"], r["round"]) for r in rows} == {
        (v, c, k) for v in ("ar", *variants) for c in (1, 2) for k in (0, 1)}
    assert all(r["tok_s"] > 0 for r in rows)
    assert all(r["mat"] == 1.0 for r in rows if r["variant"] == "ar")  # plain decoding: one token a step
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len(table) == 2 + 2 * len(variants) and all(line.count("|") == 6 for line in table)


def test_the_reported_prompts_are_refused_and_unknown_settings_named():
    for args, says in ((["--seed", "11"], "training draw"),
                       (["--variants", '{"x": {"no_such_setting": 1}}'], "no_such_setting"),
                       (["--forward-model", "/no/such/model.json"], "not a cost model's JSON")):
        proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]


def test_a_forward_split_prices_a_steps_base_and_its_extra_tokens_apart():
    from benchmarks.replay_ab import forward_split
    from dcut_core.cost_model import StepShape, preset

    model = preset("moe-35b-a3b", "cpu")
    plain, drafting = StepShape(16, 16, 16 * 100), StepShape(16, 48, 16 * 100)
    assert forward_split(model, 1.0, 1.0) == model.predict  # the default: the profile's time
    seconds = forward_split(model, 0.8, 2.0)
    assert seconds(plain) == 0.8 * model.predict(plain)
    added = model.predict(drafting) - model.predict(plain)
    assert added > 0 and abs(seconds(drafting) - (0.8 * model.predict(plain) + 2.0 * added)) < 1e-12
    proc = subprocess.run([sys.executable, SCRIPT, "--forward-split", "0,1"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "two positive numbers" in proc.stderr, proc.stderr[-2000:]
