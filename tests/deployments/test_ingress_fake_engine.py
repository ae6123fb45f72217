"""The ingress over real HTTP and real Serve, against a fake engine that speaks the engine's typed
interface: every error kind reaches the client through the one table, in the body and in the
stream; /health tells what the engine says; /openapi.json publishes the request bodies."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import httpx
import openai
import pytest
import ray
from ray import serve

from actors.engine.api import ErrorKind
from actors.ray_env import start_local_ray
from deployments.app import Ingress
from deployments.errors import ERROR_STATUS
from deployments.settings import ServeSettings

PORT = 8131
BASE = f"http://127.0.0.1:{PORT}"


@pytest.fixture(scope="module")
def fake(tiny_bundle):
    path = pathlib.Path(__file__).with_name("fake_engine.py")
    spec = importlib.util.spec_from_file_location("dcut_fake_engine", path)
    fake_engine = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fake_engine
    spec.loader.exec_module(fake_engine)
    ray.cloudpickle.register_pickle_by_value(fake_engine)  # Serve's workers cannot import it by name
    start_local_ray(num_cpus=4)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    settings = ServeSettings(model_root=tiny_bundle, max_tokens_limit=16)
    serve.run(Ingress.bind(fake_engine.FakeEngine.bind(), settings), name="fake", route_prefix="/")
    yield serve.get_deployment_handle("engine", app_name="fake")
    serve.shutdown()
    ray.shutdown()


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_each_engine_error_kind_maps_through_the_one_table(fake, kind):
    first = {ErrorKind.INVALID: 1, ErrorKind.OVERLOADED: 2, ErrorKind.UNAVAILABLE: 3, ErrorKind.INTERNAL: 4}[kind]
    status, kind_name, code, retry_after = ERROR_STATUS[kind]
    for stream in (False, True):
        r = httpx.post(f"{BASE}/v1/completions", json={"model": "dcut-demo", "prompt": f"w{first} w9",
                                                       "max_tokens": 4, "stream": stream}, timeout=30)
        assert r.status_code == status
        err = r.json()["error"]
        assert (err["type"], err["code"], err["message"]) == (kind_name, code, f"fake {kind.value}")
        assert r.headers.get("retry-after") == retry_after


def test_an_error_mid_stream_arrives_in_band_and_ends_the_stream(fake):
    body = {"model": "dcut-demo", "prompt": "w5 w6", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [e[6:] for e in r.read().decode().split("\n\n") if e]
    assert json.loads(events[0])["choices"][0]["text"] == " w5"
    assert json.loads(events[1])["error"]["code"] == "engine_unavailable"
    assert events[-1] == "[DONE]"


def test_the_engine_receives_one_typed_request(fake):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="dcut-demo", prompt="w7 w8", max_tokens=3, temperature=0.5, seed=-9,
                                    stop=["zz"], extra_body={"ignore_eos": True})
    assert out.choices[0].text == " w7 w8 w7" and out.usage.completion_tokens == 3
    req = fake.last_request.remote().result()
    assert req.prompt == [7, 8] and req.resume == []
    assert (req.params.max_tokens, req.params.temperature, req.params.seed, req.params.stop) == (3, 0.5, -9, ("zz",))
    assert req.params.ignore_eos


def test_health_is_the_engines(fake):
    r = httpx.get(f"{BASE}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    fake.set_health.remote(False, "no step finished for 99 s").result()
    try:
        r = httpx.get(f"{BASE}/health", timeout=30)
        assert r.status_code == 503
        assert r.json()["status"] == "unhealthy" and "99 s" in r.json()["reason"]
    finally:
        fake.set_health.remote(True).result()


def test_openapi_publishes_the_request_schemas(fake):
    spec = httpx.get(f"{BASE}/openapi.json", timeout=30).json()
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}"
        props = spec["components"]["schemas"][name]["properties"]
        assert {"model", "max_tokens", "seed", "temperature", "stream"} <= set(props)
    assert spec["components"]["schemas"]["ChatMessage"]["properties"]["role"]
