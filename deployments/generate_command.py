"""`dcut generate`: run every prompt concurrently in one embedded engine and print the results."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from deployments.bundle import BUNDLED
from deployments.settings import ServeSettings


def run(args: argparse.Namespace) -> int:
    import ray
    from tokenizers import Tokenizer

    from actors.engine.actor import BatchCoordinator
    from actors.engine.sequence import SamplingParams
    from actors.ray_env import start_local_ray

    prompts = list(args.prompts)
    if args.prompts_file:
        lines = pathlib.Path(args.prompts_file).read_text().splitlines()
        prompts += [line.replace("\\n", "\n") for line in lines if line.strip()]  # "\n" escapes a newline
    if not prompts:
        print("dcut generate: no prompts (give PROMPT arguments or --prompts-file)", file=sys.stderr)
        return 2
    settings = ServeSettings.from_env(model_root=args.model_root or str(BUNDLED), drafter=args.drafter,
                                      policy=args.policy, block=args.block, ep=args.ep, drafters=args.drafters,
                                      max_running=max(64, len(prompts)))
    cfg = settings.engine_config()  # checks the bundle
    tok = Tokenizer.from_file(cfg.tokenizer_path)
    ids = [tok.encode(p).ids for p in prompts]
    if any(not i for i in ids):
        print("dcut generate: a prompt encodes to no tokens", file=sys.stderr)
        return 2
    start_local_ray(num_cpus=settings.local_cpus())
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
