"""Each drafter kind on the same held-out prompts: mean accepted tokens per step (MAT, bonus
included), the drafter's time per pass, and tokens per second of greedy speculative decoding with
every draft verified (no pruning), against plain greedy decoding of the same target.

    .venv/bin/python benchmarks/drafter_kinds.py [--prompts 16] [--new-tokens 64] [--blocks 4,8]

Every kind's tokens must equal plain greedy decoding's (checked). Bundled kinds: the block
drafter (models/demo/drafter), the MTP module (models/demo/mtp) and n-gram lookup.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


class Timed:
    """A drafter whose passes are timed."""

    def __init__(self, drafter) -> None:
        self.drafter, self.seconds, self.passes = drafter, 0.0, 0

    def draft(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.drafter.draft(*a, **kw)
        self.seconds += time.perf_counter() - t0
        self.passes += 1
        return out

    def __getattr__(self, name):
        return getattr(self.drafter, name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--blocks", default="4,8")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from actors.drafter.speculate import speculative_greedy
    from actors.engine.replica import DrafterSpec, build_drafter
    from actors.target.checkpoint import load_model
    from actors.target.decode import greedy_decode
    from actors.target.local import LocalTarget
    from deployments.bundle import BUNDLED, Bundle
    from tools.demo.data import token_array, windows

    bundle = Bundle(BUNDLED)
    target = load_model(bundle.target).eval()
    prompts = windows(token_array(bundle.tokenizer, "validation"), np.random.default_rng(7), args.prompts,
                      31).tolist()
    ids = list(range(len(prompts)))
    t0 = time.perf_counter()
    plain = greedy_decode(LocalTarget(target), ids, prompts, args.new_tokens)
    plain_s = time.perf_counter() - t0
    print(json.dumps({"kind": "plain", "tok_s": round(sum(map(len, plain)) / plain_s, 1)}))
    for block in (int(b) for b in args.blocks.split(",")):
        for kind in ("block", "mtp", "ngram"):
            drafter = Timed(build_drafter(DrafterSpec(kind, bundle.target, bundle.drafter_dir(kind), block,
                                                      args.threads)))
            layers = tuple(getattr(drafter.drafter, "target_layers", ()))
            t0 = time.perf_counter()
            trace = speculative_greedy(LocalTarget(target), drafter, ids, prompts, args.new_tokens, block - 1, layers)
            wall = time.perf_counter() - t0
            assert trace.tokens == plain, f"{kind}: speculative output differs from plain greedy decoding"
            print(json.dumps({"kind": kind, "block": block, "mat": round(trace.mat(), 3),
                              "draft_ms_per_pass": round(1e3 * drafter.seconds / max(1, drafter.passes), 3),
                              "tok_s": round(sum(map(len, trace.tokens)) / wall, 1),
                              "x_plain": round(plain_s / wall, 3)}), flush=True)
    print(json.dumps(pass_cost(bundle, target)))
    return 0


def pass_cost(bundle, target, context: int = 200, repeats: int = 200) -> dict:
    """At batch 1 after `context` tokens: the MTP module's first draft (its head over the pair
    kept at commit), one more chained pass, and the target's verify step of one token."""
    import statistics

    from actors.engine.replica import DrafterSpec, build_drafter
    from actors.target.local import LocalTarget

    mtp = build_drafter(DrafterSpec("mtp", bundle.target, bundle.drafter_dir("mtp"), 16))
    local = LocalTarget(target)
    prompt = list(range(10, 10 + context))
    layer = mtp.target_layers[0]
    out = local.forward([0], [prompt], capture_layers=(layer,))
    mtp.commit([0], [prompt], [{layer: out.features[0][layer][:-1]}])

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    first = median_ms(lambda: mtp.draft([0], [prompt[-1]], [1]))
    four = median_ms(lambda: mtp.draft([0], [prompt[-1]], [4]))

    def verify() -> None:
        local.forward([0], [[5]])
        local.cache.truncate_all({0: context})

    step = median_ms(verify)
    return {"mtp_first_draft_ms": round(first, 3), "mtp_chained_pass_ms": round((four - first) / 3, 3),
            "verify_step_ms": round(step, 3), "chained_pass_per_verify_step": round((four - first) / 3 / step, 3)}


if __name__ == "__main__":
    sys.exit(main())
