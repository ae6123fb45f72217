"""Train the block drafter by self-distillation from the trained demo target.

    OMP_NUM_THREADS=2 .venv/bin/python -m tools.demo.train_drafter     # the shipped drafter, ≈ 45 min

1. The target continues corpus prompts (75 % greedy, 25 % sampled at temperature 0.8) and its
   hidden states after layers `--target-layers` are captured (`distill.py`).
2. Blocks are cut at random anchors p inside the continuation: input [token at p, MASK × (K−1)],
   context = features of positions < p, labels = the continuation's tokens p+1 .. p+K−1. Block
   sizes K ∈ {4, 8, 16} are mixed so one drafter serves every --block. Cross-entropy with weights
   0.8^(j−1) by draft position j (early drafts matter most: a miss ends the run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from actors.drafter.model import DraftConfig, DraftModel
from actors.target.checkpoint import load_model
from tools.demo.distill import DistillSet, DistillSpec, cached
from tools.demo.train_target import lr_at

BLOCKS = (4, 8, 16)


def batch_loss(model: DraftModel, data: DistillSet, seqs: torch.Tensor, anchors: int, block: int,
               rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean weighted loss and per-position accuracy [K − 1] for blocks cut from `seqs`."""
    tokens, feats = data.tokens[seqs], data.features[seqs].float()  # [S, T], [S, T, L·H]
    s, t = tokens.shape
    proj = model.project(feats).reshape(s * t, -1)
    cos, sin = model.rope(torch.arange(t).repeat(s))
    kv = [layer.context_kv(proj, cos, sin) for layer in model.layers]
    kv = [(k.view(s, t, *k.shape[1:]), v.view(s, t, *v.shape[1:])) for k, v in kv]
    lo, hi = data.prompt_len - 1, t - block
    p = torch.from_numpy(rng.integers(lo, hi + 1, (s, anchors)))  # [S, A]
    owner = torch.arange(s)[:, None].expand(s, anchors).reshape(-1)  # [B]
    p = p.reshape(-1)
    ctx_kv = [(k[owner], v[owner]) for k, v in kv]
    mask = torch.arange(t)[None, :] < p[:, None]  # [B, T]
    hidden = model.block_hidden(tokens[owner, p], p, ctx_kv, mask, block)  # [B, K, H]
    logits = model.logits(hidden[:, 1:])  # [B, K−1, N] over the head's vocabulary
    labels = tokens[owner[:, None], p[:, None] + torch.arange(1, block)[None, :]]  # [B, K−1] token ids
    column = torch.full((int(model.lm_head.weight.shape[0]),), -100, dtype=torch.long)
    column[model.head_ids] = torch.arange(len(model.head_ids))
    target = column[labels]  # tokens outside the head cannot be drafted: no loss on them
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none",
                         ignore_index=-100)
    weights = 0.8 ** torch.arange(block - 1, dtype=torch.float32)
    loss = (ce.view(-1, block - 1) * weights).sum(1).mean() / weights.sum()
    acc = (model.head_ids[logits.argmax(-1)] == labels).float().mean(0)
    return loss, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/demo/target")
    ap.add_argument("--tokenizer", default="models/demo/tokenizer.json")
    ap.add_argument("--out", default="models/demo/drafter")
    ap.add_argument("--sequences", type=int, default=12288)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--total-len", type=int, default=128)
    ap.add_argument("--sample-fraction", type=float, default=0.25,
                    help="share of continuations sampled at temperature 0.8 (the rest greedy)")
    ap.add_argument("--target-layers", default="2,4,6")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-tokens", type=int, default=2048, help="draft only the N most frequent tokens")
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--seqs-per-step", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="runs/demo/drafter_log.jsonl")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = load_model(args.target)
    layers = tuple(int(x) for x in args.target_layers.split(","))
    tag = f"_s{args.sample_fraction:g}"
    cache = pathlib.Path(f"runs/demo/distill_{args.sequences}_{args.total_len}{tag}.pt")
    data = cached(target, args.tokenizer, "train", cache,
                  DistillSpec(args.sequences, args.prompt_len, args.total_len, layers, args.sample_fraction,
                              seed=args.seed))
    cfg = DraftConfig(target.cfg.hidden_size, layers, num_layers=args.layers, block_size=max(BLOCKS),
                      rope_theta=target.cfg.rope_theta, head_tokens=args.head_tokens)
    for p in target.parameters():
        p.requires_grad_(False)
    model = DraftModel(cfg, target.embed_tokens, target.lm_head)
    generated = data.tokens[:, data.prompt_len:].reshape(-1)  # what the target itself writes
    counts = torch.bincount(generated, minlength=target.cfg.vocab_size)
    model.set_head_tokens(torch.argsort(counts, descending=True, stable=True)[: args.head_tokens])
    coverage = counts[model.head_ids].sum().item() / counts.sum().item()
    print(f"draft head: {args.head_tokens} tokens cover {100 * coverage:.1f} % of the target's continuations")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    n_val = max(64, args.sequences // 16)  # the last sequences are kept for validation
    log = pathlib.Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"drafter: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M own parameters, "
          f"{len(data.tokens) - n_val} training sequences")
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="drafter", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, 100)
        seqs = torch.from_numpy(rng.integers(0, len(data.tokens) - n_val, args.seqs_per_step))
        loss, _ = batch_loss(model, data, seqs, args.anchors, int(rng.choice(BLOCKS)), rng)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 250 == 0 or step + 1 == args.steps:
            with torch.no_grad():
                val_rng = np.random.default_rng(99)
                seqs = torch.arange(len(data.tokens) - n_val, len(data.tokens))
                val_loss, acc = batch_loss(model, data, seqs, 4, 16, val_rng)
            record = {"step": step + 1, "minutes": (time.time() - t0) / 60, "val_loss": val_loss.item(),
                      "val_accuracy_by_position": [round(a, 3) for a in acc.tolist()]}
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(json.dumps(record))
            model.save(args.out)


if __name__ == "__main__":
    main()
