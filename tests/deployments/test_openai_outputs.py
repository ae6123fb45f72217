"""What a request asks of its output, through the served app and the real `openai` client:
log-probabilities, echo, n and best_of, several prompts streamed, sampling controls, structured
output, the chat template. Exactness under speculation is tested at the engine
(tests/actors/test_engine.py, test_structured_output.py); here, that the API carries it."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from actors.target.checkpoint import load_model
from tests.deployments.openai_server import BASE, PROMPT, PROMPT_IDS, assert_still_serving, words


@pytest.fixture(scope="module")
def log_softmax(tiny_bundle):
    """The target's log-probabilities at every position of a token sequence (a direct forward)."""
    import torch

    from actors.target.model import ForwardBatch

    model = load_model(f"{tiny_bundle}/target")

    def rows(tokens: list[int]):
        with torch.no_grad():
            logits, _ = model(ForwardBatch.from_lists([0], [tokens], "all"), model.new_cache(256))
        return torch.log_softmax(logits.float(), -1).numpy()

    return rows


def test_completion_logprobs_and_echo_are_the_targets(client, reference, log_softmax):
    """logprobs=k: each token's log-probability and k alternatives, equal to a direct forward of
    the target; echo with max_tokens 0 (how scoring clients such as lm-eval ask) returns the
    prompt and its tokens' log-probabilities, the first null."""
    out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    rows = log_softmax([*PROMPT_IDS, *reference])
    assert len(lp.token_logprobs) == 12 and all(len(t) == 2 for t in lp.top_logprobs)
    for t, (got, tok) in enumerate(zip(lp.token_logprobs, reference, strict=True)):
        assert got == pytest.approx(float(rows[len(PROMPT_IDS) - 1 + t][tok]), abs=1e-4)
        assert max(lp.top_logprobs[t].values()) == pytest.approx(got, abs=1e-6)  # greedy: the best token
    assert "".join(lp.tokens).strip() == out.choices[0].text.strip()
    score = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = score.choices[0]
    assert c.text == PROMPT and score.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.token_logprobs) == len(PROMPT_IDS)
    for q in range(1, len(PROMPT_IDS)):
        assert c.logprobs.token_logprobs[q] == pytest.approx(float(rows[q - 1][PROMPT_IDS[q]]), abs=1e-4)
    both = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    assert len(both.choices[0].logprobs.token_logprobs) == len(PROMPT_IDS) + 1
    assert both.choices[0].text.startswith(PROMPT)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=2, echo=True, stream=True)
    assert_still_serving(client)


def test_chat_logprobs_and_streamed_logprobs_match(client):
    messages = [{"role": "user", "content": "w9 w10 w11"}]
    out = client.chat.completions.create(model="dcut-demo", max_tokens=6, temperature=0, messages=messages,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == out.choices[0].message.content
    streamed = [c for ch in client.chat.completions.create(model="dcut-demo", max_tokens=6, temperature=0,
                                                            messages=messages, logprobs=True, top_logprobs=3,
                                                            stream=True)
                if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    # Tokens equal exactly; log-probabilities to float precision: each row comes from the step's
    # one forward, whose batch (kept drafts, the drafter kind chosen) may differ between requests.
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.completions.create(model="dcut-demo", prompt="w5 w6", max_tokens=5, temperature=0, logprobs=1)
    chunks = list(client.completions.create(model="dcut-demo", prompt="w5 w6", max_tokens=5, temperature=0,
                                            logprobs=1, stream=True))
    assert [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] \
        == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="dcut-demo", max_tokens=2, messages=messages, top_logprobs=2)


def test_n_choices_each_seeded_from_the_request_and_best_of(client, reference):
    body = dict(model="dcut-demo", prompt="w1 w2", max_tokens=8, temperature=1.5, seed=5)
    three = client.completions.create(n=3, **body)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.prompt_tokens == 2 and three.usage.completion_tokens == sum(
        len(d["token_ids"]) for d in three.model_extra["dcut"])
    again = client.completions.create(n=3, **body)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]  # a seed reproduces every choice
    assert len({c.text for c in three.choices}) > 1  # and each choice has its own seed
    assert client.completions.create(**body).choices[0].text == three.choices[0].text  # choice 0: the request's
    scored = client.completions.create(n=3, logprobs=0, **body)
    sums = [sum(c.logprobs.token_logprobs) for c in scored.choices]
    top = client.completions.create(n=1, best_of=3, **body)
    assert len(top.choices) == 1 and top.choices[0].logprobs is None
    assert top.choices[0].text == scored.choices[sums.index(max(sums))].text
    greedy = client.chat.completions.create(model="dcut-demo", n=2, max_tokens=12, temperature=0,
                                            messages=[{"role": "user", "content": PROMPT}])
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="n: 1 prompts × 17 choices"):
        client.completions.create(n=17, **body)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=2, best_of=1, **body)
    assert_still_serving(client)


