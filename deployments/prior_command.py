"""`dcut prior`: a bundle's prior from counterfactual traces of the model's training prompts.

    dcut prior --traces runs/train23.trace,runs/train29.trace,runs/train31.trace --out models/demo/prior.json

It holds what a unit hosting every traced kind learns serving the first trace (each kind's
calibration and acceptance rates, `dcut_core.trace_sim.prior_from_trace`), and the kinds
`--drafter tuned` hosts: of every set of two or more traced kinds, the one whose per-request
choice replays fastest over all the traces (`choose_hosted`). With `--keep-rates` a prior already
at `--out` keeps its rates (they warm the replays too) and only its `tuned` kinds are chosen again.
`dcut trace --prior` does the same from the one trace it records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from dcut_core.learned import LearnedState
from dcut_core.trace_sim import choose_hosted, prior_from_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", required=True, help="counterfactual traces of training prompts (`dcut trace`), "
                                                   "comma-separated; never the prompts you report")
    p.add_argument("--out", required=True, help="the prior to write, e.g. models/demo/prior.json")
    p.add_argument("--keep-rates", action="store_true", help="keep the rates of the prior at --out")
    p.add_argument("--levels", default="1,4,16,64", help="concurrencies the kinds are scored at")
    p.add_argument("--orders", type=int, default=2, help="request orders per trace")


def with_hosted(prior: LearnedState, traces: list, levels: tuple[int, ...] = (1, 4, 16, 64),
                orders: int = 2) -> LearnedState:
    """`prior` naming the kinds `--drafter tuned` hosts, chosen over `traces` warm from it; prints each set's score."""
    choice = choose_hosted(traces, prior, levels, orders)
    for kinds, score in sorted(choice.scores.items(), key=lambda kv: -kv[1]):
        mark = "  <- tuned" if kinds == choice.kinds else ""
        print(f"{'+'.join(kinds):<24} {score:.3f} x ar (geometric mean over {len(traces)} trace(s), "
              f"{orders} order(s), C = {', '.join(map(str, levels))}){mark}")
    return dataclasses.replace(prior, tuned=choice.kinds)


def run(args: argparse.Namespace) -> int:
    from deployments.trace_command import read_trace

    traces = [read_trace(t) for t in args.traces.split(",")]
    out = pathlib.Path(args.out)
    if args.keep_rates:
        if not out.is_file():
            print(f"dcut prior: --keep-rates needs a prior at {out}", file=sys.stderr)
            return 2
        prior = LearnedState.from_dict(json.loads(out.read_text()))
    else:
        prior = prior_from_trace(traces[0])
    levels = tuple(int(c) for c in args.levels.split(","))
    prior = with_hosted(prior, traces, levels, args.orders)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prior.as_dict(), indent=1) + "\n")
    print(f"wrote {out}: --drafter tuned hosts {', '.join(prior.tuned)}")
    return 0
