"""Autoscaling on a fake multi-node cluster started from cluster_configs/local-fake.yaml.

    .venv/bin/python benchmarks/autoscale_fake_cluster.py [--model-root DIR] [--load-s 40]

Owns the machine's Ray: it runs `ray stop --force` first and last. Steps: start the fake
cluster's head from the YAML (the recipe in NOTES.md), deploy the app with fast autoscaling
(engine 1 → 2 replicas at 2 ongoing requests each; one engine unit needs more CPUs than the head
has, so a second unit needs a new fake node), drive streaming load, watch replicas and nodes
come up, stop the load, watch them go away. Prints a timeline and writes runs/autoscale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}


def sh(*args: str, env: dict | None = None) -> None:
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tiny_bundle() -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest
    import torch

    from actors.target.checkpoint import save_model

    root = pathlib.Path(tempfile.mkdtemp(prefix="dcut-autoscale-"))
    model = conftest.tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    save_model(model, root / "target")
    conftest.tiny_drafter_weights(root / "drafter", model)
    conftest.tiny_tokenizer().save(str(root / "tokenizer.json"))
    return str(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-root", help="model bundle (default: a tiny random one, made now)")
    ap.add_argument("--load-s", type=float, default=40.0)
    ap.add_argument("--port", type=int, default=8131)
    args = ap.parse_args()

    from actors.ray_env import LOCAL_RAY_ENV

    env = os.environ | LOCAL_RAY_ENV | FAST_METRICS | {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    os.environ.update(LOCAL_RAY_ENV | FAST_METRICS)
    model_root = args.model_root or tiny_bundle()
    ray_bin = str(pathlib.Path(sys.executable).with_name("ray"))
    sh(ray_bin, "stop", "--force")
    sh(ray_bin, "start", "--head", f"--autoscaling-config={ROOT / 'cluster_configs' / 'local-fake.yaml'}",
       "--num-cpus=2", "--disable-usage-stats", env=env)
    timeline: list[dict] = []
    try:
        timeline = asyncio.run(drive(model_root, args))
    finally:
        sh(ray_bin, "stop", "--force")
    out = ROOT / "runs" / "autoscale.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(timeline, indent=1))
    peak_r = max(t["engine_replicas"] for t in timeline)
    peak_n = max(t["nodes"] for t in timeline)
    print(f"engine replicas 1 -> {peak_r} -> {timeline[-1]['engine_replicas']}; "
          f"nodes {timeline[0]['nodes']} -> {peak_n} -> {timeline[-1]['nodes']}")


async def drive(model_root: str, args) -> list[dict]:
    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.settings import ServeSettings

    ray.init(address="auto", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    engine_auto = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "look_back_period_s": 2,
                   "upscale_delay_s": 1, "downscale_delay_s": 5}
    settings = ServeSettings(model_root=model_root, block=6, drafter="ngram", max_running=4, max_waiting=64,
                             cost_model_cache=str(pathlib.Path(model_root) / "cache"),
                             engine_autoscaling=engine_auto)
    serve.run(build_app(settings), name="dcut", route_prefix="/")
    t0 = time.time()
    timeline = []
    stop_load = asyncio.Event()

    def snapshot(phase: str) -> None:
        status = serve.status().applications["dcut"].deployments["engine"]
        replicas = sum(n for state, n in status.replica_states.items() if state == "RUNNING")
        wanted = sum(status.replica_states.values())
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        timeline.append({"t": round(time.time() - t0, 1), "phase": phase, "engine_replicas": replicas,
                         "engine_replicas_wanted": wanted, "nodes": nodes})
        print(timeline[-1], flush=True)

    async def client(c: httpx.AsyncClient) -> None:
        body = {"model": "dcut-demo", "prompt": "w3 w4 w3 w4", "max_tokens": 32, "temperature": 0, "stream": True}
        while not stop_load.is_set():
            async with c.stream("POST", f"http://127.0.0.1:{args.port}/v1/completions", json=body) as r:
                await r.aread()

    async with httpx.AsyncClient(timeout=120) as c:
        snapshot("idle")
        tasks = [asyncio.create_task(client(c)) for _ in range(8)]
        end = time.time() + args.load_s
        while time.time() < end:
            await asyncio.sleep(2)
            snapshot("load")
        stop_load.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = time.time() + 90
    while time.time() < end:
        await asyncio.sleep(3)
        snapshot("cool-down")
        if timeline[-1]["engine_replicas"] == 1 and timeline[-1]["nodes"] == timeline[0]["nodes"]:
            break
    serve.shutdown()
    return timeline


if __name__ == "__main__":
    main()
