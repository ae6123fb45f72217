"""The target's forward with `F.linear` products and with the CPU's (`actors/target/layout.py`),
alternating forward by forward; and the cold products behind it.

    .venv/bin/python benchmarks/cpu_layout.py [--forwards 150] [--threads 2]

Prints JSON lines: per token count, the median forward time of each (one request after a
100-token context, random tokens: repeated tokens route to the same experts and mislead), then
per weight shape and row count the median product time over 64 MB of such weights (out of the
caches, as a model's are): `F.linear`, `F.linear` by the weight stored transposed, `cpu_linear`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from unittest.mock import patch

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from actors.target.layout import cpu_linear


def forwards(args) -> None:
    from actors.target.checkpoint import load_model
    from actors.target.layout import CpuLinear
    from actors.target.local import LocalTarget
    from deployments.bundle import BUNDLED, Bundle

    bundle = Bundle(BUNDLED)
    laid = LocalTarget(load_model(bundle.target).eval())  # LocalTarget swaps the products on the CPU
    checkpoint = LocalTarget(load_model(bundle.target).eval())
    for m in checkpoint.model.modules():  # back to F.linear (the experts' loop: patched per forward)
        if type(m) is CpuLinear:
            m.__class__ = torch.nn.Linear
    rng = np.random.default_rng(3)
    context = rng.integers(5, 4000, 100).tolist()
    for t in (checkpoint, laid):
        t.forward([0], [context])

    def one(target, tokens) -> float:
        with patch("actors.target.moe.cpu_linear", F.linear if target is checkpoint else cpu_linear):
            t0 = time.perf_counter()
            target.forward([0], [tokens])
            dt = time.perf_counter() - t0
        target.cache.truncate_all({0: len(context)})
        return dt

    for n in (1, 2, 4, 8, 16, 64):
        a, b = [], []
        for k in range(args.forwards):
            tokens = rng.integers(5, 4000, n).tolist()
            order = ((checkpoint, a), (laid, b)) if k % 2 else ((laid, b), (checkpoint, a))
            for target, times in order:
                times.append(one(target, tokens))
        ma, mb = statistics.median(a), statistics.median(b)
        print(json.dumps({"tokens": n, "f_linear_ms": round(1e3 * ma, 3), "cpu_linear_ms": round(1e3 * mb, 3),
                          "ratio": round(mb / ma, 3)}), flush=True)


def products(args) -> None:
    def median_us(weights, x, product) -> float:
        times = []
        for _ in range(10):
            for w in weights:
                t0 = time.perf_counter()
                product(x, w)
                times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    for k, n in ((256, 768), (384, 256), (256, 256), (256, 4096)):
        count = max(8, int(64e6 / (k * n * 4)))
        plain = [torch.randn(n, k) for _ in range(count)]
        transposed = [w.t().contiguous().t() for w in plain]
        for m in (1, 2, 4, 16, 32, 64):
            x = torch.randn(m, k)
            print(json.dumps({"in": k, "out": n, "rows": m, "f_linear_us": round(median_us(plain, x, F.linear), 1),
                              "stored_transposed_us": round(median_us(transposed, x, F.linear), 1),
                              "cpu_linear_us": round(median_us(plain, x, cpu_linear), 1)}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forwards", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        forwards(args)
        products(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
