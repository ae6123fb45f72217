"""`dcut bench`: closed-loop concurrency sweeps, every policy on the same prompts and drafter.

Embedded (default): one engine in this process; policies are switched between runs, so the
drafter, the target and the prompts are identical and only the pruning choice differs. Greedy
outputs of every policy are checked against `ar` (lossless) and the check is recorded.
With `--url`: any OpenAI-compatible server, streaming, measured from the client side.
Writes DIR/results.json, DIR/results.csv and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import pathlib
import sys
import time

import numpy as np

from deployments.bundle import BUNDLED

ALL_POLICIES = "ar,full,fixed-4,tetris,dcut-buckets,dcut,oracle"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--policies", default=ALL_POLICIES)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32,
                   help="prompts per concurrency level (at least 3·C, so the closed loop reaches steady state)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--url", help="OpenAI-compatible endpoint to measure instead of the embedded engine")
    p.add_argument("--model", default="dcut-demo", help="model name to ask for with --url")
    p.add_argument("--drafter", default="block", help="block, mtp, ngram, several (block,mtp), auto (every kind the "
                   "bundle holds, chosen per request each step) or tuned (the kinds the bundle's prior names)")
    p.add_argument("--workload", choices=["heldout", "mixed"], default="heldout",
                   help="heldout: code and docstrings; mixed: code, docstring, comment and documentation prose, "
                        "run mixed and each domain alone (rows by `workload`, embedded engine only)")
    p.add_argument("--model-root", help="model bundle folder (default: the bundled demo model)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--request-rate", help="open loop instead: arrival rates in requests/s, comma-separated "
                                          "(embedded engine only)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every level this many times, policies in turn (embedded engine); each row reports the "
                        "median, and speed-ups are medians of ratios between runs of the same round")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from deployments.workload import heldout_prompts, mixed_prompts

    if args.request_rate and args.url:
        raise SystemExit("--request-rate drives the embedded engine; use --concurrency with --url")
    levels = [float(r) for r in args.request_rate.split(",")] if args.request_rate else \
        [int(c) for c in args.concurrency.split(",")]
    policies = args.policies.split(",")
    n_max = args.num_prompts if args.request_rate else max(3 * max(levels), args.num_prompts)
    if args.workload == "mixed" and (args.url or args.request_rate):
        raise SystemExit("--workload mixed runs closed loops on the embedded engine")
    domains = None
    if args.workload == "mixed":
        domains, texts = map(list, zip(*mixed_prompts(n_max), strict=True))
    else:
        texts = heldout_prompts(n_max)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    workloads = 1 + (len(set(domains)) if domains else 0)
    total = len(levels) * (1 if args.url else len(policies) * args.repeats * workloads)
    with tqdm(total=total, desc="bench", unit="run") as bar:
        rows = (_http(args, texts, levels, bar) if args.url else
                _embedded(args, texts, levels, policies, bar, domains))
    if args.repeats > 1:
        (out / "results_runs.json").write_text(json.dumps(rows, indent=1))
        rows = median_rows(rows)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out)
    for r in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    lossless = all(r.get("lossless", True) for r in rows)
    if not lossless:
        print("LOSSLESS CHECK FAILED: some policy's greedy output differs from ar", file=sys.stderr)
    return 0 if lossless else 1


def _workloads(prompts: list[list[int]], domains: list[str] | None, n: int) -> dict[str, list[int]]:
    """Prompt indices of each workload of a level: all n prompts (the mixed workload when there
    are domains), then each domain's own."""
    out = {"mixed" if domains else "heldout": list(range(n))}
    for d in dict.fromkeys(domains or ()):
        out[d] = [i for i in range(len(prompts)) if domains[i] == d][:max(1, n // 2)]
    return out


def kinds_chosen(result, kinds: tuple[str, ...], which: list[int] | None = None) -> dict[str, float]:
    """Share of the drafting request-steps each drafter kind drafted (of these prompts)."""
    reqs = result.per_request if which is None else [result.per_request[i] for i in which]
    used = np.array([k for r in reqs for k in r["kinds"] if k >= 0], dtype=np.int64)
    counts = np.bincount(used, minlength=len(kinds))
    return {k: float(c / max(1, counts.sum())) for k, c in zip(kinds, counts, strict=True)}


def _embedded(args, texts: list[str], levels: list[int], policies: list[str], bar,
              domains: list[str] | None = None) -> list[dict]:
    from tokenizers import Tokenizer

    from actors.engine.coordinator import Engine
    from actors.engine.loadgen import closed_loop, gamma_arrivals, open_loop, summarize
    from actors.ray_env import start_local_ray
    from deployments.settings import ServeSettings

    settings = ServeSettings.from_env(model_root=args.model_root or str(BUNDLED), drafter=args.drafter,
                                      block=args.block, policy="dcut", ep=args.ep,
                                      max_running=64 if args.request_rate else max(levels))
    cfg = settings.engine_config()
    tok = Tokenizer.from_file(cfg.tokenizer_path)
    prompts = [tok.encode(t).ids for t in texts]
    start_local_ray(num_cpus=settings.local_cpus())
    engine = Engine(cfg)
    rows = []
    try:
        closed_loop(engine, prompts[:2], 2, 8)  # warm-up: first calls load and compile lazily
        for c, rep in ((c, rep) for c in levels for rep in range(args.repeats)):
            n = args.num_prompts if args.request_rate else max(3 * c, args.num_prompts)
            for workload, which in _workloads(prompts, domains, n).items():
                reference, ar_tok_s = None, None
                for policy in (["ar"] + [p for p in policies if p != "ar"]):
                    engine.set_policy(policy)
                    if args.request_rate:  # the same arrival times for every policy
                        arrivals = gamma_arrivals(n, c, args.burstiness)
                        result = open_loop(engine, prompts[:n], arrivals, args.max_tokens)
                    else:
                        result = closed_loop(engine, [prompts[i] for i in which], c, args.max_tokens)
                    result.policy = policy
                    if policy == "ar":
                        reference, ar_tok_s = result.outputs, result.output_tokens / result.wall_s
                    row = summarize(result, ar_tok_s) | {"workload": workload, "drafter": ",".join(engine.kinds),
                                                         "kinds_chosen": kinds_chosen(result, engine.kinds)}
                    if domains and workload == "mixed":  # each domain's MAT inside the mixed run
                        for d in dict.fromkeys(domains):
                            mine = [j for j, i in enumerate(which) if domains[i] == d]
                            row[f"mat_{d}"] = result.mat(mine)
                            row[f"kinds_chosen_{d}"] = kinds_chosen(result, engine.kinds, mine)
                    if args.request_rate:
                        row |= {"request_rate": c, "burstiness": args.burstiness}
                    row["lossless"] = result.outputs == reference
                    row["goodput_tok_s"] = _goodput(result, args)
                    row["repeat"] = rep
                    if policy in policies:
                        rows.append(row)
                    bar.update(1 if policy in policies else 0)
    finally:
        engine.shutdown()
    return rows


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (policy, level) from repeated rounds: the round with the median output rate,
    its speed-up replaced by the median of every round's speed-up (each measured against the
    `ar` run of its own round, minutes apart at most), lossless only if every round was."""
    import statistics

    key = lambda r: (r["policy"], r.get("concurrency"), r.get("request_rate"), r.get("workload"))  # noqa: E731
    groups: dict = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    out = []
    for rs in groups.values():
        rs = sorted(rs, key=lambda r: r["output_tok_s"])
        row = dict(rs[(len(rs) - 1) // 2])
        row["speedup_vs_ar"] = statistics.median(r["speedup_vs_ar"] for r in rs)
        row["speedup_vs_ar_runs"] = [round(r["speedup_vs_ar"], 3) for r in sorted(rs, key=lambda r: r["repeat"])]
        row["lossless"] = all(r["lossless"] for r in rs)
        row["repeats"] = len(rs)
        out.append(row)
    return out


def _goodput(result, args) -> float:
    """Output tokens per second counting only requests that met both latency limits."""
    ok = [t <= args.slo_ttft_ms / 1e3 for t in result.ttft_s]
    tp = [t <= args.slo_tpot_ms / 1e3 for t in result.tpot_s] + [True] * (len(ok) - len(result.tpot_s))
    good = sum(len(o) for o, a, b in zip(result.outputs, ok, tp, strict=False) if a and b)
    return good / result.wall_s


def _http(args, texts: list[str], levels: list[int], bar) -> list[dict]:
    import httpx

    async def one(client, prompt):
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True}
        t0 = time.perf_counter()
        stamps, text = [], []
        async with client.stream("POST", f"{args.url.rstrip('/')}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
                        text.append(chunk["choices"][0]["text"])
        return t0, stamps, "".join(text)

    async def level(c: int) -> dict:
        n = max(c, args.num_prompts)
        queue = list(texts[:n])
        done = []

        async def worker(client):
            while queue:
                done.append(await one(client, queue.pop(0)))

        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(worker(client) for _ in range(c)))
        wall = time.perf_counter() - t0
        ttft = [s[0] - t for t, s, _ in done if s]
        tpot = [(s[-1] - s[0]) / (len(s) - 1) for _, s, _ in done if len(s) > 1]
        pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
        chunks = sum(len(s) for _, s, _ in done)
        return {"policy": "server", "concurrency": c, "requests": n, "output_chunks": chunks, "wall_s": wall,
                "output_tok_s": chunks / wall, "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
                "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99), "mat": float("nan"),
                "verify_tokens_per_step": float("nan"), "keep_ratio": float("nan")}

    rows = []
    for c in levels:
        rows.append(asyncio.run(level(c)))
        bar.update(1)
    return rows


def plot(rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "request_rate" not in r  # plots are against concurrency, of the whole workload
            and r.get("workload") in (None, "heldout", "mixed")]
    policies = sorted({r["policy"] for r in rows}, key=lambda p: ALL_POLICIES.split(",").index(p)
                      if p in ALL_POLICIES.split(",") else 99)
    for key, name, ylabel in (("output_tok_s", "throughput.png", "output tokens/s"),
                              ("speedup_vs_ar", "speedup.png", "speed-up over ar"),
                              ("keep_ratio", "keep_ratio.png", "kept / drafted")):
        if not any(key in r for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for p in policies:
            pts = sorted((r["concurrency"], r[key]) for r in rows if r["policy"] == p and key in r)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        if key == "speedup_vs_ar":
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
