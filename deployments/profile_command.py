"""`dcut profile`: measure the target's step cost on this deployment and write the fitted model."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

from tqdm import tqdm

from actors.ray_env import start_local_ray
from actors.target.config import MoEConfig
from actors.target.demo import write_random_demo
from actors.target.group import EPConfig, EPGroup
from actors.target.profile import QUICK_GRID, ProfileGrid, fit_profile, holdout_error, run_profile
from deployments.settings import ServeSettings

GRIDS = {"quick": QUICK_GRID, "full": ProfileGrid()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="cost_model.json")
    p.add_argument("--model", help="checkpoint folder (default: a random-weight model of the demo shape)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    p.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: cores / EP)")


def held_out(shape) -> bool:
    """Shapes the accuracy check keeps out of the fit: the middle context and 8 tokens/request."""
    per_request = shape.tokens // shape.requests
    context = shape.context // shape.requests
    return per_request == 8 or context == 128


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or str(write_random_demo(pathlib.Path(tempfile.gettempdir()) / "dcut-demo-random"))
    if not args.model:
        print(f"no --model given: profiling random weights of the demo shape ({model_dir})")
    cfg = MoEConfig.load(model_dir)
    settings = ServeSettings(ep=args.ep, threads_per_rank=args.threads).resolved()
    start_local_ray(num_cpus=max(args.ep, os.cpu_count() or 1))
    group = EPGroup(EPConfig(model_dir, world=args.ep, cpus_per_rank=settings.cpus_per_rank,
                             threads_per_rank=settings.threads_per_rank))
    grid = GRIDS[args.grid]
    total = len(grid.requests) * len(grid.contexts) * len(grid.tokens_per_request)
    try:
        with tqdm(total=total, desc="profiling", unit="shape") as bar:
            samples = run_profile(group, grid, cfg.vocab_size, progress=bar)
    finally:
        group.shutdown()
    shape = cfg.shape(pathlib.Path(model_dir).name)
    _, mdape, n_test = holdout_error(samples, shape, args.ep, held_out)
    model = fit_profile(samples, shape, args.ep)
    pathlib.Path(args.out).write_text(model.to_json())
    rows = [{"requests": s.shape.requests, "tokens": s.shape.tokens, "context": s.shape.context,
             "measured_ms": 1e3 * s.seconds, "predicted_ms": 1e3 * model.predict(s.shape), **s.breakdown()}
            for s in samples]
    pathlib.Path(args.out).with_suffix(".samples.json").write_text(json.dumps(rows, indent=1))
    print(f"fitted on {len(samples) - n_test} shapes; median abs. error on {n_test} held-out shapes: "
          f"{100 * mdape:.1f} %")
    print(f"coefficients: { {k: f'{v:.3g}' for k, v in model.coef.items() if v} }")
    print(f"wrote {args.out} and {pathlib.Path(args.out).with_suffix('.samples.json')}")
    return 0
