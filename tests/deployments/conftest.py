"""Fixtures of the OpenAI-API test modules: one Ray Serve instance per module with four apps —
the tiny model (every drafter kind, chosen per request); a guarded one with an API key and tiny
limits; EP 2; the bundled demo model (its tokenizer can spell JSON) — the real `openai` client,
and plain greedy decoding to compare with. Modules that need another server define their own
`server` fixture."""

from __future__ import annotations

import openai
import pytest
import ray
from ray import serve

from actors.ray_env import start_local_ray
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from deployments.app import build_app
from deployments.bundle import BUNDLED
from deployments.settings import ServeSettings
from tests.deployments.openai_server import BASE, PORT, PROMPT_IDS


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    start_local_ray(num_cpus=12)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    cache = str(tmp_path_factory.mktemp("cache"))
    common = dict(model_root=tiny_bundle, block=6, cost_model_cache=cache, max_prompt_tokens=64,
                  max_tokens_limit=32, max_stop=2, max_body_bytes=300_000)
    # main: every kind the tiny bundle holds (block, mtp, eagle3, ngram)
    serve.run(build_app(ServeSettings(**common, drafter="auto")), name="main", route_prefix="/")
    # guarded: n-gram alone at the serving default's block (unset: 16 while one request decodes alone)
    serve.run(build_app(ServeSettings(**(common | {"block": None}), api_key="sekret", max_running=1, max_waiting=1,
                                      drafter="ngram")), name="guarded", route_prefix="/guarded")
    # ep2: the block drafter, hosted by each rank (an n-gram-only unit has no drafter replica)
    serve.run(build_app(ServeSettings(**common, ep=2, threads_per_rank=1, cpus_per_rank=1, policy="full",
                                      drafter="block")), name="ep2", route_prefix="/ep2")
    # The bundled demo model: a byte-level BPE tokenizer that can spell JSON (structured output).
    demo = common | {"model_root": str(BUNDLED), "max_tokens_limit": 64}
    serve.run(build_app(ServeSettings(**demo, drafter="ngram", policy="full")), name="demo", route_prefix="/demo")
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_bundle) -> list[int]:
    return greedy_decode(LocalTarget(load_model(f"{tiny_bundle}/target")), [0], [PROMPT_IDS], 12)[0]
