"""`dcut trace`: record a counterfactual trace of a workload on this unit, and replay the engine's
decisions over one (`dcut simulate --trace FILE`).

    dcut trace --prompts-file prompts.txt --max-tokens 48 --out runs/train.trace
    dcut trace --workload mixed --num-prompts 32 --seed 23 --out runs/train.trace
    dcut simulate --trace runs/train.trace --batch 1,4,16 --out runs/sim

A trace holds, for every prompt, its greedy output and what every drafter kind the unit hosts
would draft at every position and have accepted, with the unit's measured costs
(`dcut_core.counterfactual`); the same prompts and settings give the same bytes, except the
costs, which are measured. The simulator runs the real gate, kind chooser and pruning policy over
it at each concurrency, beside the hindsight oracle (`dcut_core.trace_sim`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import msgpack

from dcut_core.counterfactual import Trace
from dcut_core.trace_sim import SimSettings, oracle_run, simulate_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts-file", help="one prompt a line (\\n escapes a newline)")
    p.add_argument("--workload", choices=("mixed", "heldout"), default="mixed",
                   help="without --prompts-file: the demo workload's prompts (deployments/workload.py)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--seed", type=int, default=23, help="which prompts of the workload (23: training; the "
                                                        "benchmarks report seed 11's)")
    p.add_argument("--exclude-seed", type=int, default=11, help="leave out the prompts this seed's workload "
                                                                "holds (the reported ones); -1: none")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--drafter", default="auto", help="the kinds to trace (auto: every kind the bundle holds)")
    p.add_argument("--model", dest="model_root", help="a bundle or Hugging Face folder (default: the bundled demo)")
    p.add_argument("--cost-model-cache", default="runs/cache")
    p.add_argument("--out", default="runs/trace.msgpack")
    p.add_argument("--prior", help="also write a bundle prior (what an engine hosting every traced kind learns "
                                   "serving these prompts: calibration and acceptance rates per kind; the kinds "
                                   "--drafter tuned hosts, `dcut prior`), e.g. models/demo/prior.json")


def workload(kind: str, n: int, seed: int, exclude_seed: int) -> list[str]:
    from deployments.workload import heldout_prompts, mixed_prompts

    pick = (lambda m, s: [t for _, t in mixed_prompts(m, seed=s)]) if kind == "mixed" else heldout_prompts
    held = set(pick(n + 64, exclude_seed)) if exclude_seed >= 0 else set()
    out = [t for t in pick(n + len(held) + 8, seed) if t not in held]
    if len(out) < n:
        raise ValueError(f"only {len(out)} {kind} prompts outside the reported ones")
    return out[:n]


def run(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from actors.engine.trace_record import record_trace
    from actors.ray_env import start_local_ray
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings

    if args.prompts_file:
        lines = pathlib.Path(args.prompts_file).read_text().splitlines()
        texts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    else:
        texts = workload(args.workload, args.num_prompts, args.seed, args.exclude_seed)
    settings = ServeSettings.from_env(model_root=args.model_root or str(BUNDLED), drafter=args.drafter,
                                      block=args.block, max_running=max(16, len(texts)),
                                      cost_model_cache=args.cost_model_cache)
    cfg = settings.engine_config()
    tok = Tokenizer.from_file(cfg.tokenizer_path)
    ids = [tok.encode(t).ids for t in texts]
    if not ids or any(not i for i in ids):
        print("dcut trace: no prompts, or a prompt that encodes to no tokens", file=sys.stderr)
        return 2
    start_local_ray(num_cpus=settings.local_cpus())
    t0 = time.time()
    meta = {"model": str(settings.model_root), "prompts": args.prompts_file or f"{args.workload}:{args.seed}"}
    trace = record_trace(cfg, ids, args.max_tokens, meta=meta)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, out)
    print(f"wrote {out}: {len(ids)} requests, kinds {', '.join(trace.kinds)}, {trace.output_tokens} output tokens "
          f"in {time.time() - t0:.0f} s")
    if args.prior:
        from dcut_core.trace_sim import prior_from_trace
        from deployments.prior_command import with_hosted

        prior = with_hosted(prior_from_trace(trace), [trace])
        pathlib.Path(args.prior).write_text(json.dumps(prior.as_dict(), indent=1) + "\n")
        print(f"wrote the prior {args.prior}")
    return 0


def write_trace(trace: Trace, path: pathlib.Path) -> None:
    path.write_bytes(msgpack.packb(trace.as_dict(), use_bin_type=True))


def read_trace(path: str | pathlib.Path) -> Trace:
    return Trace.from_dict(msgpack.unpackb(pathlib.Path(path).read_bytes(), raw=False))


def is_trace(path: str) -> bool:
    """Whether `path` is a counterfactual trace (one msgpack map), not an engine step log."""
    p = pathlib.Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            obj = next(iter(msgpack.Unpacker(f, raw=False, max_buffer_size=1 << 30)))
    except (StopIteration, ValueError, msgpack.UnpackException):
        return False
    return isinstance(obj, dict) and "requests" in obj and "costs" in obj


def settings_of(trace: Trace) -> dict[str, SimSettings]:
    """What `dcut simulate --trace` compares: plain decoding, each kind alone, and every kind
    chosen per request (`auto`), all with the default policy; then `auto` with the gate told
    each kind's accepted length (`hindsight`: what better prediction could buy)."""
    out = {"ar": SimSettings(policy="ar", kinds=trace.kinds[:1])}
    out |= {k: SimSettings(kinds=(k,)) for k in trace.kinds}
    if len(trace.kinds) > 1:
        out["auto"] = SimSettings(kinds=trace.kinds)
    out["auto, hindsight predictions" if len(trace.kinds) > 1 else f"{trace.kinds[0]}, hindsight predictions"] = \
        SimSettings(kinds=trace.kinds, hindsight=True)
    return out


def simulate(path: str, batches: list[int], out_dir: str) -> int:
    """Every setting of `settings_of` and the oracle at each concurrency; a markdown table."""
    trace = read_trace(path)
    rows = []
    for c in batches:
        for name, s in settings_of(trace).items():
            rows.append({"setting": name, **simulate_trace(trace, s, c).record()})
        rows.append({"setting": "oracle", **oracle_run(trace, trace.kinds, c).record()})
    md = ["| setting | " + " | ".join(f"C={c} tok/s (MAT, drafting share)" for c in batches) + " |",
          "|---" * (len(batches) + 1) + "|"]
    for name in dict.fromkeys(r["setting"] for r in rows):
        cells = [r for r in rows if r["setting"] == name]
        md.append(f"| {name} | " + " | ".join(f"{r['tok_s']:.0f} ({r['mat']:.2f}, {r['drafting_share']:.2f})"
                                             for r in cells) + " |")
    print("\n".join(md))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "tables.md").write_text("\n".join(md) + "\n")
    return 0
