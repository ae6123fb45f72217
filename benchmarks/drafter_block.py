"""Micro-benchmark: the bundled block drafter's pass time and acceptance by block length.

    .venv/bin/python benchmarks/drafter_block.py [--prompts 32] [--requests 16]

The drafter's pass costs in proportion to its block (every position runs both layers), so
`BlockDrafter.draft` cuts the block to the longest request's drafts + 1. This measures what
that saves and checks it costs no acceptance: greedy speculative decoding of held-out prompts
with n drafts a step, on the full 16-position block and on a block of n + 1.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--requests", type=int, default=16, help="batch of the timed passes")
    p.add_argument("--context", type=int, default=100, help="context tokens of each timed request")
    args = p.parse_args()

    from tokenizers import Tokenizer

    from actors.drafter.block import BlockDrafter
    from actors.drafter.model import DraftModel
    from actors.drafter.speculate import speculative_greedy
    from actors.drafter.target_parts import shared_embeddings
    from actors.target.checkpoint import load_model
    from actors.target.local import LocalTarget
    from deployments.bundle import BUNDLED, Bundle
    from deployments.workload import heldout_prompts

    torch.set_num_threads(1)
    b = Bundle(pathlib.Path(BUNDLED))
    tok = Tokenizer.from_file(b.tokenizer)
    prompts = [tok.encode(t).ids for t in heldout_prompts(args.prompts)]
    target = load_model(b.target)
    model = DraftModel.load(b.drafter_dir("block"), *shared_embeddings(b.target))
    full = model.cfg.block_size
    rng = np.random.default_rng(0)
    rids = list(range(args.requests))
    hidden = [{k: rng.standard_normal((args.context, model.cfg.hidden_size)).astype(np.float16)
               for k in model.cfg.target_layers} for _ in rids]
    print(f"| drafts a step | accepted a step, block {full} | accepted a step, block n + 1 | "
          f"pass ms, block {full} | pass ms, block n + 1 |")
    print("|---|---|---|---|---|")
    for n in (1, 3, 7):
        row = []
        for cut in (False, True):
            d = BlockDrafter(model, 65536, full, cut=cut)
            trace = speculative_greedy(LocalTarget(target), d, list(range(len(prompts))), prompts,
                                       args.new_tokens, n, model.cfg.target_layers)
            accepted = np.concatenate([np.asarray(a) for a in trace.accepted]).mean()
            d.commit(rids, [[0]] * len(rids), hidden)
            d.draft(rids, [5] * len(rids), [n] * len(rids))  # warm
            t0 = time.perf_counter()
            for _ in range(10):
                d.draft(rids, [5] * len(rids), [n] * len(rids))
            row.append((accepted, (time.perf_counter() - t0) / 10 * 1e3))
        print(f"| {n} | {row[0][0]:.3f} | {row[1][0]:.3f} | {row[0][1]:.1f} | {row[1][1]:.1f} |")
    mixed = [1 + 14 * (i % 4 == 0) for i in rids]  # a quarter of the requests ask for 15, the rest for 1
    times = []
    for cut in (False, True):
        d = BlockDrafter(model, 65536, full, cut=cut)
        d.commit(rids, [[0]] * len(rids), hidden)
        d.draft(rids, [5] * len(rids), mixed)
        t0 = time.perf_counter()
        for _ in range(10):
            d.draft(rids, [5] * len(rids), mixed)
        times.append((time.perf_counter() - t0) / 10 * 1e3)
    print(f"| 1 or 15 (a quarter 15) | | | {times[0]:.1f} | {times[1]:.1f} (each its own) |")


if __name__ == "__main__":
    main()
