"""Steps while long prompts are fed: where the n-gram kind's index of a prompt is built (issue #26).

With a learner thread (`--overlap on`, as on GPU ranks) the n-gram kind indexes a request's prompt
chunk by chunk during the forwards that feed it (`NgramLookahead.ingest`); without one, whole at
the request's first decode step, where its look-ahead first follows it. This runs R requests with
synthetic prompts of L tokens on the replay target (actors/engine/replay.py: every stage real, the
forward a lookup taking `--forward` ms; each output copies a stretch of its prompt, so n-gram
drafts are accepted) and reports the distribution of the steps' wall time — a step that indexes a
whole prompt holds up every running request — and the look-ahead's time. Outputs are checked
against the table.

    .venv/bin/python benchmarks/long_prompts.py --prompt-tokens 8192 --requests 16 --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()


def workload(requests: int, length: int, out_tokens: int, vocab: int, seed: int = 5):
    """(prompts, prompt -> output): random prompts, each output a stretch of its own prompt."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts, table = [], {}
    for _ in range(requests):
        p = rng.integers(1, vocab, length).tolist()  # id 0 is the bundle's EOS
        at = int(rng.integers(0, length - out_tokens))
        prompts.append(p)
        table[tuple(p)] = p[at:at + out_tokens]
    return prompts, table


def one_run(prompts, table, out_tokens: int, forward_ms: float, overlap: bool, chunk: int, cache: str) -> dict:
    from actors.engine.replay import ReplayEngine
    from actors.engine.sequence import SamplingParams
    from deployments.settings import ServeSettings

    r, length = len(prompts), len(prompts[0])
    cfg = ServeSettings(policy="dcut", drafter="ngram", max_running=r, cost_model_cache=cache).engine_config()
    cfg = dataclasses.replace(cfg, kv_capacity_tokens=max(cfg.kv_capacity_tokens, 2 * length * r), prefill_chunk=chunk,
                              prefill_budget=2 * chunk, overlap=overlap)
    eng = ReplayEngine(cfg, table, lambda shape: forward_ms / 1e3)
    looks = []
    inner = eng.look

    def look(st):
        t0 = time.perf_counter()
        try:
            return inner(st)
        finally:
            looks.append(time.perf_counter() - t0)

    eng.look = look
    try:
        rids = [eng.add(p, SamplingParams(max_tokens=out_tokens)) for p in prompts]
        walls, t0 = [], time.perf_counter()
        while eng.pending:
            s = time.perf_counter()
            if eng.step() is not None:
                walls.append(time.perf_counter() - s)
        run_s = time.perf_counter() - t0
        outputs = [eng.claim(rid).output for rid in rids]
    finally:
        eng.shutdown()
    if any(o != table[tuple(p)] for o, p in zip(outputs, prompts, strict=True)):
        raise AssertionError("an output differs from the table's")
    walls.sort()
    return {"run_s": run_s, "steps": len(walls), "longest_ms": 1e3 * walls[-1],
            "p90_ms": 1e3 * walls[int(0.9 * (len(walls) - 1))], "median_ms": 1e3 * statistics.median(walls),
            "look_ms": 1e3 * sum(looks), "longest_look_ms": 1e3 * max(looks)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens of one prompt a step (two prompts' a step)")
    p.add_argument("--forward", default="10,3", help="each forward's ms (slept), comma-separated")
    p.add_argument("--overlap", default="on,off", help="on (learnt behind the next forward), off, or both")
    p.add_argument("--rounds", type=int, default=3, help="every cell this many times, the order alternating")
    p.add_argument("--out", default="runs/long_prompts")
    args = p.parse_args()

    from actors.ray_env import start_local_ray
    from actors.target.config import MoEConfig
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings

    start_local_ray(num_cpus=4)
    vocab = MoEConfig.load(str(BUNDLED / "target")).vocab_size
    prompts, table = workload(args.requests, args.prompt_tokens, args.max_tokens, vocab)
    cache = tempfile.mkdtemp(prefix="long-prompts-")  # the real target's profile, as the gate decides on a unit
    for f in pathlib.Path(ServeSettings().cost_model_cache).glob("cost_model_*.json"):
        shutil.copy(f, cache)
    cells = [(float(f), o == "on") for f in args.forward.split(",") for o in args.overlap.split(",")]
    rows = []
    try:
        for rnd in range(args.rounds):
            for forward_ms, overlap in cells if rnd % 2 == 0 else cells[::-1]:
                row = one_run(prompts, table, args.max_tokens, forward_ms, overlap, args.prefill_chunk, cache)
                rows.append({"forward_ms": forward_ms, "overlap": overlap, "round": rnd, **row})
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    table_md = render(rows, args)
    (out / "table.md").write_text(table_md + "\n")
    print(table_md)
    return 0


def render(rows: list[dict], args) -> str:
    fields = ("run_s", "longest_ms", "p90_ms", "median_ms", "look_ms", "longest_look_ms")
    lines = [f"{args.requests} requests × {args.prompt_tokens}-token prompts, chunks of {args.prefill_chunk}, "
             f"{args.max_tokens} tokens out; medians of {args.rounds} rounds [range]", "",
             "| forward ms | overlap | run s | longest step ms | p90 step ms | median step ms | look-ahead ms in all "
             "| longest look-ahead ms |", "|---|---|---|---|---|---|---|---|"]
    for forward_ms, overlap in dict.fromkeys((r["forward_ms"], r["overlap"]) for r in rows):
        mine = [r for r in rows if r["forward_ms"] == forward_ms and r["overlap"] == overlap]
        cells = []
        for f in fields:
            xs = [r[f] for r in mine]
            cells.append(f"{statistics.median(xs):.2f} [{min(xs):.2f}–{max(xs):.2f}]")
        lines.append(f"| {forward_ms:g} | {'on' if overlap else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
