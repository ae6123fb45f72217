"""The engine against what a user would run instead, in one run (issue #15, item 8).

Same bundled checkpoint, same held-out prompts, greedy, same new-token count:
- `bare`: a single-process loop of our own model (`LocalTarget` + argmax, static batches of C);
- `hf`: Hugging Face transformers `generate` on the same folder (batch 1, or left-padded batch C);
- `hf-lookup`: its prompt-lookup speculative decoding (`prompt_lookup_num_tokens=10`, batch 1);
- `engine-ar`: our engine at EP 1 (closed loop, C in flight), plain decoding;
- `engine-dcut-<kind>-cold` / `-warm`, for each drafter kind of `--kinds` (`auto`: every kind,
  chosen per request; `tuned`: the kinds the bundle's prior names, chosen per request): a freshly
  built engine, as a fresh `dcut serve` process builds it (nothing learned saved, so it starts
  from the bundle's prior; start-up profiles of the target copied in so a round does not spend
  minutes on them), its first run of the prompts (`cold`) and its second (`warm`; each run
  starts with the n-gram kind's corpus of earlier outputs emptied, as `actors/engine/loadgen.py`
  does: warm is what the estimators learnt, not drafts copied from the same prompts' earlier
  outputs); the serving default's kind is marked in the table;
- `engine-ar`, `engine-dcut` at EP 2 — driven from rank 0 (the default), and with every rank a
  Ray actor called per step (EP `2-actors`).
Rounds alternate the order of the systems; each level's ratios are taken within a round, and the
table reports medians over rounds. Also the engine's time per step by stage, and whether every
system's tokens equal the bare loop's.

    .venv/bin/python benchmarks/peer.py --rounds 3 --out runs/peer
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()


def bare_loop(model, prompts: list[list[int]], c: int, max_tokens: int, eos: int) -> list[list[int]]:
    """Static batches of c: each runs to its end before the next starts (no engine, no scheduler)."""
    from actors.target.decode import greedy_decode
    from actors.target.local import LocalTarget

    outs = []
    target = LocalTarget(model, kv_capacity_tokens=c * (max(map(len, prompts)) + max_tokens + 16))
    for start in range(0, len(prompts), c):
        batch = prompts[start:start + c]
        rids = list(range(start, start + len(batch)))
        outs += greedy_decode(target, rids, batch, max_tokens, eos)
        for rid in rids:
            target.cache.release(rid)
    return outs


class HF:
    def __init__(self, target_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], c: int, max_tokens: int, eos: int, lookup: bool = False):
        outs = []
        for start in range(0, len(prompts), c):
            batch = prompts[start:start + c]
            width = max(map(len, batch))
            ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
            with torch.no_grad():
                gen = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                          eos_token_id=eos, pad_token_id=eos, **extra)
            for row in gen[:, width:].tolist():
                outs.append(row[: row.index(eos) + 1] if eos in row else row)
        return outs


def engine_run(engine, policy: str, prompts: list[list[int]], c: int, max_tokens: int):
    from actors.engine.loadgen import closed_loop

    engine.set_policy(policy)
    return closed_loop(engine, prompts, c, max_tokens)


def fresh_engine(kind: str, max_running: int, threads: int):
    """An EP-1 engine drafting with `kind`, built as a fresh `dcut serve` builds it: nothing
    learned saved (it reads the bundle's prior), the target's start-up profile copied in."""
    from actors.engine.coordinator import Engine
    from deployments.settings import ServeSettings

    cache = tempfile.mkdtemp(prefix="peer-")
    for f in pathlib.Path(ServeSettings().cost_model_cache).glob("cost_model_*.json"):
        shutil.copy(f, cache)
    engine = Engine(ServeSettings(drafter=kind, max_running=max_running, threads_per_rank=threads,
                                  cost_model_cache=cache).engine_config())
    return engine, cache


def stages(records) -> dict[str, float]:
    """Mean milliseconds per decode step, by stage."""
    recs = [r for r in records if r.requests]
    if not recs:
        return {}
    mean = lambda xs: 1e3 * statistics.fmean(xs)  # noqa: E731
    return {"step_ms": mean([r.step_s for r in recs]), "target_ms": mean([r.target_compute_s for r in recs]),
            "draft_ms": mean([r.draft_compute_s for r in recs]), "decision_ms": mean([r.decision_s for r in recs]),
            "outside_ms": mean([r.overhead_s for r in recs]),
            "outside_frac": sum(r.overhead_s for r in recs) / sum(r.step_s for r in recs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--kinds", default="ngram,block,mtp,auto,tuned",
                   help="drafter kinds run cold and warm on fresh EP-1 engines ('' to skip)")
    p.add_argument("--ep2-concurrency", default="1,16", help="levels also run at EP 2 ('' to skip)")
    p.add_argument("--ep2-actors", action=argparse.BooleanOptionalAction, default=True,
                   help="also run EP 2 with ranks and drafter as Ray actors (in_process=False)")
    p.add_argument("--num-prompts", type=int, default=12,
                   help="held-out prompts a level runs at least; a level of C runs max(this, 4·C) (a closed loop "
                        "over C prompts is one wave: its prefill and its tail, not C requests in flight)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default="runs/peer")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.ray_env import start_local_ray
    from deployments.settings import ServeSettings
    from deployments.workload import heldout_prompts

    levels = [int(c) for c in args.concurrency.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    ep2_levels = [int(c) for c in args.ep2_concurrency.split(",") if c]
    cfg1 = ServeSettings(max_running=max(levels), threads_per_rank=args.threads).engine_config()
    eos = cfg1.eos_token_id
    tok = Tokenizer.from_file(cfg1.tokenizer_path)
    texts = heldout_prompts(max(args.num_prompts, *(4 * c for c in levels)))
    all_prompts = [tok.encode(t).ids for t in texts]
    start_local_ray(num_cpus=max(4, (os.cpu_count() or 1) + 3))
    engines = {1: Engine(cfg1)}
    if ep2_levels:
        engines[2] = Engine(ServeSettings(ep=2, max_running=max(ep2_levels)).engine_config())
        if args.ep2_actors:
            engines["2-actors"] = Engine(ServeSettings(ep=2, max_running=max(ep2_levels),
                                                       in_process=False).engine_config())
    from actors.target.checkpoint import load_model

    model = load_model(cfg1.target_dir).eval()
    hf = HF(cfg1.target_dir)
    for eng in engines.values():  # warm-up: lazy set-up and first calls
        engine_run(eng, "dcut", all_prompts[:2], 2, 8)
    bare_loop(model, all_prompts[:2], 2, 8, eos)
    hf.generate(all_prompts[:1], 1, 8, eos)

    runs = []
    for rnd in range(args.rounds):
        for c in levels:
            prompts = all_prompts[: max(args.num_prompts, 4 * c)]
            systems = [("bare", 1), ("hf", 1), ("engine-ar", 1)] + [(f"engine-dcut-{k}", 1) for k in kinds]
            systems += [("hf-lookup", 1)] if c == 1 else []
            eps = [e for e in engines if e != 1] if c in ep2_levels else []
            systems += [(f"engine-{p}", e) for e in eps for p in ("ar", "dcut")]
            k = rnd % len(systems)
            for name, ep in systems[k:] + systems[:k]:  # alternate who goes first
                torch.set_num_threads(engines[ep].cfg.threads_per_rank if name.startswith("engine") else args.threads)
                if name.startswith("engine-dcut-"):  # a fresh engine: its first run and its second
                    kind = name.removeprefix("engine-dcut-")
                    engine, cache = fresh_engine(kind, max(levels), engines[1].cfg.threads_per_rank)
                    try:
                        for phase in ("cold", "warm"):
                            t0 = time.perf_counter()
                            res = engine_run(engine, "dcut", prompts, c, args.max_tokens)
                            row = {"round": rnd, "system": f"{name}-{phase}", "ep": 1, "concurrency": c,
                                   **outcome(res.outputs, time.perf_counter() - t0), **stages(res.records),
                                   "mat": res.mat()}
                            runs.append(row)
                            report(row)
                    finally:
                        engine.shutdown()
                        shutil.rmtree(cache, ignore_errors=True)
                    continue
                t0 = time.perf_counter()
                extra = {}
                if name == "bare":
                    outs = bare_loop(model, prompts, c, args.max_tokens, eos)
                elif name.startswith("hf"):
                    outs = hf.generate(prompts, c, args.max_tokens, eos, lookup=name == "hf-lookup")
                else:
                    res = engine_run(engines[ep], name.removeprefix("engine-"), prompts, c, args.max_tokens)
                    outs, extra = res.outputs, stages(res.records)
                row = {"round": rnd, "system": name, "ep": ep, "concurrency": c,
                       **outcome(outs, time.perf_counter() - t0), **extra}
                runs.append(row)
                report(row)
    for eng in engines.values():
        eng.shutdown()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_runs.json").write_text(json.dumps(runs))
    print(render(runs))
    return 0


def outcome(outs: list[list[int]], wall: float) -> dict:
    return {"wall_s": wall, "tokens": sum(map(len, outs)), "tok_s": sum(map(len, outs)) / wall, "outputs": outs}


def report(row: dict) -> None:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "outputs"}),
          flush=True)


def render(runs: list[dict]) -> str:
    """Markdown: tok/s (median of rounds) and the medians of within-round ratios to the bare
    loop, to the engine's plain decoding and (at C = 1) to transformers' prompt lookup."""
    from deployments.settings import ServeSettings

    default = f"engine-dcut-{ServeSettings().drafter}"
    key = lambda r: (r["system"], r["ep"], r["concurrency"])  # noqa: E731
    by = {(r["round"], r["system"], r["ep"], r["concurrency"]): r for r in runs}
    rows: dict = {}
    for r in runs:
        bare = by[(r["round"], "bare", 1, r["concurrency"])]
        ar = by.get((r["round"], "engine-ar", r["ep"] if r["system"].startswith("engine") else 1, r["concurrency"]))
        lookup = by.get((r["round"], "hf-lookup", 1, r["concurrency"]))
        rows.setdefault(key(r), []).append((r["tok_s"], r["tok_s"] / bare["tok_s"],
                                            r["tok_s"] / ar["tok_s"] if ar else None,
                                            r["tok_s"] / lookup["tok_s"] if lookup else None,
                                            r["outputs"] == bare["outputs"], r))
    lines = ["| system | EP | C | tok/s (median) | × bare loop (range) | × engine `ar` (range) | × HF prompt lookup "
             "(range) | MAT | same tokens as bare | step ms | outside the passes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(xs: list) -> str:
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})" if xs else ""

    for (name, ep, c), xs in sorted(rows.items(), key=lambda kv: (kv[0][2], str(kv[0][1]), kv[0][0])):
        last = xs[-1][5]
        step = f"{last['step_ms']:.1f}" if "step_ms" in last else ""
        outside = f"{100 * last['outside_frac']:.0f} %" if "outside_frac" in last else ""
        mat = f"{statistics.median(x[5]['mat'] for x in xs):.2f}" if "mat" in last else ""
        label = f"{name} (default)" if name.startswith(default + "-") else name
        lines.append(f"| {label} | {ep if name.startswith('engine') else ''} | {c} | "
                     f"{statistics.median(x[0] for x in xs):.0f} | {ratio([x[1] for x in xs])} | "
                     f"{ratio([x[2] for x in xs])} | {ratio([x[3] for x in xs])} | {mat} | "
                     f"{all(x[4] for x in xs)} | {step} | {outside} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
