"""Soak: hold a concurrency against the served app for a while; failures, memory, TPOT over time.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--concurrency 64] [--model-root DIR]

Starts local Ray + the Serve app (bundled model unless --model-root), then keeps C streaming
clients busy with mixed prompt and output lengths. Every 10 s it records the resident memory of
every process of this Ray session (from /proc) and the TPOT of the requests finished in that
window. Writes runs/soak.json and prints a summary: failed requests, RSS drift of each process
(last window against the first after warm-up), p99 TPOT per minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ray_processes() -> dict[int, tuple[str, int]]:
    """pid -> (name, RSS bytes) of this machine's Ray processes (and this driver)."""
    from chaos import name_of, processes  # benchmarks/ is this script's folder

    return {pid: (name_of(p)[:40], p.rss) for pid, p in processes().items() if "ray" in p.title or pid == os.getpid()}


async def soak(args) -> dict:
    import httpx

    from deployments.workload import heldout_prompts

    prompts = heldout_prompts(256, seed=3)
    rng = random.Random(0)
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    stop = asyncio.Event()
    done: list[dict] = []
    failures: list[str] = []

    async def client(c: httpx.AsyncClient) -> None:
        while not stop.is_set():
            p = prompts[rng.randrange(len(prompts))][: rng.choice((40, 120, 400))]
            n = rng.choice((8, 32, 96))
            t0 = time.perf_counter()
            stamps = []
            try:
                body = {"model": "dcut-demo", "prompt": p, "max_tokens": n, "temperature": 0, "stream": True}
                async with c.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        failures.append(f"HTTP {r.status_code}")
                        await r.aread()
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            stamps.append(time.perf_counter())
            except httpx.HTTPError as exc:
                failures.append(type(exc).__name__)
                continue
            if len(stamps) > 1:
                done.append({"end": stamps[-1], "ttft": stamps[0] - t0,
                             "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1)})

    windows = []
    async with httpx.AsyncClient(timeout=600) as c:
        tasks = [asyncio.create_task(client(c)) for _ in range(args.concurrency)]
        t_start = time.perf_counter()
        while time.perf_counter() - t_start < args.minutes * 60:
            await asyncio.sleep(10)
            now = time.perf_counter()
            recent = [d["tpot"] for d in done if d["end"] > now - 10]
            procs = ray_processes()
            windows.append({"t_s": round(now - t_start), "finished": len(done), "failures": len(failures),
                            "tpot_p99_ms": 1e3 * sorted(recent)[int(0.99 * (len(recent) - 1))] if recent else None,
                            "rss_total_mb": sum(r for _, r in procs.values()) / 2**20,
                            "rss_by_pid_mb": {f"{pid}:{n}": r / 2**20 for pid, (n, r) in procs.items()}})
            print({k: v for k, v in windows[-1].items() if k != "rss_by_pid_mb"}, flush=True)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"windows": windows, "failures": failures, "requests": len(done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model-root")
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()

    from actors.ray_env import start_local_ray

    start_local_ray(num_cpus=max(4, (os.cpu_count() or 1) + 2))
    from ray import serve

    from deployments.app import build_app
    from deployments.settings import ServeSettings

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    settings = ServeSettings.from_env(**({"model_root": args.model_root} if args.model_root else {}),
                                      max_running=args.concurrency, block=args.block)
    serve.run(build_app(settings), name="dcut", route_prefix="/")
    result = asyncio.run(soak(args))
    serve.shutdown()
    out = ROOT / "runs" / "soak.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    w = result["windows"]
    warm = w[min(2, len(w) - 1)]["rss_by_pid_mb"]
    last = w[-1]["rss_by_pid_mb"]
    drift = {k: last[k] / warm[k] - 1 for k in last if k in warm and warm[k] > 50}
    print(f"requests {result['requests']}, failed {len(result['failures'])}; RSS total "
          f"{w[0]['rss_total_mb']:.0f} -> {w[-1]['rss_total_mb']:.0f} MB; worst per-process drift "
          f"{100 * max(drift.values(), default=0):+.1f} %; p99 TPOT by window (ms): "
          f"{[round(x['tpot_p99_ms']) for x in w if x['tpot_p99_ms']]}")


if __name__ == "__main__":
    main()
