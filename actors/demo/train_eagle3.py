"""Train an EAGLE-3 drafter for the demo target by self-distillation, written in the speculators
layout (so it loads as any published EAGLE-3 folder does).

    OMP_NUM_THREADS=2 .venv/bin/python -m actors.demo.train_eagle3 --out runs/demo/eagle3   # ≈ 15 min

Data: the target's own continuations of corpus prompts with its states after layers 2, 4 and 6
(the block drafter's layers; `distill.py`, cached as the DFly head experiment caches them). The
loss is the MTP module's (`train_mtp.batch_loss`: step one teacher-forced, step two chained on
the layer's own output); the feature fc([h2 ; h4 ; h6]) is trained with it, so it is computed per
batch. Starts as the identity on h6 (fc picking it, the residual branches' output projections at
zero), with the target's final norm and LM head (full vocabulary).
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from actors.demo.data import token_array
from actors.demo.distill import DistillSet, generate
from actors.demo.train_mtp import fit
from actors.drafter.eagle3 import Eagle3Config, Eagle3Module
from actors.target.checkpoint import load_model
from actors.target.rope import Rotary

LAYERS = (2, 4, 6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/demo/target")
    ap.add_argument("--tokenizer", default="models/demo/tokenizer.json")
    ap.add_argument("--out", default="runs/demo/eagle3")
    ap.add_argument("--sequences", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512, help="the layer's MLP width")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs-per-step", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-head", action="store_true",
                    help="train the LM head too (default: the target's, frozen, as our MTP module shares it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="runs/demo/eagle3_log.jsonl")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = load_model(args.target).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    cache = pathlib.Path(f"runs/demo/distill_dfly_train_{args.sequences}_96.pt")
    if cache.exists():
        data = DistillSet(**torch.load(cache))
    else:
        cache.parent.mkdir(parents=True, exist_ok=True)
        data = generate(target, token_array(args.tokenizer, "train"), args.sequences, 32, 96, LAYERS,
                        sample_fraction=0.25, seed=5)
        torch.save(data.__dict__, cache)
    c = target.cfg
    cfg = Eagle3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       intermediate_size=args.intermediate, vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size,
                       target_layers=LAYERS, prefix="layers.0.", rotary=Rotary(c.head_dim, c.rope_theta),
                       rms_norm_eps=c.rms_norm_eps)
    module = Eagle3Module(cfg, target.embed_tokens)
    h = c.hidden_size
    with torch.no_grad():
        module.fc.weight.zero_()
        module.fc.weight[:, 2 * h:].copy_(torch.eye(h))  # start as the last layer's state alone,
        module.self_attn.o_proj.weight.zero_()  # passed through unchanged (residual branches at zero)
        module.mlp.down_proj.weight.zero_()
        module.norm.weight.copy_(target.norm.weight)
        module.lm_head.weight.copy_(target.lm_head.weight)
    module.lm_head.weight.requires_grad_(args.train_head)  # 1 M parameters on 1920 sequences overfit

    def hidden_of(seqs: torch.Tensor) -> torch.Tensor:
        f = data.features[seqs].float()
        return module.features({layer: f[..., i * h:(i + 1) * h] for i, layer in enumerate(LAYERS)})

    fit(module, data.tokens, hidden_of, data.prompt_len, args, lambda: module.save(args.out))


if __name__ == "__main__":
    main()
