"""Honest liveness on the real app: when the engine's step loop stalls (an EP rank frozen with
SIGSTOP, so a step never returns), /health says so, Serve's health check fails, Serve replaces
the engine replica, and the ingress resubmits the request in flight, which completes exactly."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from ray import serve

from actors.ray_env import start_local_ray
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from deployments.app import build_app
from deployments.settings import ServeSettings

PORT = 8133
BASE = f"http://127.0.0.1:{PORT}"
PROMPT_IDS = [5, 6, 7, 5, 6, 7, 5]


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    start_local_ray(num_cpus=8)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    settings = ServeSettings(model_root=tiny_bundle, block=6, drafter="ngram", policy="full",
                             cost_model_cache=str(tmp_path_factory.mktemp("cache")), stall_timeout_s=2.0,
                             health_check_period_s=1.0, graceful_shutdown_timeout_s=1.0,
                             in_process=False)  # the rank in its own process: freezing it stalls the loop alone
    serve.run(build_app(settings), name="live", route_prefix="/")
    yield
    serve.shutdown()
    ray.shutdown()


def engine_replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "live#engine" in a["name"]]


def test_a_stalled_loop_is_reported_and_its_replica_replaced_and_the_request_completes(server, tiny_bundle):
    expected = greedy_decode(LocalTarget(load_model(f"{tiny_bundle}/target")), [0], [PROMPT_IDS], 24)[0]
    assert httpx.get(f"{BASE}/health", timeout=30).json()["status"] == "ok"
    (rank,) = serve.get_deployment_handle("engine", app_name="live").placement.remote().result()["ranks"]
    (replica,) = engine_replicas()
    body = {"model": "dcut-demo", "prompt": " ".join(f"w{i}" for i in PROMPT_IDS), "max_tokens": 24,
            "temperature": 0}
    os.kill(rank["pid"], signal.SIGSTOP)  # the next step waits on this rank forever
    try:
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(httpx.post, f"{BASE}/v1/completions", json=body, timeout=180)
            unhealthy, deadline = None, time.time() + 60
            while unhealthy is None and not request.done() and time.time() < deadline:
                h = httpx.get(f"{BASE}/health", timeout=30)  # while the request hangs, /health must turn
                unhealthy = h.json() if h.status_code == 503 else None
                time.sleep(0.3)
            r = request.result(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank["pid"], signal.SIGKILL)
    assert unhealthy is not None and "no step finished" in unhealthy["reason"], unhealthy
    assert r.status_code == 200, r.text
    assert r.json()["dcut"][0]["token_ids"] == expected
    (new_replica,) = engine_replicas()
    assert new_replica != replica
    deadline = time.time() + 60
    while httpx.get(f"{BASE}/health", timeout=30).status_code != 200 and time.time() < deadline:
        time.sleep(0.5)
    assert httpx.get(f"{BASE}/health", timeout=30).json()["status"] == "ok"
