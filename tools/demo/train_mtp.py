"""Train the MTP drafter (DeepSeek-V3 next-n module) by self-distillation from the demo target.

    OMP_NUM_THREADS=2 .venv/bin/python -m tools.demo.train_mtp     # the shipped module, ≈ 10 min

1. The target continues corpus prompts (75 % greedy, 25 % sampled at temperature 0.8), and its
   last layer's states are captured; the module sees them through the target's final norm, as
   DeepSeek's main model hands them over (`distill.py`).
2. Step one, every position j at once (teacher forcing): x_j = combine(t_j, h_{j-1}), causal
   attention over the pairs up to j, predicts t_{j+1}.
3. Step two, unrolled as drafting chains it: combine(t_{j+1}, g_j) at position j + 1, attending to
   the step-one pairs before it and to itself, predicts t_{j+2} (weight 0.5). Without it the
   module never sees its own output as input, which is what every draft after the first runs on.
Loss only where the label is the target's own continuation.
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

from actors.drafter.mtp import MTPConfig, MTPModule
from actors.target.checkpoint import load_model
from tools.demo.distill import DistillSpec, cached
from tools.demo.train_target import lr_at


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, heads: int) -> torch.Tensor:
    """q [S, Q, H, D], k/v [S, T, Hkv, D], mask [Q, T] → [S, Q, H · D]."""
    rep = heads // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def batch_loss(module: MTPModule, tokens: torch.Tensor, hidden: torch.Tensor,
               prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and accuracy [2] (steps one and two) on sequences tokens [S, T], normed states [S, T, H]."""
    s, t = tokens.shape
    n = t - 3  # pairs j = 1 .. T-3 (step two predicts t_{j+2})
    pos = torch.arange(1, n + 1)
    x1 = module.combine(tokens[:, 1:n + 1].reshape(-1), hidden[:, :n].reshape(-1, hidden.shape[-1])).view(s, n, -1)
    q1, k1, v1 = (z.view(s, n, *z.shape[1:]) for z in module.qkv(x1.reshape(s * n, -1), pos.repeat(s)))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    g1 = module.finish(x1, attend(q1, k1, v1, causal, module.heads))  # [S, n, H]
    x2 = module.combine(tokens[:, 2:n + 2].reshape(-1), g1.reshape(s * n, -1)).view(s, n, -1)
    q2, k2, v2 = (z.view(s, n, *z.shape[1:]) for z in module.qkv(x2.reshape(s * n, -1), (pos + 1).repeat(s)))
    # step two at position j + 1 sees the step-one pairs 1 .. j and itself
    mask2 = torch.cat([torch.ones(n, n, dtype=torch.bool).tril(), torch.eye(n, dtype=torch.bool)], dim=1)
    g2 = module.finish(x2, attend(q2, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), mask2, module.heads))
    losses, accs = [], []
    for g, shift in ((g1, 2), (g2, 3)):
        labels = tokens[:, shift:n + shift]  # step one predicts t_{j+1}; pair j sits at index j - 1
        keep = (torch.arange(shift, n + shift) >= prompt_len)[None, :].expand(s, n)
        logits = module.logits(g[keep])
        losses.append(F.cross_entropy(logits, labels[keep]))
        accs.append((logits.argmax(-1) == labels[keep]).float().mean())
    return losses[0] + 0.5 * losses[1], torch.stack(accs)


def training_arguments(ap: argparse.ArgumentParser, out: str, sequences: int, log: str) -> None:
    """The options every chained-drafter trainer takes (this one, `train_eagle3`)."""
    ap.add_argument("--target", default="models/demo/target")
    ap.add_argument("--tokenizer", default="models/demo/tokenizer.json")
    ap.add_argument("--out", default=out)
    ap.add_argument("--sequences", type=int, default=sequences)
    ap.add_argument("--intermediate", type=int, default=512, help="the module's MLP width")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs-per-step", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=log)


def frozen_target(args: argparse.Namespace):
    """Threads and seed set, the target loaded with its weights frozen."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = load_model(args.target).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_arguments(ap, "models/demo/mtp", 3072, "runs/demo/mtp_log.jsonl")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--total-len", type=int, default=96)
    ap.add_argument("--sample-fraction", type=float, default=0.25)
    args = ap.parse_args()

    target = frozen_target(args)
    layer = target.cfg.num_hidden_layers
    path = pathlib.Path(f"runs/demo/distill_mtp_{args.sequences}_{args.total_len}.pt")
    spec = DistillSpec(args.sequences, args.prompt_len, args.total_len, (layer,), args.sample_fraction, seed=args.seed)
    data = cached(target, args.tokenizer, "train", path, spec)
    with torch.no_grad():
        hidden = target.norm(data.features.float())  # [S, T, H]: what DeepSeek's main model hands over
    c = target.cfg
    cfg = MTPConfig(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, args.intermediate,
                    layer_index=layer, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta)
    module = MTPModule(cfg, target.embed_tokens, target.lm_head)
    with torch.no_grad():  # start from the target's last layer: the closest thing it has to a next-n layer
        last = target.layers[-1]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(module.self_attn, name).weight.copy_(getattr(last.self_attn, name).weight)
        module.shared_head.norm.weight.copy_(target.norm.weight)
    fit(module, data.tokens, lambda seqs: hidden[seqs], data.prompt_len, args, lambda: module.save(args.out))


def fit(module: torch.nn.Module, tokens: torch.Tensor, hidden_of, prompt_len: int, args: argparse.Namespace,
        save) -> None:
    """Train a chained drafter module (`batch_loss`) on sequences `tokens` [S, T] whose states
    `hidden_of(indices)` gives [n, T, H]; the last 1/16 (at least 64) are held out, and `save`
    runs whenever their loss is the best so far. Logs to args.log."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    n_val = max(64, len(tokens) // 16)
    log = pathlib.Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"{type(module).__name__}: {sum(p.numel() for p in params) / 1e6:.2f} M trained parameters, "
          f"{len(tokens) - n_val} training sequences")
    t0, best = time.time(), float("inf")
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, 100)
        seqs = torch.from_numpy(rng.integers(0, len(tokens) - n_val, args.seqs_per_step))
        loss, _ = batch_loss(module, tokens[seqs], hidden_of(seqs), prompt_len)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 250 == 0 or step + 1 == args.steps:
            with torch.no_grad():
                seqs = torch.arange(len(tokens) - n_val, len(tokens))
                val, acc = batch_loss(module, tokens[seqs], hidden_of(seqs), prompt_len)
            record = {"step": step + 1, "minutes": round((time.time() - t0) / 60, 2), "val_loss": round(val.item(), 4),
                      "val_accuracy_step1": round(acc[0].item(), 3), "val_accuracy_step2": round(acc[1].item(), 3)}
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(json.dumps(record))
            if val.item() < best:  # it overfits its few thousand sequences late in training: keep the best
                best = val.item()
                save()


if __name__ == "__main__":
    main()
