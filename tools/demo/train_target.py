"""Train the demo target (DEMO_TARGET shape) on the corpus, on CPU, reproducibly.

    .venv/bin/python -m tools.demo.train_target --steps 3000 --out models/demo/target

Fixed seeds and a fixed step count make the run reproducible on the same machine kind (thread
scheduling aside). Every `--eval-every` steps the validation loss is logged to
runs/demo/target_log.jsonl and the weights are written (float16) to --out, so an interrupted run
still leaves a usable model.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from actors.target.checkpoint import save_model
from actors.target.demo import DEMO_TARGET
from actors.target.model import MoETransformer
from tools.demo.data import token_array, windows


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


@torch.no_grad()
def validation_loss(model: MoETransformer, val: np.ndarray, length: int, batches: int = 16) -> float:
    rng = np.random.default_rng(1234)  # the same windows every time
    losses = []
    for _ in range(batches):
        w = torch.from_numpy(windows(val, rng, 8, length))
        logits, _ = model.forward_train(w[:, :-1])
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item())
    return float(np.mean(losses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--tokenizer", default="models/demo/tokenizer.json")
    ap.add_argument("--out", default="models/demo/target")
    ap.add_argument("--log", default="runs/demo/target_log.jsonl")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, val = token_array(args.tokenizer, "train"), token_array(args.tokenizer, "validation")
    model = MoETransformer(DEMO_TARGET)
    model.init_random(args.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(args.seed)
    log = pathlib.Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"target: {params / 1e6:.2f} M parameters, {len(train) / 1e6:.2f} M training tokens")
    t0, seen = time.time(), 0
    bar = tqdm(range(args.steps), desc="target", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        w = torch.from_numpy(windows(train, rng, args.batch, args.length))
        logits, aux = model.forward_train(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        (loss + args.aux * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += args.batch * args.length
        bar.set_postfix(loss=f"{loss.item():.3f}", aux=f"{aux.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            val_loss = validation_loss(model, val, args.length)
            model.train()
            record = {"step": step + 1, "tokens": seen, "minutes": (time.time() - t0) / 60,
                      "train_loss": loss.item(), "val_loss": val_loss, "aux": aux.item()}
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(json.dumps(record))
            save_model(model, args.out, dtype=torch.float16)


if __name__ == "__main__":
    main()
