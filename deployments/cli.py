"""The `dcut` command line (contract in DESIGN.md; change it only by adding).

Every subcommand of the contract is declared here with its options, so `dcut CMD --help` is
always complete; a subcommand's module is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from actors.ray_env import set_local_env
from dcut_core.pruning import POLICY_NAMES


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="settings file (JSON object of ServeSettings fields)")
    p.add_argument("--model", help="a Hugging Face folder or a model bundle to serve (settings' model_root)")
    p.add_argument("--drafter", help="block, mtp, eagle3, ngram, several (block,ngram), auto or tuned")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", metavar="PROMPT")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--policy", default="dcut", help=f"one of {', '.join(POLICY_NAMES)} (fixed-K as fixed-4)")
    p.add_argument("--block", type=int, default=16, help="drafter block size: drafts per request per step")
    p.add_argument("--drafter", default="block",
                   help="block (trained block drafter), mtp (DeepSeek next-n module in ROOT/mtp), eagle3 (an "
                        "EAGLE-3 drafter in ROOT/eagle3, speculators or SpecForge layout), ngram, several "
                        "(block,mtp: the replicas host each and every request drafts with the kind chosen for it "
                        "each step), auto (every kind the bundle holds) or tuned (the kinds the bundle's prior "
                        "names for per-request choice: dcut prior)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks of the target")
    p.add_argument("--drafters", type=int, default=1, help="drafter replicas")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    p.add_argument("--model", dest="model_root", help="a Hugging Face folder (config.json, safetensors, "
                   "tokenizer.json) or a model bundle (target/, drafter/, mtp/, tokenizer.json); default: the "
                   "bundled demo model")
    p.add_argument("--model-root", help="model bundle folder with target/, drafter/, tokenizer.json "
                                        "(default: the bundled demo model)")


SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "serve": ("serve the bundled model over an OpenAI-compatible API", _add_serve),
    "generate": ("generate completions with one embedded engine", _add_generate),
    "bench": ("throughput and latency sweeps; writes results.json, CSV and plots",
              lambda p: _lazy("deployments.bench_command").add_arguments(p)),
    "profile": ("profile the deployment's step cost and write the fitted cost model",
                lambda p: _lazy("deployments.profile_command").add_arguments(p)),
    "simulate": ("cluster-scale what-if runs from the cost model, or the engine's decisions over a trace",
                 lambda p: _lazy("deployments.simulate_command").add_arguments(p)),
    "trace": ("record a counterfactual trace: every drafter kind's drafts at every position of a workload",
              lambda p: _lazy("deployments.trace_command").add_arguments(p)),
    "prior": ("make a bundle prior from traces: acceptance rates, and the kinds --drafter tuned hosts",
              lambda p: _lazy("deployments.prior_command").add_arguments(p)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcut", description="Speculative decoding with D-Cut on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add) in SUBCOMMANDS.items():
        add(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _lazy(module: str):
    """Import a command's module only when it is used: Ray and torch load slowly."""
    return importlib.import_module(module)


IMPLEMENTED = {"profile": "deployments.profile_command", "generate": "deployments.generate_command",
               "serve": "deployments.serve_command", "bench": "deployments.bench_command",
               "simulate": "deployments.simulate_command", "trace": "deployments.trace_command",
               "prior": "deployments.prior_command"}


def main(argv: Sequence[str] | None = None) -> int:
    set_local_env()  # before anything imports Ray
    args = build_parser().parse_args(argv)
    return _lazy(IMPLEMENTED[args.command]).run(args)


if __name__ == "__main__":
    sys.exit(main())
