"""Train an EAGLE-3 drafter for the demo target by self-distillation, written in the speculators
layout (so it loads as any published EAGLE-3 folder does).

    OMP_NUM_THREADS=2 .venv/bin/python -m tools.demo.train_eagle3 --out runs/demo/eagle3   # ≈ 15 min

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

from actors.drafter.eagle3 import Eagle3Config, Eagle3Module
from actors.target.rope import Rotary
from tools.demo.distill import DistillSpec, cached
from tools.demo.train_mtp import fit, frozen_target, training_arguments

LAYERS = (2, 4, 6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_arguments(ap, "runs/demo/eagle3", 2048, "runs/demo/eagle3_log.jsonl")
    ap.add_argument("--train-head", action="store_true",
                    help="train the LM head too (default: the target's, frozen, as our MTP module shares it)")
    args = ap.parse_args()

    target = frozen_target(args)
    # the DFly head experiment's set (benchmarks/dfly_head.py writes and reads the same file)
    data = cached(target, args.tokenizer, "train", pathlib.Path(f"runs/demo/distill_dfly_train_{args.sequences}_96.pt"),
                  DistillSpec(args.sequences, 32, 96, LAYERS, 0.25, seed=5))
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