def test_several_prompts_and_choices_stream_with_their_index(client, reference):
    prompts = [PROMPT_IDS, [9, 10, 11]]
    whole = client.completions.create(model="dcut-demo", prompt=prompts, max_tokens=12, temperature=0, n=2)
    chunks = list(client.completions.create(model="dcut-demo", prompt=prompts, max_tokens=12, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    text = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)}
    assert [text[i] for i in range(4)] == [c.text for c in whole.choices]
    assert text[0].strip() == text[1].strip() == words(reference)
    finish = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finish) == [0, 1, 2, 3]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(PROMPT_IDS) + 3


def test_chat_prompt_is_the_models_own_template(client, tiny_bundle):
    from tokenizers import Tokenizer

    from deployments.chat_template import ChatTemplate

    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w9 w10 w11"}]
    out = client.chat.completions.create(model="dcut-demo", max_tokens=2, messages=messages)
    rendered = ChatTemplate.load(tiny_bundle).render(messages)
    assert out.usage.prompt_tokens == len(Tokenizer.from_file(f"{tiny_bundle}/tokenizer.json").encode(rendered).ids)


def test_sampling_controls_shape_the_output(client, reference):
    """logit_bias, penalties and stop token ids act on the served output (their exactness under
    speculation is tested at the engine: tests/actors/test_engine.py)."""
    body = dict(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0)
    forced = client.completions.create(logit_bias={"7": 100}, **body)
    assert forced.model_extra["dcut"][0]["token_ids"] == [7] * 12
    banned = client.completions.create(logit_bias={str(t): -100 for t in set(reference)}, **body)
    assert not set(banned.model_extra["dcut"][0]["token_ids"]) & set(reference)
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **body)
    ids = penalised.model_extra["dcut"][0]["token_ids"]
    assert ids != reference and max(ids.count(t) for t in ids) < max(reference.count(t) for t in reference)
    stop = reference[3]
    stopped = client.completions.create(extra_body={"stop_token_ids": [stop]}, **body)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.model_extra["dcut"][0]["token_ids"] == reference[:reference.index(stop) + 1]
    late = client.completions.create(extra_body={"stop_token_ids": [stop], "min_tokens": 10}, **body)
    assert len(late.model_extra["dcut"][0]["token_ids"]) >= 10
    sampled = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                        extra_body={"top_k": 2, "min_p": 0.05, "repetition_penalty": 1.3})
    assert sampled.usage.completion_tokens == 6
    assert_still_serving(client)


def test_structured_output_parses_and_bad_constraints_are_400s(server):
    demo = openai.OpenAI(base_url=f"{BASE}/demo/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "size": {"type": "integer"}},
              "required": ["name", "size"], "additionalProperties": False}
    out = demo.chat.completions.create(model="dcut-demo", max_tokens=48, temperature=0,
                                       messages=[{"role": "user", "content": "config = "}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "cfg", "schema": schema}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert set(json.loads(out.choices[0].message.content)) == {"name", "size"}
    regex = demo.completions.create(model="dcut-demo", prompt="def ", max_tokens=24, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r"[a-z_]{1,10}\(\)"}})
    assert re.fullmatch(r"[a-z_]{1,10}\(\)", regex.choices[0].text)
    choice = demo.completions.create(model="dcut-demo", prompt="import ", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["os", "sys"]}})
    assert choice.choices[0].text in ("os", "sys")
    for bad, field in (({"structured_outputs": {"regex": "[a-z"}}, "structured output"),
                       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
                       ({"response_format": {"type": "json_schema"}}, "json_schema"),
                       ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos")):
        with pytest.raises(openai.BadRequestError, match=field):
            demo.completions.create(model="dcut-demo", prompt="x = ", max_tokens=8, extra_body=bad)
    assert demo.completions.create(model="dcut-demo", prompt="x = ", max_tokens=2).usage.completion_tokens == 2
    health = httpx.get(f"{BASE}/demo/health", timeout=10)  # the refused constraints left the engine serving
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def drafts_by_kind() -> dict[tuple[str, str], float]:
    text = httpx.get(f"{BASE}/metrics", timeout=30).text
    return {(k, o): float(v) for k, o, v in
            re.findall(r'^dcut_engine_drafter_drafts\{drafter="(\w+)",outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_a_request_names_the_drafters_it_may_use(client, reference):
    """The `drafter` extension: the main app hosts block, MTP, EAGLE-3 and n-gram drafters; a request that
    names one drafts only with it (the per-kind counters of /metrics move for it alone), with
    the same output; a kind the server does not host, or no kind, is a 400 naming the field.
    Whether a request drafts at all is the gate's call from measured costs (on a loaded moment it
    may draft nothing for four short requests), so the round is repeated, up to three times,
    until some request has drafted: the property is checked on every request either way."""
    moved_any = set()
    for _ in range(3):
        for kinds in (["mtp"], ["ngram"], "block", ["eagle3"]):
            before = drafts_by_kind()
            out = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                            extra_body={"drafter": kinds})
            assert out.choices[0].text.strip() == words(reference)
            after = drafts_by_kind()
            moved = {k for k in ("block", "mtp", "eagle3", "ngram") if after[(k, "chosen")] > before[(k, "chosen")]}
            assert moved <= set([kinds] if isinstance(kinds, str) else kinds), (kinds, moved)
            moved_any |= moved
        if moved_any:
            break
    assert moved_any, "no request drafted: the test would pass without speculation"  # it did speculate
    both = client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"drafter": ["block", "ngram"]})
    assert both.choices[0].text.strip() == words(reference)
    for bad in ("eagle", [], ["mtp", 3]):
        with pytest.raises(openai.BadRequestError, match="drafter"):
            client.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=4, extra_body={"drafter": bad})
    guarded = openai.OpenAI(base_url=f"{BASE}/guarded/v1", api_key="sekret", max_retries=0)
    for unserved in ("mtp", "eagle3"):
        with pytest.raises(openai.BadRequestError, match="drafts with ngram"):
            guarded.completions.create(model="dcut-demo", prompt=PROMPT, max_tokens=4, extra_body={"drafter": unserved})
    assert_still_serving(client)


