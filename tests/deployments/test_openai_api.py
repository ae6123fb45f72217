"""The served app over real HTTP with the real `openai` client, and raw httpx for SSE framing:
the endpoints, errors, overload, cancellation, liveness after odd requests, placement."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from dcut_core.payoff import arms_of
from tests.deployments.dashboard import exported, queried_metrics
from tests.deployments.openai_server import BASE, PROMPT, PROMPT_IDS, assert_still_serving, words


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["dcut-demo"]


def test_completion_equals_plain_greedy_decoding(client, reference):
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text.strip() == words(reference)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (7, 12)


def test_streaming_matches_non_streaming_and_reports_usage(client, reference):
    chunks = list(client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip() == words(reference)
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion_and_chat_stream(client):
    msgs = [{"role": "user", "content": "w9 w10 w11"}]
    full = client.chat.completions.create(model="dcut-demo", messages=msgs, max_tokens=6, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    parts = list(client.chat.completions.create(model="dcut-demo", messages=msgs, max_tokens=6, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full.choices[0].message.content


def test_stop_and_seed(client, reference):
    stop = words(reference[3:5])
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].text
    assert out.choices[0].text.strip() == words(reference[:3])
    a, b, c = (client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=s)
               for s in (7, 7, 8))
    assert a.choices[0].text == b.choices[0].text  # same seed, same request alone: same output
    assert {a.choices[0].text, c.choices[0].text}  # a different seed still answers


def test_odd_stop_strings_end_where_a_whole_text_search_would_and_the_server_keeps_serving(client, reference):
    """Stop strings are searched only past where the last search left off (`Sequence.stop_hits`):
    one spanning two tokens that speculative steps may commit together, streamed and not; two
    never met — one with a character no token makes, one longer than any output; one met at the
    first token but held back by `min_tokens`. Each ends where searching the whole text after every
    step ends it, and the server serves after them."""
    full = words(reference)
    stop = words(reference[4:6])
    want = full[:full.find(stop)].strip()
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert (out.choices[0].text.strip(), out.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks).strip() == want
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    never = ["w5 ☕", "w1 " * 400]
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=never)
    assert (out.choices[0].text.strip(), out.choices[0].finish_reason) == (full, "length")
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[words(reference[:1])], extra_body={"min_tokens": 3})
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("stop", 3)
    assert_still_serving(client)


def test_sse_framing(server):
    body = {"model": "dcut-demo", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "text_completion"


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "dcut-demo", "prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"model": "gpt-4", "prompt": "w1"}).encode(), 404, "does not exist"),
    (json.dumps({"model": "dcut-demo", "prompt": ""}).encode(), 400, "empty"),
    (json.dumps({"model": "dcut-demo", "prompt": "w1 " * 80}).encode(), 400, "limit is 64"),
    (json.dumps({"model": "dcut-demo", "prompt": "w1", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "dcut-demo", "prompt": "w1", "max_tokens": 33}).encode(), 400, "above the limit"),
    (json.dumps({"model": "dcut-demo", "prompt": "w1", "stop": ["a", "b", "c"]}).encode(), 400, "stop"),
    (json.dumps({"model": "dcut-demo", "prompt": "w1 " * 110_000}).encode(), 413, "larger than"),
    (json.dumps({"model": "dcut-demo", "prompt": "w1", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps([1, 2]).encode(), 400, "JSON object"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, client, body, status, message):
    r = httpx.post(f"{BASE}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"] and err["type"]
    assert client.completions.create(model="dcut-demo", prompt="w1 w2", max_tokens=2, temperature=0).choices


def test_api_key_is_required_when_configured(server):
    url = f"{BASE}/guarded/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0)
    assert good.completions.create(model="dcut-demo", prompt="w3 w4", max_tokens=3, temperature=0).choices


def test_overload_gets_429_with_retry_after(server):
    async def one(c: httpx.AsyncClient) -> int:
        body = {"model": "dcut-demo", "prompt": "w3 w4 w3 w4", "max_tokens": 32, "temperature": 0, "stream": True}
        async with c.stream("POST", f"{BASE}/guarded/v1/completions", json=body,
                            headers={"authorization": "Bearer sekret"}) as r:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
            await r.aread()
            return r.status_code

    async def many() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c) for _ in range(8)))

    codes = asyncio.run(many())
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}


def in_flight() -> float:
    text = httpx.get(f"{BASE}/metrics", timeout=30).text
    return float(re.search(r"^dcut_engine_in_flight (\S+)$", text, re.M).group(1))


def test_client_disconnect_cancels_the_request(server):
    body = {"model": "dcut-demo", "prompt": "w3 w4", "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # one event, then hang up
    deadline = time.time() + 20
    while in_flight() > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert in_flight() == 0


def test_metrics_are_exposed(server, client):
    client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=4, temperature=0, stream=False)
    text = httpx.get(f"{BASE}/metrics", timeout=30).text
    for name in ("dcut_requests_total", "dcut_generated_tokens_total", "dcut_ttft_seconds_bucket",
                 "dcut_engine_mat", "dcut_engine_keep_ratio", "dcut_engine_predicted_verify_s"):
        assert name in text
    assert re.search(r'^dcut_engine_drafter_drafts\{drafter="block",outcome="drafted"\} \S+$', text, re.M)
    frozen = re.search(r"^dcut_engine_gc_frozen_objects (\S+)$", text, re.M)
    assert frozen and float(frozen.group(1)) > 10_000  # the engine replica froze its start-up heap (actors/heap.py)
    assert re.search(r"^dcut_engine_gc_longest_pause_s \S+$", text, re.M)
    assert re.search(r"^dcut_engine_graph_captures 0\.0$", text, re.M)  # CPU ranks: no CUDA graphs


def test_the_dashboard_queries_only_exported_metrics(server, client):
    """Every metric the operator's Grafana dashboard queries is exported by the served app (the
    GPU gauges need NVML, and a load band's payoff lead both of its arms measured at 6 or more
    requests: test_dashboard.py checks those with stand-ins)."""
    client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=4, temperature=0, stream=False)
    text = httpx.get(f"{BASE}/metrics", timeout=30).text
    wanted = {n for n in queried_metrics()
              if not n.startswith("dcut_gpu_") and n not in ("dcut_engine_payoff_lead", "dcut_engine_payoff_arm")}
    assert wanted - exported(text) == set()
    assert re.search(r'^dcut_engine_rank_step_seconds\{rank="0"\} \S+$', text, re.M)


# Values a client can send where they do not belong: integer extremes, floats for integers,
# odd unicode (lone surrogates, NUL, right-to-left marks), long and many stop strings, nesting.
ODD_VALUES = [-1, -(2**63) - 1, 2**63, 2**64 + 1, 10**40, 0, 2.5, -0.0, 1e308, True, None, "", "\ud800", "\x00w1",
              "🙂" * 50, "\u202ew1 w2", "w1" * 40, ["w1"] * 500, ["x" * 3000], ["a", "\udfff"], {"a": [1]}, [[1, 2]],
              [{"role": "user", "content": "w1"}], [{"type": "text", "text": "w1"}]]


SWEEP_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                "stop", "stream", "stream_options", "n", "user", "logprobs", "top_logprobs", "echo", "best_of",
                "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "top_k", "min_p",
                "min_tokens", "stop_token_ids", "response_format", "structured_outputs", "ignore_eos", "drafter"]


@pytest.fixture(scope="module")
def request_bodies(server) -> dict[bool, st.SearchStrategy]:
    """Bodies generated by schemathesis from the running server's /openapi.json, by chat or not."""
    import schemathesis

    schema = schemathesis.openapi.from_dict(httpx.get(f"{BASE}/openapi.json", timeout=30).json())
    return {chat: schema[f"/v1/{'chat/completions' if chat else 'completions'}"]["POST"].as_strategy()
            .map(lambda case: case.body) for chat in (False, True)}


