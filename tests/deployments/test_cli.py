"""The command-line contract: every subcommand exists and runs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from dcut_core.cost_model import CostModel, StepShape
from deployments.cli import IMPLEMENTED, SUBCOMMANDS, build_parser, main


def test_every_contract_subcommand_is_declared():
    assert {"serve", "generate", "bench", "profile", "simulate"} <= set(SUBCOMMANDS)  # the contract only adds
    assert set(SUBCOMMANDS) == {"serve", "generate", "bench", "profile", "simulate", "trace", "prior"}
    assert set(IMPLEMENTED) == set(SUBCOMMANDS)


def test_generate_accepts_the_contract_options():
    args = build_parser().parse_args(
        ["generate", "a", "b", "--prompts-file", "f", "--policy", "fixed-4", "--block", "8",
         "--drafter", "ngram", "--max-tokens", "5", "--temperature", "0.7", "--seed", "3",
         "--ep", "2", "--drafters", "2", "--json"]
    )
    assert args.prompts == ["a", "b"] and args.ep == 2 and args.json


def test_simulate_writes_results_and_tables(tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--model", "moe-35b-a3b", "--ep", "8", "--batch", "4,64", "--policies",
                 "full,dcut", "--steps", "60", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())
    assert {(r["policy"], r["batch"]) for r in records} == {("full", 4), ("full", 64), ("dcut", 4), ("dcut", 64)}
    assert all(r["speedup"] > 0 and 0 <= r["keep_ratio"] <= 1 for r in records)
    assert "| dcut |" in (out / "tables.md").read_text()


def test_simulate_takes_a_models_config_json_alone(tmp_path, capsys):
    """A DeepSeek-V3 deployment simulated from its config.json (FP8, MLA, YaRN: the settings that
    change numbers but not cost are dropped, not refused)."""
    root = pathlib.Path(__file__).parents[2]
    out = tmp_path / "sim"
    assert main(["simulate", "--model-config", str(root / "cluster_configs/models/deepseek-v3.json"), "--hardware",
                 "h200", "--ep", "32", "--batch", "16", "--policies", "full,dcut", "--steps", "60",
                 "--out", str(out)]) == 0
    assert "deepseek-v3: 670.9 B parameters, 36.5 B active, 68.6 KiB of KV per token" in capsys.readouterr().out
    tables = (out / "tables.md").read_text()
    assert "## deepseek-v3, h200, EP 32" in tables
    assert "### The coordinator's share of a step" in tables and "| ar | 16 |" in tables and "| dcut | 16 |" in tables


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
    # Non-negative terms: a bigger step is never predicted cheaper. (Strictly more is not a given: the
    # tiny model's steps are nearly flat, and on a busy machine the fit may keep only the fixed term.)
    assert model.predict(StepShape(4, 16, 4 * 64)) >= model.predict(StepShape(1, 1, 16)) > 0


def test_generate_json_matches_plain_decoding(tmp_path, tiny_bundle):
    prompts = ["w5 w6 w7 w5 w6 w7 w5", "w40 w41"]
    args = [sys.executable, "-m", "deployments.cli", "generate", *prompts, "--model-root", tiny_bundle,
            "--max-tokens", "8", "--json", "--block", "6"]
    runs = {}
    for policy, drafter in (("ar", "block"), ("dcut", "block"), ("full", "ngram")):
        proc = subprocess.run([*args, "--policy", policy, "--drafter", drafter], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert [r["prompt"] for r in lines] == prompts
        for r in lines:
            assert {"text", "token_ids", "steps", "accepted", "kept"} <= set(r)
            assert len(r["token_ids"]) == 8 and len(r["accepted"]) == r["steps"] == len(r["kept"])
        runs[policy] = [r["token_ids"] for r in lines]
    assert runs["ar"] == runs["dcut"] == runs["full"]


def test_generate_refuses_no_prompts(tiny_bundle):
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "generate", "--model-root", tiny_bundle],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no prompts" in proc.stderr


def test_bench_writes_results_for_every_policy(tmp_path, tiny_bundle):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "bench", "--model-root", tiny_bundle,
                           "--concurrency", "1,4", "--policies", "ar,full,dcut", "--num-prompts", "4",
                           "--max-tokens", "6", "--block", "6", "--drafter", "ngram", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert {(r["policy"], r["concurrency"]) for r in rows} == {(p, c) for p in ("ar", "full", "dcut") for c in (1, 4)}
    for r in rows:
        assert r["lossless"] and r["output_tok_s"] > 0
        for key in ("mat", "verify_tokens_per_step", "keep_ratio", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50"):
            assert key in r
    assert all((out / f).exists() for f in ("results.csv", "throughput.png", "speedup.png", "keep_ratio.png"))


def test_bench_open_loop_at_a_request_rate(tmp_path, tiny_bundle):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "bench", "--model-root", tiny_bundle,
                           "--request-rate", "20", "--burstiness", "0.5", "--policies", "ar,dcut", "--num-prompts",
                           "6", "--max-tokens", "6", "--block", "6", "--drafter", "ngram", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["policy"], r["request_rate"], r["requests"]) for r in rows] == [("ar", 20.0, 6), ("dcut", 20.0, 6)]
    assert all(r["lossless"] and 1 <= r["concurrency"] <= 6 and r["ttft_ms_p50"] > 0 for r in rows)


def test_gamma_arrivals_have_the_asked_rate_and_spread():
    import numpy as np

    from actors.engine.loadgen import gamma_arrivals

    poisson, bursty = gamma_arrivals(20000, 5.0, 1.0), gamma_arrivals(20000, 5.0, 0.25)
    for t in (poisson, bursty):
        assert t[0] == 0 and (np.diff(t) >= 0).all()
        assert np.diff(t).mean() == pytest.approx(0.2, rel=0.05)
    cv = lambda t: np.diff(t).std() / np.diff(t).mean()  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, rel=0.05) and cv(bursty) == pytest.approx(2.0, rel=0.05)


def test_repeated_bench_rounds_report_medians_of_ratios():
    from deployments.bench_command import median_rows

    def row(policy, rep, tok_s, speedup, lossless=True):
        return {"policy": policy, "concurrency": 64, "repeat": rep, "output_tok_s": tok_s,
                "speedup_vs_ar": speedup, "lossless": lossless, "mat": tok_s / 100}

    runs = [row("ar", 0, 900, 1.0), row("dcut", 0, 890, 0.99),
            row("ar", 1, 1000, 1.0), row("dcut", 1, 1050, 1.05, lossless=False),
            row("ar", 2, 800, 1.0), row("dcut", 2, 840, 1.05)]
    rows = {r["policy"]: r for r in median_rows(runs)}
    assert rows["ar"]["output_tok_s"] == 900 and rows["ar"]["speedup_vs_ar"] == 1.0
    d = rows["dcut"]
    assert d["output_tok_s"] == 890 and d["mat"] == 8.9  # the median round, whole
    assert d["speedup_vs_ar"] == 1.05 and d["speedup_vs_ar_runs"] == [0.99, 1.05, 1.05]  # median of ratios
    assert d["repeats"] == 3 and d["lossless"] is False  # one round differed: the row says so


def test_generate_serves_a_hugging_face_folder_and_names_what_it_cannot(tmp_path):
    """`--model DIR`: a Mixtral folder as transformers writes it, with its tokenizer and
    generation config, decodes as transformers' `generate` does (`--drafter auto` finds only
    n-gram lookup there); a folder of an unsupported family is refused with the reason."""
    import torch
    import transformers

    from tests.conftest import tiny_tokenizer

    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=95)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    folder = tmp_path / "mixtral"
    hf.save_pretrained(folder)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 95]}))
    prompt = [5, 6, 7, 5, 6, 7]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=0,
                           pad_token_id=0)[0, len(prompt):].tolist()
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "generate", " ".join(f"w{t}" for t in prompt),
                           "--model", str(folder), "--drafter", "auto", "--policy", "full", "--max-tokens", "8",
                           "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    assert got["token_ids"] == want  # generation_config's first EOS (0) ends both, if it comes
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "generate", "w1", "--model", str(folder),
                           "--drafter", "ngram"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and "cannot be served" in proc.stderr and "llama" in proc.stderr


def test_trace_then_simulate_over_it_and_a_prior(tmp_path, tiny_bundle):
    """`dcut trace` writes a trace (and a prior) of a prompts file; `dcut simulate --trace` replays
    the engine's decisions over it for each setting beside the oracle."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w5 w6 w7 w5\nw9 w10 w11 w9 w10\nw3 w4 w3 w4 w3 w4\n")
    trace, prior, out = tmp_path / "t.trace", tmp_path / "prior.json", tmp_path / "sim"
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "trace", "--prompts-file", str(prompts),
                           "--model", tiny_bundle, "--max-tokens", "10", "--block", "5", "--drafter", "block,ngram",
                           "--cost-model-cache", str(tmp_path / "cache"), "--out", str(trace), "--prior", str(prior)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(json.loads(prior.read_text())["kinds"]) == {"block", "ngram"}
    assert json.loads(prior.read_text())["tuned"] == ["block", "ngram"]  # `tuned`: the one set of two or more
    again = tmp_path / "again.json"
    again.write_text(prior.read_text().replace('"tuned": [', '"tuned": ["mtp", '))
    assert main(["prior", "--traces", f"{trace},{trace}", "--out", str(again), "--keep-rates", "--levels", "1",
                 "--orders", "1"]) == 0
    kept = json.loads(again.read_text())
    assert kept["tuned"] == ["block", "ngram"] and kept["kinds"] == json.loads(prior.read_text())["kinds"]
    assert main(["simulate", "--trace", str(trace), "--batch", "1,2", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {r["setting"] for r in rows} == {"ar", "block", "ngram", "auto", "auto, hindsight predictions", "oracle"}
    assert all(r["tok_s"] > 0 for r in rows) and "oracle" in (out / "tables.md").read_text()


def test_tuned_hosts_the_kinds_the_bundles_prior_names(tmp_path, tiny_bundle):
    """`--drafter tuned`: the kinds the bundle's prior names (`dcut prior`), in the bundle's order;
    every kind it holds where the prior names none or one it lacks; `auto`: every kind."""
    from deployments.bundle import Bundle
    from deployments.settings import ServeSettings

    for part in ("target", "drafter", "mtp", "eagle3", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / part).symlink_to(pathlib.Path(tiny_bundle) / part)
    bundle, every = Bundle(tmp_path), ("block", "mtp", "eagle3", "ngram")
    assert bundle.kinds("tuned") == bundle.kinds("auto") == every  # no prior
    (tmp_path / "prior.json").write_text(json.dumps({"version": 1, "kinds": {}, "tuned": ["ngram", "mtp"]}))
    assert bundle.kinds("tuned") == ("mtp", "ngram") and bundle.kinds("auto") == every
    cfg = ServeSettings(model_root=str(tmp_path), drafter="tuned").engine_config()
    assert cfg.kinds == ("mtp", "ngram")
    (tmp_path / "prior.json").write_text(json.dumps({"version": 1, "kinds": {}, "tuned": ["mtp", "medusa"]}))
    assert bundle.kinds("tuned") == every