def _shapes(first: int) -> list[tuple[str, dict]]:
    """Requests whose every choice may end on its first generated token (or has none to make),
    as lm-eval, a classifier or a stop list sends them: prompts × choices, streamed or not."""
    ids = [PROMPT_IDS, [9, 10, 11, 9], [3, 4, 3, 4, 3], [20, 21, 22]]
    base = {"model": "dcut-demo", "temperature": 0}
    return [
        ("completions", base | {"prompt": ids, "max_tokens": 1}),
        ("completions", base | {"prompt": ids, "max_tokens": 1, "stream": True}),
        ("completions", base | {"prompt": PROMPT, "max_tokens": 1, "n": 4}),
        ("completions", base | {"prompt": PROMPT, "max_tokens": 1, "n": 3, "stream": True}),
        ("completions", base | {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}),  # lm-eval, batch 4
        ("completions", base | {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1}),
        ("completions", base | {"prompt": PROMPT, "max_tokens": 8, "n": 3, "stop_token_ids": [first]}),
        ("completions", base | {"prompt": PROMPT, "max_tokens": 8, "n": 2, "stop": [words([first])],
                                "stream": True}),
        ("completions", base | {"prompt": ids[:2], "max_tokens": 2, "n": 2, "stop_token_ids": [first]}),
        ("chat/completions", base | {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 1,
                                     "n": 3}),
        ("chat/completions", base | {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 1,
                                     "n": 2, "stream": True}),
    ]


def test_every_request_shape_gets_its_answer(server, client, reference):
    """No request waits forever: each shape several times, each answered within seconds with
    every choice finished (the hang: a choice finishing on its first token while another choice
    of the same request arrived during that step)."""
    shapes = _shapes(reference[0])
    with httpx.Client(timeout=30) as http:
        for _ in range(4):
            for path, body in shapes:
                if body.get("stream"):
                    with http.stream("POST", f"{BASE}/v1/{path}", json=body) as r:
                        assert r.status_code == 200, (body, r.read())
                        events = [json.loads(e[6:]) for e in r.read().decode().split("\n\n")
                                  if e.startswith("data: {")]
                    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
                    choices = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
                else:
                    r = http.post(f"{BASE}/v1/{path}", json=body)
                    assert r.status_code == 200, (body, r.text)
                    out = r.json()
                    finished = {c["index"] for c in out["choices"] if c["finish_reason"]}
                    choices = len(out["choices"])
                    assert choices == body.get("n", 1) * (len(body["prompt"]) if "prompt" in body and
                                                          isinstance(body["prompt"], list) else 1)
                assert finished == set(range(choices)), body
    assert_still_serving(client)


def test_continuous_usage_stats_in_every_chunk_and_consistent_with_the_final_usage(server):
    """guidellm's default stream: usage in every chunk, cumulative per choice, ending where the
    final usage chunk does; a non-boolean is refused (strict types) and the server keeps serving."""
    body = {"model": "dcut-demo", "prompt": PROMPT, "max_tokens": 9, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(e[6:]) for e in r.read().decode().split("\n\n") if e.startswith("data: {")]
    content, final = [e for e in events if e["choices"]], events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 9
    done = [e["usage"]["completion_tokens"] for e in content]
    assert all(e["usage"]["prompt_tokens"] == 7 for e in content)
    assert done == sorted(done) and done[-1] == 9 and done[0] >= 1
    assert all(e["usage"]["total_tokens"] == 7 + e["usage"]["completion_tokens"] for e in content)
    for bad in (0, 1, "true"):
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": bad}
        r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "continuous_usage_stats" in r.text
