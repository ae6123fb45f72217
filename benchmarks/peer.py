"""The engine against what a user would run instead, in one run (issue #15, item 8).

Same bundled checkpoint, same held-out prompts, greedy, same new-token count:
- `bare`: a single-process loop of our own model (`LocalTarget` + argmax, static batches of C);
- `hf`: Hugging Face transformers `generate` on the same folder (batch 1, or left-padded batch C);
- `hf-lookup`: its prompt-lookup speculative decoding (`prompt_lookup_num_tokens=10`, batch 1);
- `engine-ar`, `engine-dcut`: our engine at EP 1 (closed loop, C in flight), and at EP 2 — driven
  from rank 0 (the default), and with every rank a Ray actor called per step (EP `2-actors`).
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
import statistics
import sys
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
    p.add_argument("--ep2-concurrency", default="1,16", help="levels also run at EP 2 ('' to skip)")
    p.add_argument("--ep2-actors", action=argparse.BooleanOptionalAction, default=True,
                   help="also run EP 2 with ranks and drafter as Ray actors (in_process=False)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default="runs/peer")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from tokenizers import Tokenizer

    from actors.demo.prompts import heldout_prompts
    from actors.engine.coordinator import Engine
    from actors.ray_env import start_local_ray
    from deployments.settings import ServeSettings

    levels = [int(c) for c in args.concurrency.split(",")]
    ep2_levels = [int(c) for c in args.ep2_concurrency.split(",") if c]
    cfg1 = ServeSettings(max_running=max(levels), threads_per_rank=args.threads).engine_config()
    eos = cfg1.eos_token_id
    tok = Tokenizer.from_file(cfg1.tokenizer_path)
    texts = heldout_prompts(max(args.num_prompts, *levels))
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
            prompts = all_prompts[: max(args.num_prompts, c)]
            systems = [("bare", 1), ("hf", 1), ("engine-ar", 1), ("engine-dcut", 1)]
            systems += [("hf-lookup", 1)] if c == 1 else []
            eps = [e for e in engines if e != 1] if c in ep2_levels else []
            systems += [(f"engine-{p}", e) for e in eps for p in ("ar", "dcut")]
            k = rnd % len(systems)
            for name, ep in systems[k:] + systems[:k]:  # alternate who goes first
                torch.set_num_threads(engines[ep].cfg.threads_per_rank if name.startswith("engine") else args.threads)
                t0 = time.perf_counter()
                extra = {}
                if name == "bare":
                    outs = bare_loop(model, prompts, c, args.max_tokens, eos)
                elif name.startswith("hf"):
                    outs = hf.generate(prompts, c, args.max_tokens, eos, lookup=name == "hf-lookup")
                else:
                    res = engine_run(engines[ep], name.removeprefix("engine-"), prompts, c, args.max_tokens)
                    outs, extra = res.outputs, stages(res.records)
                wall = time.perf_counter() - t0
                row = {"round": rnd, "system": name, "ep": ep, "concurrency": c, "wall_s": wall,
                       "tokens": sum(map(len, outs)), "tok_s": sum(map(len, outs)) / wall, "outputs": outs, **extra}
                runs.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                  if k != "outputs"}), flush=True)
    for eng in engines.values():
        eng.shutdown()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_runs.json").write_text(json.dumps(runs))
    print(render(runs))
    return 0


def render(runs: list[dict]) -> str:
    """Markdown: tok/s (median of rounds) and the medians of within-round ratios to the bare loop."""
    key = lambda r: (r["system"], r["ep"], r["concurrency"])  # noqa: E731
    bare = {(r["round"], r["concurrency"]): r for r in runs if r["system"] == "bare"}
    rows: dict = {}
    for r in runs:
        b = bare[(r["round"], r["concurrency"])]
        rows.setdefault(key(r), []).append((r["tok_s"], r["tok_s"] / b["tok_s"], r["outputs"] == b["outputs"], r))
    lines = ["| system | EP | C | tok/s (median) | × bare loop (median of rounds) | range | same tokens as bare | "
             "step ms | outside the passes |", "|---|---|---|---|---|---|---|---|---|"]
    for (name, ep, c), xs in sorted(rows.items(), key=lambda kv: (kv[0][2], str(kv[0][1]), kv[0][0])):
        ratios = [x[1] for x in xs]
        last = xs[-1][3]
        step = f"{last['step_ms']:.1f}" if "step_ms" in last else ""
        outside = f"{100 * last['outside_frac']:.0f} %" if "outside_frac" in last else ""
        lines.append(f"| {name} | {ep if name.startswith('engine') else ''} | {c} | "
                     f"{statistics.median(x[0] for x in xs):.0f} | {statistics.median(ratios):.2f} | "
                     f"{min(ratios):.2f}–{max(ratios):.2f} | {all(x[2] for x in xs)} | {step} | {outside} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
