"""`dcut generate`: run every prompt concurrently in one embedded engine and print the results."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from deployments.bundle import BUNDLED, Bundle


def run(args: argparse.Namespace) -> int:
    import ray
    from tokenizers import Tokenizer

    from actors.engine.actor import BatchCoordinator
    from actors.engine.config import EngineConfig
    from actors.engine.sequence import SamplingParams
    from actors.ray_env import start_local_ray
    from actors.target.config import MoEConfig

    prompts = list(args.prompts)
    if args.prompts_file:
        lines = pathlib.Path(args.prompts_file).read_text().splitlines()
        prompts += [line.replace("\\n", "\n") for line in lines if line.strip()]  # "\n" escapes a newline
    if not prompts:
        print("dcut generate: no prompts (give PROMPT arguments or --prompts-file)", file=sys.stderr)
        return 2
    bundle = Bundle(pathlib.Path(args.model_root or BUNDLED))
    bundle.check(need_drafter=args.drafter == "block" and args.policy != "ar")
    tok = Tokenizer.from_file(bundle.tokenizer)
    ids = [tok.encode(p).ids for p in prompts]
    if any(not i for i in ids):
        print("dcut generate: a prompt encodes to no tokens", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    cfg = EngineConfig(bundle.target, bundle.tokenizer, args.drafter, bundle.drafter, args.block, args.policy,
                       ep=args.ep, drafters=args.drafters, max_running=max(64, len(ids)),
                       threads_per_rank=max(1, cores // args.ep), cpus_per_rank=min(1.0, cores / args.ep),
                       eos_token_id=MoEConfig.load(bundle.target).eos_token_id,
                       cost_model_cache=str(pathlib.Path("runs") / "cache"))
    start_local_ray(num_cpus=max(4, args.ep + args.drafters))
    coordinator = BatchCoordinator.remote(cfg)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        results = ray.get(coordinator.generate.remote(ids, [params] * len(ids)))
    finally:
        ray.get(coordinator.shutdown.remote())
    for prompt, r in zip(prompts, results, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, **r}))
        else:
            print(prompt + r["text"])
            print("-" * 40)
    return 0
