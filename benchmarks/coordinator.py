"""The coordinator's own time per step, by stage, at 1 to 1,024 running requests (issue #26).

On a GPU a MoE decode step takes 10–40 ms, and whatever the engine's own Python adds to it is
paid every step. Here the target's forward is a lookup of known greedy outputs (`ReplayEngine`,
actors/engine/replay.py: a zero-cost target, everything else real — the scheduler, the drafting
gate, the real n-gram drafter, pruning, acceptance, commit, the learned estimators), so the
engine's own time shows at batch sizes this machine cannot run a model at.

`--target real` runs the same waves on the real bundled model instead (the GPU script's check:
the engine's own time next to a real GPU forward, in the format `dcut simulate
--coordinator-times` reads).

Prompts: the mixed workload's training draw (`dcut trace`'s seed 23, never the reported seed-11
prompts), cycled to fill the batch; their greedy outputs come from the real bundled model first,
and every replayed output is checked against them. Per (policy, R): one wave of R requests
admitted together; the steps counted are those decoding at least 90 % of R with no prefill.

    .venv/bin/python benchmarks/coordinator.py --out runs/coordinator
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()

STAGES = ("schedule", "look", "plan", "propose", "prune", "verify", "accept", "commit")
OVERLAP_NAMES = {None: "", True: " (overlap)", False: " (sequential)"}  # as served; forced on; forced off
HEAP_NAMES = {True: "", False: " (heap not frozen)"}  # as served (actors/heap.py); off
POLICIES = "ar:8,full:5,full:16,tetris:8,dcut-buckets:8,dcut:8"  # policy:block (block − 1 drafts at most)


class StageClock:
    """Wraps an engine's stage methods to time each call (a perf_counter pair: about 1 µs)."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        for name in STAGES:
            stage = getattr(engine, name)

            def timed(*args, _stage=stage, _name=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _stage(*args, **kwargs)
                finally:
                    self.seconds[_name].append(time.perf_counter() - t0)

            setattr(engine, name, timed)

    def take(self) -> dict[str, float]:
        """This step's seconds per stage (stages it did not reach: 0), and clear."""
        out = {k: sum(v) for k, v in self.seconds.items()}
        self.seconds.clear()
        return out


class CallCounter:
    """Python and C function calls made on the stepping thread while it is installed
    (`sys.setprofile`): a count that does not move with the machine's speed, where the own time's
    medians move 10–25 % between processes here. It slows the step several times over, so it is
    taken in a wave of its own (`--calls`)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    def step(self, engine):
        """One `engine.step()`, counted; returns (its record, calls)."""
        before = self.calls
        sys.setprofile(self)
        try:
            rec = engine.step()
        finally:
            sys.setprofile(None)
        return rec, self.calls - before


def greedy_outputs(prompts: list[list[int]], max_tokens: int):
    """The bundled target's greedy outputs (plain decoding, the real model), and its profiled
    cost model (the deployment's cached start-up profile, or one made now)."""
    from actors.engine.coordinator import Engine
    from actors.engine.costs import startup_cost_model
    from actors.engine.loadgen import closed_loop
    from deployments.settings import ServeSettings

    cfg = ServeSettings(policy="ar", max_running=len(prompts)).engine_config()
    eng = Engine(cfg)
    try:
        res = closed_loop(eng, prompts, len(prompts), max_tokens)
        model = startup_cost_model(eng.target, cfg)
    finally:
        eng.shutdown()
    return {tuple(p): o for p, o in zip(prompts, res.outputs, strict=True)}, model


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every wave replays: prompts and their greedy outputs, the forward's time, the cache
    holding the real target's profile."""

    prompts: list[list[int]]
    table: dict[tuple[int, ...], list[int]]
    max_tokens: int
    forward: object  # StepShape -> seconds, or None
    cache: str
    real: bool = False  # the real target (as `dcut serve` builds it: on the GPU with DCUT_GPUS_PER_RANK=1)
    overlap: bool | None = None  # learning a step behind the next step's forward (`EngineConfig.overlap`)
    freeze_heap: bool = True  # the start-up heap frozen out of the collector's full scans (actors/heap.py)


def one_wave(policy: str, block: int, r: int, w: Workload, drafter: str = "ngram", count_calls: bool = False) -> dict:
    """R requests admitted together under `policy`, drafting with `drafter` (the n-gram kind, or
    `auto`: every kind the bundle holds, its neural drafters' own compute left out of the own
    time as the forward's is); per-stage medians of the full decode steps. `count_calls`: each
    step's function calls counted too (`CallCounter`; its times are then not the step's own)."""
    from actors.engine.coordinator import Engine
    from actors.engine.replay import ReplayEngine
    from actors.engine.sequence import SamplingParams
    from deployments.settings import ServeSettings

    # The real target's profile (copied into `cache`, where nothing learned is saved): the gate and
    # pruning decide as on the real unit, from a cold start every time.
    cfg = ServeSettings(policy=policy, drafter=drafter, block=block, max_running=r,
                        cost_model_cache=w.cache).engine_config()
    # Every prompt prefilled in the first step, which takes no time here: the steps measured are
    # decode steps (a decode step verifies at most 17 tokens a request; a prefill step ~100).
    cfg = dataclasses.replace(cfg, kv_capacity_tokens=max(cfg.kv_capacity_tokens, 400 * r), prefill_chunk=1 << 20,
                              prefill_budget=1 << 24, overlap=w.overlap, freeze_heap=w.freeze_heap)
    timed = None if w.forward is None else (lambda shape: 0.0 if shape.tokens > 17 * shape.requests else
                                            w.forward(shape))
    eng = Engine(cfg) if w.real else ReplayEngine(cfg, w.table, timed)
    clock = StageClock(eng)
    batch = [w.prompts[i % len(w.prompts)] for i in range(r)]
    rids = [eng.add(p, SamplingParams(max_tokens=w.max_tokens)) for p in batch]
    steps, counter, calls = [], CallCounter() if count_calls else None, 0
    try:
        while eng.pending:
            gc_before = sum(eng.gc_pauses.seconds)  # the engine counts its process's collections
            t0 = time.perf_counter()
            rec, calls = counter.step(eng) if counter is not None else (eng.step(), 0)
            wall = time.perf_counter() - t0
            gc = sum(eng.gc_pauses.seconds) - gc_before
            stages = clock.take()
            if rec is not None and rec.requests >= 0.9 * r and not rec.prefill_tokens:
                own = wall - rec.target_compute_s - rec.draft_compute_s
                steps.append({"wall": wall, "own": own, "gc": gc, "calls": calls,
                              "forward": rec.target_compute_s,
                              "draft": rec.draft_compute_s, "drafted": rec.drafted / rec.requests,
                              "kept": rec.kept / rec.requests, "accepted": rec.accepted / rec.requests, **stages})
        outputs = [eng.claim(rid).output for rid in rids]
    finally:
        eng.shutdown()
    if any(o != w.table[tuple(p)] for o, p in zip(outputs, batch, strict=True)):
        raise AssertionError(f"{policy} ({drafter}) at R = {r}: an output differs from the target's greedy one")
    if not steps:
        raise AssertionError(f"{policy} at R = {r}: no step decoded 90 % of the requests without prefill")
    med = {k: 1e3 * statistics.median(s[k] for s in steps) for k in ("wall", "own", "forward", "draft", *STAGES)}
    med["verify"] -= med["forward"]  # the stage's own part: building the batch, the group's bookkeeping
    name = (policy if drafter == "ngram" else f"{policy} {drafter}") + OVERLAP_NAMES[w.overlap] + \
        HEAP_NAMES[w.freeze_heap]
    return {"policy": name, "block": block, "requests": r, "steps": len(steps),
            **{f"{k}_ms": v for k, v in med.items()},
            # The mean and the longest, which a median hides: a full collection stops one step.
            "own_mean_ms": 1e3 * statistics.fmean(s["own"] for s in steps),
            "own_max_ms": 1e3 * max(s["own"] for s in steps),
            "wall_mean_ms": 1e3 * statistics.fmean(s["wall"] for s in steps),  # a pause inside a pass is not own
            "gc_ms": 1e3 * statistics.fmean(s["gc"] for s in steps),
            "calls_per_step": statistics.median(s["calls"] for s in steps) if count_calls else None,
            "drafted_per_request": statistics.fmean(s["drafted"] for s in steps),
            "accepted_per_request": statistics.fmean(s["accepted"] for s in steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,16,64,256,1024")
    p.add_argument("--policies", default=POLICIES, help="policy:block, comma-separated")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--forward", default="model",
                   help="each forward's time: 'model' (what the real target's profile predicts for its shape, "
                        "slept), 'none', or milliseconds")
    p.add_argument("--target", choices=["replay", "real"], default="replay",
                   help="replay: the zero-cost target (--forward says how long a forward takes); real: the "
                        "bundled model's ranks as `dcut serve` builds them (tests/gpu/run.sh: on the GPU), "
                        "their measured forward left out of the own time")
    p.add_argument("--drafters", default="ngram",
                   help="drafter settings, comma-separated: ngram (the n-gram kind alone), auto (every kind; "
                        "--target real only)")
    p.add_argument("--overlap", default="served",
                   help="served (as `dcut serve` builds the engine: on with GPU ranks), on (a step learnt behind "
                        "the next forward), off, or a comma list (each in turn per cell, alternating by round)")
    p.add_argument("--heap", default="frozen",
                   help="frozen (as served: the start-up heap out of the collector's full scans, actors/heap.py), "
                        "unfrozen, or both ('frozen,unfrozen': each in turn per cell, alternating by round)")
    p.add_argument("--rounds", type=int, default=1, help="every cell this many times, in order (medians of rows)")
    p.add_argument("--calls", action="store_true",
                   help="also each cell's function calls per step (median), counted in a wave of its own: a "
                        "measure of the own time that does not move with the machine's speed")
    p.add_argument("--out", default="runs/coordinator")
    args = p.parse_args()
    if args.target == "replay" and set(args.drafters.split(",")) - {"ngram"}:
        p.error("the replay target makes no drafter features: the neural kinds (auto) need --target real")

    from tokenizers import Tokenizer

    from actors.ray_env import start_local_ray
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings
    from deployments.trace_command import workload

    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in workload("mixed", args.num_prompts, 23, 11)]
    start_local_ray(num_cpus=4)
    table, model = greedy_outputs(prompts, args.max_tokens)
    forward = model.predict if args.forward == "model" else None if args.forward == "none" else \
        (lambda shape: float(args.forward) / 1e3)
    rows, drafters = [], args.drafters.split(",")
    cache = tempfile.mkdtemp(prefix="coordinator-")
    for f in pathlib.Path(ServeSettings().cost_model_cache).glob("cost_model_*.json"):
        shutil.copy(f, cache)
    overlaps = [{"on": True, "off": False, "served": None}[x] for x in args.overlap.split(",")]
    heaps = [{"frozen": True, "unfrozen": False}[x] for x in args.heap.split(",")]
    for rnd in range(args.rounds):
        for r in (int(x) for x in args.requests.split(",")):
            for spec in args.policies.split(","):
                policy, block = spec.split(":")
                for drafter in drafters[:1] if policy == "ar" else drafters:  # `ar` drafts nothing
                    for overlap, frozen in itertools.product(*(x[::-1] if rnd % 2 else x for x in (overlaps, heaps))):
                        w = Workload(prompts, table, args.max_tokens, forward, cache, args.target == "real", overlap,
                                     frozen)
                        row = one_wave(policy, int(block), r, w, drafter)
                        if args.calls:
                            row["calls_per_step"] = one_wave(policy, int(block), r, w, drafter, True)["calls_per_step"]
                        row["forward"] = "real" if args.target == "real" else args.forward
                        row["round"] = rnd
                        rows.append(row)
                        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                              flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(render(rows) + "\n")
    plot(rows, out / "own_time.png")
    print(render(rows))
    return 0


def render(rows: list[dict]) -> str:
    calls = any(r.get("calls_per_step") is not None for r in rows)
    lines = ["| policy (drafts ≤) | R | steps | own ms / step | mean | longest | GC ms / step | µs / request | "
             + " | ".join(STAGES) + " | drafted / req | accepted / req |" + (" calls / step |" if calls else ""),
             "|---" * (10 + len(STAGES) + calls) + "|"]
    for r in rows:
        lines.append(f"| {r['policy']} ({r['block'] - 1}) | {r['requests']} | {r['steps']} | {r['own_ms']:.2f} | "
                     f"{r['own_mean_ms']:.2f} | {r['own_max_ms']:.1f} | {r['gc_ms']:.2f} | "
                     f"{1e3 * r['own_ms'] / r['requests']:.0f} | "
                     + " | ".join(f"{r[s + '_ms']:.2f}" for s in STAGES)
                     + f" | {r['drafted_per_request']:.1f} | {r['accepted_per_request']:.2f} |"
                     + (f" {r.get('calls_per_step') or 0:.0f} |" if calls else ""))
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(f"{r['policy']} ({r['block'] - 1})" for r in rows):
        mine = [r for r in rows if f"{r['policy']} ({r['block'] - 1})" == name]
        ax.plot([r["requests"] for r in mine], [r["own_ms"] for r in mine], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("running requests")
    ax.set_ylabel("coordinator's own ms per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