@st.composite
def fuzz_bodies(draw, generated: st.SearchStrategy, chat: bool) -> dict:
    """A body its published schema allows (most name no model we serve), or a plain valid
    request; either with up to three fields then set to odd values or to a field no schema has."""
    if draw(st.booleans()):
        body = draw(generated)
        body = body if isinstance(body, dict) else {"body": body}
    else:
        body = {"model": "dcut-demo", "max_tokens": 2}
        body |= {"messages": [{"role": "user", "content": "w1 w2"}]} if chat else {"prompt": "w1 w2"}
    fields = [*SWEEP_FIELDS, "x_unknown"]
    for _ in range(draw(st.integers(0, 3))):
        body[draw(st.sampled_from(fields))] = draw(st.sampled_from(ODD_VALUES))
    return body


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), chat=st.booleans())
def test_fuzzed_bodies_fail_alone_and_the_server_keeps_serving(server, client, request_bodies, data, chat):
    body = data.draw(fuzz_bodies(request_bodies[chat], chat))
    url = f"{BASE}/v1/{'chat/completions' if chat else 'completions'}"
    raw_body = json.dumps(body).encode()  # \\u escapes: lone surrogates travel as JSON allows
    with httpx.stream("POST", url, content=raw_body, headers={"content-type": "application/json"}, timeout=60) as r:
        raw = r.read().decode()
    assert r.status_code < 500, (body, raw[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    elif body.get("stream") is True:
        assert raw.rstrip().endswith("data: [DONE]")
    assert_still_serving(client)




def test_the_served_spec_as_is_reaches_the_engine(server, client):
    """The spec tools read: every error answer in OpenAI's error schema, `model` an enum of the
    served names, the limits as enforced, /metrics as text. Bodies schemathesis draws from it,
    unmodified: none is a 5xx, every one is answered, and most reach the engine."""
    import schemathesis

    spec = httpx.get(f"{BASE}/openapi.json", timeout=30).json()
    post = spec["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(post["responses"])
    assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == ["dcut-demo"]
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # bounds under JSON Schema's names (pydantic leaves "ge" inside unions), one SSE event an object
    assert not re.search(r'"(ge|le|gt|lt)":', json.dumps(spec["components"]))
    best_of = spec["components"]["schemas"]["CompletionRequest"]["properties"]["best_of"]["anyOf"][0]
    assert best_of == {"type": "integer", "minimum": 1, "maximum": 16}  # the choice limit, as n
    event = post["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert event["type"] == "object" and event["properties"]["data"]["type"] == "string"
    drafter = spec["components"]["schemas"]["CompletionRequest"]["properties"]["drafter"]["anyOf"]
    assert set(drafter[0]["enum"]) == {"block", "mtp", "eagle3", "ngram"} and drafter[-1] == {"type": "null"}
    bodies = schemathesis.openapi.from_dict(spec)["/v1/completions"]["POST"].as_strategy().map(lambda c: c.body)
    statuses: list[int] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(body=bodies)
    def send(body):
        r = httpx.post(f"{BASE}/v1/completions", content=json.dumps(body).encode(), timeout=60,
                       headers={"content-type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code < 500, (body, r.text[:300])

    send()
    reached = sum(s == 200 for s in statuses) / len(statuses)
    print(f"schemathesis bodies as drawn: {len(statuses)} sent, {reached:.0%} answered 200")
    assert reached >= 0.5, statuses
    assert_still_serving(client)


@pytest.mark.parametrize("field", SWEEP_FIELDS)
def test_every_odd_value_in_every_field_fails_alone(server, client, field):
    """The fuzz samples; this sweeps: each odd value in each field, on both endpoints."""
    for chat in (False, True):
        base = {"model": "dcut-demo", "max_tokens": 2}
        base |= {"messages": [{"role": "user", "content": "w1 w2"}]} if chat else {"prompt": "w1 w2"}
        for value in ODD_VALUES:
            body = json.dumps(base | {field: value}).encode()
            r = httpx.post(f"{BASE}/v1/{'chat/completions' if chat else 'completions'}", content=body,
                           headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code < 500, (field, value, r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"]
    assert_still_serving(client)


RAW_BODIES = [
    b'{"model": "dcut-demo", "prompt": "w1", "temperature": NaN}',
    b'{"model": "dcut-demo", "prompt": "w1", "seed": ' + b"9" * 5000 + b"}",  # past Python's int-digit limit
    b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the parser's recursion
    b'{"model": "dcut-demo", "prompt": "w1"' + bytes([0xFF, 0xFE]) + b"}",  # not UTF-8
    b"",
]


@pytest.mark.parametrize("raw", RAW_BODIES, ids=["nan", "long-int", "deep", "bad-utf8", "empty"])
def test_malformed_json_gets_a_400_and_the_server_keeps_serving(server, client, raw):
    r = httpx.post(f"{BASE}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code in (400, 413) and r.json()["error"]["message"], r.text[:300]
    assert_still_serving(client)


def test_server_still_serves_after_fuzzing(client, reference):
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text.strip() == words(reference)


def test_engine_unit_death_mid_stream_is_invisible_to_the_client(server, tiny_bundle):
    """Runs last: it kills the main app's engine replica; Serve starts a new one and the ingress
    resubmits the request with the tokens already streamed."""
    target = load_model(f"{tiny_bundle}/target")
    expected = words(greedy_decode(LocalTarget(target), [0], [PROMPT_IDS], 30)[0])
    body = {"model": "dcut-demo", "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                break
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if "dcut#engine" in a["name"] or "main#engine" in a["name"]]
        assert len(replicas) == 1, replicas
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
    assert "".join(text).strip().split() == expected.split()


def test_each_engine_unit_is_one_placement_group(server):
    """Coordinator (the engine replica), EP rank and drafter of an app share one placement group,
    each app its own. An n-gram-only unit ("guarded") has no drafter replica: the coordinator
    drafts n-gram itself."""
    groups = []
    for app, drafters in (("main", 1), ("guarded", 0)):
        where = serve.get_deployment_handle("engine", app_name=app).placement.remote().result()
        parts = [where["coordinator"], *where["ranks"], *where["drafters"]]
        assert len(where["drafters"]) == drafters and len(parts) == 2 + drafters
        pgs = {p["placement_group"] for p in parts}
        assert len(pgs) == 1 and None not in pgs
        groups.append(pgs.pop())
    assert groups[0] != groups[1]


def test_ep2_unit_is_driven_from_the_engine_replica_and_decodes_exactly(server, reference):
    """EP 2 under Serve: the engine replica's own process is rank 0 (it drives rank 1 over the
    unit's process group, no Ray call per step), each rank hosts its drafter, all in one placement
    group; output equals plain greedy decoding, with speculation taking place."""
    where = serve.get_deployment_handle("engine", app_name="ep2").placement.remote().result()
    coordinator, ranks, drafters = where["coordinator"], where["ranks"], where["drafters"]
    assert ranks[0]["pid"] == coordinator["pid"] != ranks[1]["pid"]
    assert [d["pid"] for d in drafters] == [r["pid"] for r in ranks]
    assert len({p["placement_group"] for p in [coordinator, *ranks]}) == 1
    ep2 = openai.OpenAI(base_url=f"{BASE}/ep2/v1", api_key="unused", max_retries=0)
    outs = [ep2.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0)
            for _ in range(2)]
    for out in outs:
        assert out.choices[0].text.strip() == words(reference)
    stats = serve.get_deployment_handle("engine", app_name="ep2").stats.remote().result()
    assert stats["steps"] > 0 and stats["keep_ratio"] > 0, stats  # policy full: every draft verified


def test_chat_content_as_text_parts_is_the_same_conversation(client):
    plain = client.chat.completions.create(model="dcut-demo", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "w9 w10 w11"}])
    parts = client.chat.completions.create(model="dcut-demo", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "w9 w10"}, {"type": "text", "text": " w11"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="type"):
        client.chat.completions.create(model="dcut-demo", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(("field", "value"), [("logprobs", 21), ("presence_penalty", 2.5), ("logit_bias", {"x": 1}),
                                              ("logit_bias", {"5": 101}), ("top_logprobs", 2), ("tools", [TOOL]),
                                              ("tool_choice", "auto"), ("suffix", "w1"),
                                              ("stop_token_ids", [99999]), ("min_tokens", 3), ("x_unknown", 1)])
def test_unimplemented_unknown_or_out_of_range_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError, match=field):
        client.completions.create(model="dcut-demo", prompt="w1 w2", max_tokens=2, extra_body={field: value})
    assert_still_serving(client)


def test_unimplemented_fields_at_their_neutral_value_and_ignore_eos_are_accepted(client):
    out = client.completions.create(model="dcut-demo", prompt="w1 w2", max_tokens=2, temperature=0, logprobs=None,
                                    presence_penalty=0.0, frequency_penalty=0, echo=False, best_of=1,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_prompts_as_token_ids_and_several_prompts(client, reference):
    one = client.completions.create(model="dcut-demo", prompt=PROMPT_IDS, max_tokens=12, temperature=0)
    assert one.choices[0].text.strip() == words(reference)
    assert one.usage.prompt_tokens == len(PROMPT_IDS)
    many = client.completions.create(model="dcut-demo", prompt=[PROMPT_IDS, [9, 10, 11]], max_tokens=12,
                                     temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text.strip() == words(reference)
    for bad in ([], [[]], [5, 10**6], [5, -1]):
        with pytest.raises(openai.BadRequestError, match="prompt"):
            client.completions.create(model="dcut-demo", prompt=bad, max_tokens=2)




def test_requests_that_join_while_others_draft_decode_exactly_and_the_server_keeps_serving(client, tiny_bundle):
    """Prompts fed in steps where other requests draft (the gate prices a draft beside the step's
    prefill chunks): a one-token prompt, the longest allowed (64), repeating text the n-gram kind
    drafts for, started a little apart and at once; each equals plain greedy decoding, and the
    server serves after them."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPT_IDS * 3, [5], [(7 * i) % 90 + 1 for i in range(64)], [9, 10, 11] * 5, [12, 13]]
    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    expected = greedy_decode(model, list(range(len(prompts))), prompts, 20)

    def complete(i: int) -> str:
        time.sleep(0.05 * (i % 3))  # some arrive while the first ones decode
        out = client.completions.create(model="dcut-demo", prompt=prompts[i], max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True}, timeout=60)
        return out.choices[0].text.strip()

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, range(len(prompts))))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_bundle}/tokenizer.json")  # token 0, EOS, is written by its name
    assert texts == [tok.decode(e, skip_special_tokens=False).strip() for e in expected]
    assert_still_serving(client)


def test_a_batch_under_the_payoff_check_decodes_exactly_after_odd_requests_and_the_server_keeps_serving(
        client, tiny_bundle):
    """Odd requests first (a negative `max_tokens`, a prompt of a token id past the vocabulary),
    then batches of ten at once until the payoff check (dcut_core/payoff.py) has measured every arm
    of their load band (plain steps and each kind's among the gate's; the main app hosts four kinds,
    so six arms — a few batches when this test runs alone): each request equals plain greedy
    decoding, the check reports a lead and plays one arm for the band on /metrics, and the server
    serves after them."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    for body in ({"model": "dcut-demo", "prompt": "w1", "max_tokens": -3},
                 {"model": "dcut-demo", "prompt": [10 ** 6], "max_tokens": 4}):
        r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text[:300]
    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    tok = Tokenizer.from_file(f"{tiny_bundle}/tokenizer.json")

    def complete(prompt: list[int]) -> str:
        out = client.completions.create(model="dcut-demo", prompt=prompt, max_tokens=32, temperature=0,
                                        extra_body={"ignore_eos": True}, timeout=120)
        return out.choices[0].text.strip()

    for batch in range(12):
        prompts = [[(3 * i + j + batch) % 80 + 1 for j in range(4 + i)] * 2 for i in range(10)]
        ids = [10 * batch + i for i in range(len(prompts))]  # new ids each batch: fresh caches
        expected = greedy_decode(model, ids, prompts, 32)
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts))
        assert texts == [tok.decode(e, skip_special_tokens=False).strip() for e in expected], batch
        metrics = httpx.get(f"{BASE}/metrics", timeout=30).text
        played = re.findall(r'^dcut_engine_payoff_arm\{arm="([^"]+)",requests="6"\} 1\.0$', metrics, re.M)
        if played:  # the band has left its warm-up: every arm measured
            break
    assert re.search(r'^dcut_engine_payoff_lead\{requests="6"\} \S+$', metrics, re.M), \
        [line for line in metrics.splitlines() if "payoff" in line]
    # one arm a band: plain, the gate over every kind, or the gate over one of the four kinds alone
    assert len(played) == 1 and played[0] in arms_of(("block", "mtp", "eagle3", "ngram")), played
    assert_still_serving(client)


def test_the_one_kind_app_decides_on_lists_and_decodes_exactly_after_odd_requests(server, tiny_bundle):
    """The app of one drafter kind (n-gram at the serving default's block, as `dcut serve` runs
    by default; "guarded", one request at a time) decides every step of a few requests in plain
    Python (`DraftingGate._decide_in_turn`). After odd requests (a `max_tokens` of 1, so no room
    to draft; a prompt that repeats nothing; one naming its drafter), repeating prompts whose
    drafts the gate plans: every answer equals plain greedy decoding, drafts were accepted, and
    the app serves after them (a plain request completes, its /health says ok). That the default
    drafts past block 8 for a request decoding alone: tests/actors/test_engine.py."""
    from tokenizers import Tokenizer

    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    tok = Tokenizer.from_file(f"{tiny_bundle}/tokenizer.json")
    guarded = openai.OpenAI(base_url=f"{BASE}/guarded/v1", api_key="sekret", max_retries=0)

    def accepted() -> float:
        text = httpx.get(f"{BASE}/guarded/metrics", headers={"authorization": "Bearer sekret"}, timeout=30).text
        line = r'^dcut_engine_drafter_drafts\{drafter="ngram",outcome="accepted"\} (\S+)$'
        return sum(float(v) for v in re.findall(line, text, re.M))

    cases = [([5, 9, 5, 9], 1, {}), ([(7 * j + 3) % 97 + 1 for j in range(12)], 12, {}),
             ([4, 8, 15, 16, 23, 42] * 2, 20, {"drafter": "ngram"}),
             *(([(5 * i + j) % 80 + 1 for j in range(3 + i)] * 3, 24, {}) for i in range(4))]
    before = accepted()
    for i, (prompt, n, extra) in enumerate(cases):
        out = guarded.completions.create(model="dcut-demo", prompt=prompt, max_tokens=n, temperature=0, timeout=120,
                                         extra_body={"ignore_eos": True, **extra})
        expected = greedy_decode(model, [100 + i], [prompt], n)[0]  # a fresh cache for each
        assert out.choices[0].text.strip() == tok.decode(expected, skip_special_tokens=False).strip(), i
    assert accepted() > before  # the gate planned drafts, and they were accepted
    out = guarded.completions.create(model="dcut-demo", prompt="w1 w2", max_tokens=2, temperature=0, timeout=30)
    assert out.choices[0].finish_reason == "length"
    health = httpx.get(f"{BASE}/guarded/health", headers={"authorization": "Bearer sekret"}, timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def test_a_streamed_request_of_several_choices_that_fails_at_the_first_token_is_a_400(server, client):
    """Every choice of a streamed n = 4 request fails before its first token (structured output on
    a model without a tokenizer): one 400, not a 500 from closing the other choices' streams while
    their first tokens were still awaited (found by the fuzz test), and the server keeps serving."""
    body = {"model": "dcut-demo", "messages": [{"role": "system", "content": "é"}], "max_tokens": 2, "n": 4,
            "stream": True, "structured_outputs": {"grammar": ""}}
    with httpx.stream("POST", f"{BASE}/v1/chat/completions", json=body, timeout=60) as r:
        raw = r.read().decode()
    assert r.status_code == 400 and "structured output" in raw, raw[:300]
    assert_still_serving(client)


def assert_same_answers(alone: list[tuple], together: list[tuple]) -> None:
    """(text, finish reason, log-probabilities or None) of each request sent alone equal those of
    the same requests sent together (log-probabilities to 1e-4)."""
    for a, b in zip(alone, together, strict=True):
        assert (a[0], a[1]) == (b[0], b[1])
        if a[2] is not None:
            assert b[2] is not None and np.allclose(a[2], b[2], atol=1e-4)


def test_a_batch_of_mixed_request_shapes_commits_each_as_it_would_alone_and_the_server_keeps_serving(client):
    """One batch whose requests take both commit paths (`Scheduler.record_step`: the usual
    request's tokens by list operations, the others token by token — log-probabilities, stop ids,
    a stop string, one token, no EOS), with a prompt fed beside them and four to five decoding at
    once (the payoff check's band of 3–5 in this app of four kinds): each answer equals the same
    request sent alone, and the server serves after them."""
    from concurrent.futures import ThreadPoolExecutor

    shapes = [{}, {"logprobs": 2}, {"extra_body": {"stop_token_ids": [17], "ignore_eos": True}},
              {"stop": [" w3"]}, {"max_tokens": 1}, {"extra_body": {"ignore_eos": True}}]

    def complete(i: int):
        time.sleep(0.03 * (i % 2))  # a prompt fed while the others decode
        kw = {"max_tokens": 24, **shapes[i]}
        out = client.completions.create(model="dcut-demo", prompt=PROMPT_IDS * (1 + i % 3), temperature=0,
                                        timeout=60, **kw)
        c = out.choices[0]
        return c.text, c.finish_reason, None if c.logprobs is None else c.logprobs.token_logprobs

    alone = [complete(i) for i in range(len(shapes))]
    with ThreadPoolExecutor(len(shapes)) as pool:
        together = list(pool.map(complete, range(len(shapes))))
    assert_same_answers(alone, together)
    assert alone[4][1] == "length" and alone[1][2] is not None
    assert_still_serving(client)


def test_steps_where_no_kind_may_draft_decode_exactly_and_the_server_keeps_serving(client, tiny_bundle):
    """Steps the gate plans plain at once (`DraftingGate.decide`: no kind may draft for any
    request): a batch of requests with one token left after prefill (every cap 0), then one naming
    the n-gram kind alone over a prompt that repeats nothing (its look-ahead finds nothing until
    the output repeats) beside another such batch. Each answer equals plain greedy decoding, and
    the server serves after them."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    model = LocalTarget(load_model(f"{tiny_bundle}/target"))
    tok = Tokenizer.from_file(f"{tiny_bundle}/tokenizer.json")

    def complete(prompt: list[int], n: int, extra: dict) -> str:
        out = client.completions.create(model="dcut-demo", prompt=prompt, max_tokens=n, temperature=0, timeout=120,
                                        extra_body={"ignore_eos": True, **extra})
        return out.choices[0].text.strip()

    short = [[(5 * i + j) % 80 + 1 for j in range(3 + i)] for i in range(4)]
    lone = [[(7 * j + 3) % 97 + 1 for j in range(12)]]  # twelve distinct ids
    cases = [(p, 2, {}) for p in short] + [(lone[0], 20, {"drafter": "ngram"})] + [(p, 2, {}) for p in short]
    expected = [greedy_decode(model, [i], [p], n)[0] for i, (p, n, _) in enumerate(cases)]
    with ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(lambda c: complete(*c), cases))
    assert texts == [tok.decode(e, skip_special_tokens=False).strip() for e in expected]
    assert_still_serving(client)


def test_a_batch_mixing_what_the_census_counts_answers_each_as_alone_and_the_counts_come_back(client):
    """The scheduler's census (`Census`: sampling, log-probabilities, controls or a grammar, named
    drafters, prefill) decides which passes a step makes over its batch. One batch of greedy
    requests beside a seeded sampling one, sampling controls, min_tokens, a request naming its
    drafter and one asking for log-probabilities: each answer equals the same
    request sent alone; then a greedy batch of the plain shape alone (every count back to 0 but
    prefill's) answers as before it, and the server serves. (A grammar is counted with the
    controls; this app has no tokenizer to build one: tests/actors/test_structured_output.py.)"""
    from concurrent.futures import ThreadPoolExecutor

    shapes = [{}, {"temperature": 0.8, "seed": 7}, {"presence_penalty": 0.8},
              {"extra_body": {"min_tokens": 6, "ignore_eos": False}},
              {"extra_body": {"drafter": "ngram"}}, {"logprobs": 1}, {}]

    def complete(i: int, shape: dict | None = None):
        time.sleep(0.02 * (i % 3))  # prompts fed while others decode
        kw = {"max_tokens": 16, "temperature": 0, **(shapes[i] if shape is None else shape)}
        out = client.completions.create(model="dcut-demo", prompt=PROMPT_IDS * (1 + i % 2), timeout=60, **kw)
        c = out.choices[0]
        return c.text, c.finish_reason, None if c.logprobs is None else c.logprobs.token_logprobs

    alone = [complete(i) for i in range(len(shapes))]
    plain_before = [complete(i, {}) for i in range(4)]
    with ThreadPoolExecutor(len(shapes)) as pool:
        together = list(pool.map(complete, range(len(shapes))))
    assert_same_answers(alone, together)
    # Each need was acted on (a count stuck at 0 would have skipped it): log-probabilities came
    # back, and the draw and the penalty changed the output from the same prompt's greedy one.
    assert alone[5][2] is not None and alone[1][0] != plain_before[1][0] and alone[2][0] != plain_before[2][0]
    with ThreadPoolExecutor(4) as pool:
        plain_after = list(pool.map(lambda i: complete(i, {}), range(4)))
    assert plain_after == plain_before
    assert_still_serving(client)
