"""Where a closed loop's time goes: full decode steps, steps that feed prompts, and the drain tail.

Every request of the benchmarks asks for the same number of tokens and seldom meets EOS, so plain
decoding runs in lockstep — its requests start and finish together, one large prefill step a
wave — while speculation's requests finish when their accepted runs take them there: new prompts
join one or two at a time and the last wave drains at a falling batch (docs/benchmarks.md, session
38). Per system and round, the run's tok/s and, for each kind of step, (steps, seconds, tokens,
tok/s): full = decoding at least 90 % of C with no prompt fed, prefill = feeding a prompt chunk,
tail = decoding fewer than 90 % of C with none fed, each with how many of its steps drafted; the
payoff check's leads, leaders (the arm each band plays) and each arm's rate by band, and the
tokens each drafter kind drafted and had accepted.

Prompts: a training draw of the mixed workload (seed 29 by default; 11, the reported one, refused).

    .venv/bin/python benchmarks/closed_loop_phases.py --concurrency 16 --num-prompts 64 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from actors.ray_env import set_local_env

set_local_env()

# ServeSettings (or EngineConfig) fields over the default (the n-gram kind at block 8).
SYSTEMS = {"ar": {"policy": "ar"}, "default": {}, "unchecked": {"payoff_check": False},
           "auto": {"drafter": "auto"}, "auto-unchecked": {"drafter": "auto", "payoff_check": False},
           "auto-plain-arm": {"drafter": "auto", "payoff_kind_arms": False}}  # (an EngineConfig field)


def phases(records: list, concurrency: int) -> dict[str, list]:
    """(steps, seconds, tokens, tok/s, steps that drafted) of each kind of step; `records`
    (StepRecord, wall seconds)."""
    kinds = {"full": [], "prefill": [], "tail": []}
    for rec, wall in records:
        if rec is None:
            continue
        kind = "prefill" if rec.prefill_tokens else "full" if rec.requests >= 0.9 * concurrency else "tail"
        kinds[kind].append((rec.requests + rec.accepted, wall, rec.drafted > 0))
    out = {}
    for kind, steps in kinds.items():
        seconds, tokens = sum(w for _, w, _ in steps), sum(t for t, _, _ in steps)
        out[kind] = [len(steps), round(seconds, 3), tokens, round(tokens / seconds, 1) if seconds else 0.0,
                     sum(d for _, _, d in steps)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=29, help="the workload's draw (11 is the reported one: refused)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    args = p.parse_args()
    if args.seed == 11:
        p.error("seed 11 draws the reported prompts: diagnose on a training draw")
    names = [n for n in args.systems.split(",") if n]
    if not names or set(names) - set(SYSTEMS):
        p.error(f"--systems: some of {', '.join(SYSTEMS)}")

    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings
    from deployments.trace_command import workload

    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in workload("mixed", args.num_prompts, args.seed, 11)]
    start_local_ray(num_cpus=8)
    c = args.concurrency
    outputs: dict[str, list] = {}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            with tempfile.TemporaryDirectory() as cache:  # the cached start-up profile; nothing learnt is kept
                for f in pathlib.Path(ServeSettings().cost_model_cache).glob("cost_model_*.json"):
                    shutil.copy(f, cache)
                fields = {"drafter": "ngram", "block": 8, "max_running": c, "cost_model_cache": cache, **SYSTEMS[name]}
                serve = {k: v for k, v in fields.items() if k in ServeSettings.model_fields}
                eng = Engine(dataclasses.replace(ServeSettings(**serve).engine_config(),
                                                 **{k: v for k, v in fields.items() if k not in serve}))
                records, step = [], eng.step

                def timed(step=step, records=records):
                    t0 = time.perf_counter()
                    rec = step()
                    records.append((rec, time.perf_counter() - t0))
                    return rec

                eng.step = timed
                try:
                    res = closed_loop(eng, prompts, c, args.max_tokens)
                    leads = eng.payoff.leads() if eng.payoff is not None else {}
                    leaders = eng.payoff.leaders() if eng.payoff is not None else {}
                    rates = eng.payoff.rates() if eng.payoff is not None else {}
                    by_kind = {k: [v["drafted"], v["accepted"]] for k, v in eng.drafted_by_kind.items() if v["drafted"]}
                finally:
                    eng.shutdown()
            if res.outputs != outputs.setdefault("first", res.outputs):  # lossless: every system's the same
                raise AssertionError(f"{name} (round {rnd}): an output differs from the first system's")
            print(json.dumps({"system": name, "round": rnd, "tok_s": round(res.output_tokens / res.wall_s, 1),
                              **phases(records, c),
                              "leads": {r: None if v is None else round(v, 3) for r, v in leads.items()},
                              "leaders": leaders,
                              "rates": {r: {a: None if v is None else round(v, 3) for a, v in arms.items()}
                                        for r, arms in rates.items()},
                              "drafted_accepted": by_kind}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
