"""Experiment: a DFly-style predecessor-conditioned head on the bundled block drafter.

    .venv/bin/python benchmarks/dfly_head.py [--steps 800] [--out runs/dfly]

The block drafter drafts a block's positions in one parallel pass: position j never sees what
was drafted at j − 1. DFly (AngelSpec) adds a light autoregressive head inside the block: each
position's final hidden state is corrected from the previous draft token's embedding before
the LM head, one position after another (K − 1 small sequential steps after the one pass).

Here the shipped drafter is frozen and only the head trains (self-distillation, teacher forcing:
position j's predecessor is the target's token at j − 1, which is the draft whenever the draft
was right — and after a wrong draft nothing later is accepted anyway):

    h'_j = h_j + W2 · silu(W1 · [h_j ; norm(embed(t_{j−1}))]),   W2 zero-initialised

Measured on held-out greedy continuations of the target: mean accepted tokens per block (MAT,
bonus included) with greedy chained drafts at K = 4, 8, 16, and the drafting time of one pass
with and without the head at batch 1 and 16. Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


class PredecessorHead(nn.Module):
    def __init__(self, hidden: int, inner: int, embed: nn.Embedding) -> None:
        super().__init__()
        from actors.target.layers import RMSNorm

        self.norm = RMSNorm(hidden, 1e-6)
        self.up = nn.Linear(2 * hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        nn.init.zeros_(self.down.weight)  # starts as the plain drafter
        self._embed = (embed,)  # the target's, frozen; not the head's parameter

    def forward(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        e = self.norm(self._embed[0](prev))
        return h + self.down(F.silu(self.up(torch.cat([h, e], dim=-1))))


def blocks(model, data, seqs: torch.Tensor, anchors: int, block: int, rng: np.random.Generator):
    """Final hidden states [B, K, H] of blocks cut at random anchors, the token at each anchor,
    the labels [B, K − 1] (the target's continuation) and the block pass's inputs."""
    tokens, feats = data.tokens[seqs], data.features[seqs].float()
    s, t = tokens.shape
    with torch.no_grad():
        proj = model.project(feats).reshape(s * t, -1)
        cos, sin = model.rope(torch.arange(t).repeat(s))
        kv = [layer.context_kv(proj, cos, sin) for layer in model.layers]
        kv = [(k.view(s, t, *k.shape[1:]), v.view(s, t, *v.shape[1:])) for k, v in kv]
        p = torch.from_numpy(rng.integers(data.prompt_len - 1, t - block + 1, (s, anchors))).reshape(-1)
        owner = torch.arange(s)[:, None].expand(s, anchors).reshape(-1)
        mask = torch.arange(t)[None, :] < p[:, None]
        inputs = (tokens[owner, p], p, [(k[owner], v[owner]) for k, v in kv], mask, block)
        hidden = model.block_hidden(*inputs)
    labels = tokens[owner[:, None], p[:, None] + torch.arange(1, block)[None, :]]
    return hidden, tokens[owner, p], labels, inputs


def head_loss(model, head, hidden, first, labels) -> torch.Tensor:
    prev = torch.cat([first[:, None], labels[:, :-1]], dim=1)  # teacher forcing
    logits = model.logits(head(hidden[:, 1:], prev))
    column = torch.full((int(model.lm_head.weight.shape[0]),), -100, dtype=torch.long)
    column[model.head_ids] = torch.arange(len(model.head_ids))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), column[labels].reshape(-1), reduction="none",
                         ignore_index=-100)
    w = 0.8 ** torch.arange(labels.shape[1], dtype=torch.float32)
    return (ce.view(-1, labels.shape[1]) * w).sum(1).mean() / w.sum()


@torch.no_grad()
def drafts(model, head, hidden, first) -> torch.Tensor:
    """Greedy drafts [B, K − 1]: all at once (no head), or chained through the head."""
    if head is None:
        return model.head_ids[model.logits(hidden[:, 1:]).argmax(-1)]
    out, prev = [], first
    for j in range(1, hidden.shape[1]):
        prev = model.head_ids[model.logits(head(hidden[:, j], prev)).argmax(-1)]
        out.append(prev)
    return torch.stack(out, dim=1)


def mat(d: torch.Tensor, labels: torch.Tensor) -> float:
    ok = (d == labels).int()
    return 1.0 + float(torch.cumprod(ok, dim=1).sum(1).float().mean())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=2048)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--inner", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/dfly")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from actors.drafter.model import DraftModel
    from actors.target.checkpoint import load_model
    from deployments.bundle import BUNDLED, Bundle
    from tools.demo.distill import DistillSpec, cached

    bundle = Bundle(BUNDLED)
    target = load_model(bundle.target).eval()
    for q in target.parameters():
        q.requires_grad_(False)
    model = DraftModel.load(bundle.drafter_dir("block"), target.embed_tokens, target.lm_head).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    layers = tuple(model.cfg.target_layers)
    sets = {}
    for split, count, frac in (("train", args.sequences, 0.25), ("validation", 256, 0.0)):
        path = pathlib.Path(f"runs/demo/distill_dfly_{split}_{count}_96.pt")
        sets[split] = cached(target, bundle.tokenizer, split, path, DistillSpec(count, 32, 96, layers, frac, seed=5))
    head = PredecessorHead(model.cfg.hidden_size, args.inner, target.embed_tokens)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    t0, log = time.time(), []
    for step in range(args.steps):
        seqs = torch.from_numpy(rng.integers(0, args.sequences, 16))
        hidden, first, labels, _ = blocks(model, sets["train"], seqs, 8, int(rng.choice((4, 8, 16))), rng)
        loss = head_loss(model, head, hidden, first, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0:
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "minutes": round((time.time() - t0) / 60, 2)})
            print(json.dumps(log[-1]), flush=True)
    head.eval()
    results = {"train_minutes": (time.time() - t0) / 60, "log": log, "mat": {}, "pass_ms": {}}
    val = sets["validation"]
    for k in (4, 8, 16):
        hidden, first, labels, _ = blocks(model, val, torch.arange(len(val.tokens)), 4, k, np.random.default_rng(1))
        results["mat"][k] = {"block": mat(drafts(model, None, hidden, first), labels),
                             "dfly_head": mat(drafts(model, head, hidden, first), labels)}
        print(k, results["mat"][k], flush=True)
    for b in (1, 16):  # one drafting pass at K = 8: the block forward, then the drafts; medians of 50
        hidden, first, _, inputs = blocks(model, val, torch.arange(b), 1, 8, np.random.default_rng(2))
        for name, h in (("block", None), ("dfly_head", head)):
            fwd, tail = [], []
            for _ in range(50):
                t1 = time.perf_counter()
                with torch.no_grad():
                    model.block_hidden(*inputs)
                t2 = time.perf_counter()
                drafts(model, h, hidden, first)
                fwd.append(t2 - t1)
                tail.append(time.perf_counter() - t2)
            results["pass_ms"].setdefault(b, {})[name] = {"block_forward": 1e3 * float(np.median(fwd)),
                                                          "drafts": 1e3 * float(np.median(tail))}
        print(b, results["pass_ms"][b], flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
