"""Measure the demo pair for docs/model.md: target quality, drafter MAT, calibration, cost.

    .venv/bin/python -m tools.demo.evaluate [--prompts 48] [--out runs/demo/eval.json]

Held-out prompts are windows of the corpus's validation split (files neither model trained on).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
import torch

from actors.drafter.block import BlockDrafter
from actors.drafter.model import DraftModel
from actors.drafter.ngram import NgramDrafter
from actors.drafter.speculate import SpecTrace, speculative_greedy
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from dcut_core.acceptance import Calibrator, expected_calibration_error, verify_outcomes
from dcut_core.ragged import offsets_from_lengths
from tools.demo.data import token_array, windows
from tools.demo.train_target import validation_loss


def distinct_4gram_ratio(tokens: list[int]) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def judged(trace: SpecTrace) -> dict[str, np.ndarray]:
    """Every judged draft (censoring as in dcut_core.acceptance): request, position, outcome."""
    req, pos, ok, conf, margin = [], [], [], [], []
    for i, (dr, ac, cf, mg) in enumerate(zip(trace.drafted, trace.accepted, trace.confidence, trace.margin,
                                             strict=True)):
        for d, a, c, m in zip(dr, ac, cf, mg, strict=True):
            idx, y = verify_outcomes(offsets_from_lengths([d]), [d], [a])
            req += [i] * len(idx)
            pos += idx.tolist()
            ok += y.tolist()
            conf += c[idx].tolist()
            margin += m[idx].tolist()
    return {k: np.asarray(v) for k, v in
            {"request": req, "position": pos, "accepted": ok, "confidence": conf, "margin": margin}.items()}


def calibration(j: dict[str, np.ndarray], block: int) -> dict[str, float]:
    """Raw ECE, and out-of-fold calibrated ECE (2 folds by request)."""
    raw = expected_calibration_error(j["confidence"], j["accepted"])
    pred = np.empty(len(j["accepted"]))
    for fold in (0, 1):
        train, test = j["request"] % 2 != fold, j["request"] % 2 == fold
        cal = Calibrator(block=block)
        cal.observe(j["confidence"][train], j["margin"][train], j["position"][train], j["accepted"][train])
        cal.fit()
        pred[test] = cal.estimate(j["confidence"][test], j["margin"][test], j["position"][test])
    return {"raw_ece": raw, "calibrated_ece": expected_calibration_error(pred, j["accepted"]),
            "judged_drafts": len(pred)}


def by_position(j: dict[str, np.ndarray], k: int) -> list[float]:
    """P(draft j accepted | drafts < j accepted), j = 0 .. k − 1."""
    return [float(j["accepted"][j["position"] == p].mean()) if (j["position"] == p).any() else float("nan")
            for p in range(k)]


def drafting_cost(target, drafter: BlockDrafter, arr, rng, batches=(1, 4, 16, 64), context=128, repeats=5):
    rows = []
    for b in batches:
        ids = list(range(b))
        prompts = windows(arr, rng, b, context - 1).tolist()
        lt = LocalTarget(target)
        pre = lt.forward(ids, prompts, logits="last", capture_layers=drafter.target_layers)
        drafter.commit(ids, prompts, pre.features)
        t_draft, t_verify = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            d = drafter.draft(ids, [p[-1] for p in prompts], [drafter.block - 1] * b)
            t_draft.append(time.perf_counter() - t0)
            chunks = [[p[-1], *d.tokens[d.cu[i]:d.cu[i + 1]].tolist()] for i, p in enumerate(prompts)]
            out = lt.forward(ids, chunks, logits="all", capture_layers=drafter.target_layers)
            t_verify.append(out.wall_s)
            lt.truncate(dict.fromkeys(ids, context))
        drafter.release(ids)
        rows.append({"batch": b, "draft_ms": 1e3 * float(np.median(t_draft)),
                     "verify_ms": 1e3 * float(np.median(t_verify)),
                     "ratio": float(np.median(t_draft) / np.median(t_verify))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/demo/target")
    ap.add_argument("--drafter", default="models/demo/drafter")
    ap.add_argument("--tokenizer", default="models/demo/tokenizer.json")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/demo/eval.json")
    ap.add_argument("--plot", default="docs/img/acceptance_per_request.png")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.target)
    drafter_model = DraftModel.load(args.drafter, target.embed_tokens, target.lm_head)
    val = token_array(args.tokenizer, "validation")
    rng = np.random.default_rng(7)
    prompts = windows(val, rng, args.prompts, 31).tolist()  # 32-token held-out prompts
    ids = list(range(len(prompts)))
    result: dict = {"target": {"parameters_m": sum(p.numel() for p in target.parameters()) / 1e6,
                               "validation_loss": validation_loss(target, val, 256)}}
    ar = greedy_decode(LocalTarget(target), ids, prompts, args.new_tokens)
    ratios = [distinct_4gram_ratio(t) for t in ar]
    result["target"] |= {"distinct_4gram_ratio_mean": float(np.mean(ratios)),
                         "repetitive_of": [int(sum(r < 0.5 for r in ratios)), len(ratios)]}
    result["drafter"] = {"own_parameters_m": sum(p.numel() for p in drafter_model.parameters()) / 1e6,
                         "config": json.loads(drafter_model.cfg.to_json())}
    per_request = {}
    for name in ("block", "ngram"):
        for block in (4, 8, 16):
            if name == "block":
                drafter, layers = BlockDrafter(drafter_model, block_size=block), drafter_model.cfg.target_layers
            else:
                drafter, layers = NgramDrafter(block_size=block), ()
            trace = speculative_greedy(LocalTarget(target), drafter, ids, prompts, args.new_tokens, block - 1,
                                       layers)
            assert trace.tokens == ar, "speculative output differs from plain greedy decoding"
            j = judged(trace)
            mats = trace.mat_per_request()
            result[f"{name}_b{block}"] = {"mat": trace.mat(), "mat_per_request_min": float(mats.min()),
                                          "mat_per_request_max": float(mats.max()),
                                          "acceptance_by_position": by_position(j, block - 1),
                                          **calibration(j, block)}
            per_request[f"{name}_b{block}"] = trace.mat_per_request().tolist()
    result["cost"] = drafting_cost(target, BlockDrafter(drafter_model, block_size=16), val, rng)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result | {"per_request_mat": per_request}, indent=1))
    plot_histogram(per_request, args.plot)
    print(json.dumps(result, indent=1))


def plot_histogram(per_request: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(1, 16, 31)
    for key, label in (("block_b16", "block drafter, block 16"), ("ngram_b16", "n-gram drafter, block 16"),
                       ("block_b8", "block drafter, block 8")):
        ax.hist(per_request[key], bins=bins, alpha=0.5, label=label)
    ax.set_xlabel("mean accepted tokens per step of one request (MAT, bonus included)")
    ax.set_ylabel("requests")
    ax.set_title("Per-request acceptance on held-out prompts (greedy)")
    ax.legend()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
