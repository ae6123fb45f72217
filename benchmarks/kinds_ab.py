"""One round of each drafter kind and `auto` against plain decoding, for comparing two checkouts
(issue #24): run it alternately from each checkout's root, so the machine's drift (10–25 %
between minutes here) falls on both, and compare the ratios each round measured within itself.

Held-out mixed workload (the seed-11 prompts the benchmarks report, less the 8 that warm up
`drafter_mix.py`), 48 new tokens, greedy, EP 1, engines built as `dcut serve` builds them; per
concurrency, `ar`, `ngram`, `mtp`, `block`, `auto` (block + MTP + n-gram, chosen per request) and
`tuned` (the kinds the bundle's prior names, chosen per request: MTP + n-gram for the demo) each
serve every prompt once, in an order rotated by `--round`. One JSON line per concurrency: tok/s,
and `auto` and `tuned` over the best single kind.

    for r in 0 1 2; do
      (cd ../old && .venv/bin/python benchmarks/kinds_ab.py --round $r --tag old)
      .venv/bin/python benchmarks/kinds_ab.py --round $r --tag new
    done    # about 5 minutes a call

(`auto` against `tuned` needs one checkout: rounds 0 .. 5 put each setting in each place once.)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path.cwd()))  # the checkout it is run from, not this file's

from actors.ray_env import set_local_env

set_local_env()

SETTINGS = ("ar", "ngram", "mtp", "block", "auto", "tuned")
SINGLE = ("ngram", "mtp", "block")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--round", type=int, default=0, help="rotates the settings' order")
    p.add_argument("--tag", default="", help="names the checkout in the output")
    args = p.parse_args()

    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop
    from actors.ray_env import start_local_ray
    from deployments.bundle import BUNDLED
    from deployments.settings import ServeSettings
    from deployments.workload import mixed_prompts

    levels = [int(c) for c in args.concurrency.split(",")]
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    ids = [tok.encode(t).ids for _, t in mixed_prompts(32, seed=11)[8:]]
    start_local_ray(num_cpus=8)
    cache = tempfile.mkdtemp(prefix="kinds-ab-")

    def engine_of(name: str) -> Engine:
        drafter = "auto" if name == "ar" else name
        s = ServeSettings(model_root=str(BUNDLED), drafter=drafter, block=8, max_running=max(levels),
                          policy="ar" if name == "ar" else "dcut", cost_model_cache=cache)
        return Engine(s.engine_config())

    engines = {name: engine_of(name) for name in SETTINGS}
    try:
        for e in engines.values():  # lazy set-up and first calls
            closed_loop(e, ids[:2], 2, 8)
        order = SETTINGS[args.round % len(SETTINGS):] + SETTINGS[:args.round % len(SETTINGS)]
        for c in levels:
            tok_s, outputs = {}, {}
            for name in order:
                res = closed_loop(engines[name], ids, c, 48)
                tok_s[name], outputs[name] = res.output_tokens / res.wall_s, res.outputs
            best = max(tok_s[k] for k in SINGLE)
            print(json.dumps({"tag": args.tag, "round": args.round, "concurrency": c,
                              **{k: round(v, 1) for k, v in tok_s.items()},
                              **{f"{k} / best": round(tok_s[k] / best, 3) for k in ("auto", "tuned")},
                              "lossless": all(outputs[k] == outputs["ar"] for k in SETTINGS)}), flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
