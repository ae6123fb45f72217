"""The OpenAI-compatible ingress (FastAPI on Ray Serve) and the app builder.

No `from __future__ import annotations` here: FastAPI must see real annotations on the routes.

    serve run deployments.app:build_app model_root=models/demo policy=dcut

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream as SSE ending with
`data: [DONE]`), GET /v1/models, GET /health (the engine's step loop: 200 or 503), GET /metrics
(Prometheus text format), GET /openapi.json (with the request schemas).

Everything a client sends is validated here, once, into a `GenerateRequest`; the engine answers
with `Delta`s or an `EngineError` value, mapped to HTTP by one table (deployments/errors.py).
"""


import asyncio
import dataclasses
import hmac
import json
import logging
import pathlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import exceptions as ray_errors
from ray import serve
from ray.serve.handle import DeploymentHandle
from tokenizers import Tokenizer

from actors.engine.api import Delta, EngineError, GenerateRequest
from actors.engine.sequence import SamplingParams, choice_seed
from dcut_core.pruning import policy_from_name
from deployments.bundle import Bundle
from deployments.chat_template import ChatTemplate, ChatTemplateError
from deployments.engine_deployment import EngineDeployment
from deployments.errors import ApiError
from deployments.logprobs_format import LogprobFormat
from deployments.metrics import Metrics
from deployments.openai_schema import ChatRequest, CompletionRequest, Served, publish_request_bodies
from deployments.responses import best, full_response, sse
from deployments.settings import ServeSettings

log = logging.getLogger(__name__)
api = FastAPI(title="dcut", description="OpenAI-compatible speculative decoding with D-Cut")
publish_request_bodies(api, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest})

# The engine replica went away under a request (Serve replaces it): resubmit the request.
ENGINE_GONE = (ray_errors.RayActorError,)  # ActorDiedError and ActorUnavailableError among them
RESUBMITS = 2
HEALTH_TIMEOUT_S = 5.0


# Everything the routes use must be defined above the class: serve.ingress captures the routes
# (and the module globals they see) when the class is created.
def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


@serve.deployment(name="ingress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, settings: ServeSettings) -> None:
        self.engine = engine
        self.settings = settings
        bundle = Bundle(pathlib.Path(settings.model_root))
        self.tokenizer = Tokenizer.from_file(bundle.tokenizer)
        self.chat_template = ChatTemplate.load(bundle.root)  # beside tokenizer.json; None: chat is refused
        self.logprobs = LogprobFormat(self.tokenizer)
        self.metrics = Metrics()
        drafts = policy_from_name(settings.policy, settings.block).drafts
        self._served_kinds = bundle.kinds(settings.drafter) if drafts else ()  # what a request's `drafter` may name
        api.state.served = Served((settings.model_name,), settings.max_tokens_limit, settings.max_choices,
                                  settings.max_stop, self.tokenizer.get_vocab_size(),
                                  self._served_kinds)  # what /openapi.json says
        api.openapi_schema = None

    # -- endpoints --------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self):
        """The engine's step loop, as its replica reports it (one replica, when there are several)."""
        try:
            h = await asyncio.wait_for(self.engine.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # no replica answered: that is the truth to tell
            return JSONResponse({"status": "unhealthy", "reason": f"the engine did not answer ({type(exc).__name__})"},
                                503)
        body = {"status": "ok" if h.ok else "unhealthy", "reason": h.reason, "in_flight": h.in_flight,
                "steps": h.steps, "idle_s": round(h.idle_s, 3)}
        return JSONResponse(body, 200 if h.ok else 503)

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except ApiError as e:
            return e.response()
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "dcut"}]}

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics(self) -> Response:
        """Prometheus text format."""
        stats = await self.engine.stats.remote()
        return Response(self.metrics.render(stats), media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve(request, ChatRequest, chat=True)

    # -- shared path ------------------------------------------------------------------------------

    async def _serve(self, request: Request, schema, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            self._authorize(request)
            body = await self._parse(request, schema)
            prompts = [self._chat_prompt(body.messages)] if chat else body.prompts()
            ids, params = self._validate(body, prompts)
            n, best_of = body.n, getattr(body, "best_of", None) or body.n
            if len(ids) * best_of > self.settings.max_choices:
                raise ApiError(400, f"n: {len(ids)} prompts × {best_of} choices each is above the limit of "
                                    f"{self.settings.max_choices} choices per request", param="n")
            if best_of > n and body.stream:
                raise ApiError(400, "best_of above n is not supported with stream", param="best_of")
            if best_of > n:  # rank candidates by their log-probability: every one needs it
                params = dataclasses.replace(params, logprobs=params.logprobs or 0)
            # Choice index = prompt × n + j; each choice of a prompt has its own seed from the request's.
            runs = [(i * n + j, i, dataclasses.replace(params, seed=choice_seed(params.seed, j)))
                    for i in range(len(ids)) for j in range(best_of)]
            if body.stream:
                if not chat and body.echo:
                    raise ApiError(400, "echo is not supported with stream", param="echo")
                streams = [(index, self._deltas(ids[i], p)) for index, i, p in runs]
                waits = [asyncio.ensure_future(self._first(st)) for _, st in streams]
                try:  # errors before the first token surface as HTTP status, not mid-stream
                    firsts = await asyncio.gather(*waits)
                except BaseException:
                    # The other choices' first tokens are still being awaited: stop them before
                    # closing their streams (closing a running generator raises RuntimeError,
                    # which had turned one choice's 400 into a 500).
                    for w in waits:
                        w.cancel()
                    await asyncio.gather(*waits, return_exceptions=True)
                    for _, st in streams:
                        await st.aclose()
                    raise
                self.metrics.request(endpoint, 200)
                events = sse(streams, firsts, body, chat, sum(len(i) for i in ids), self.logprobs, self.metrics)
                return StreamingResponse(events, media_type="text/event-stream")
            results = await asyncio.gather(*(self._collect(self._deltas(ids[i], p)) for _, i, p in runs))
            for r, (_, i, _) in zip(results, runs, strict=True):
                r["prompt"] = prompts[i] if isinstance(prompts[i], str) else self.tokenizer.decode(ids[i])
                r["prompt_ids"] = ids[i]
            if best_of > n:
                results = [r for i in range(len(ids)) for r in best(results[i * best_of:(i + 1) * best_of], n)]
            self.metrics.request(endpoint, 200)
            return full_response(body, chat, results, self.logprobs, self.metrics)
        except ApiError as e:
            self.metrics.request(endpoint, e.status)
            return e.response()
        except Exception as exc:  # a fault of ours: this request fails alone, in OpenAI's format
            log.exception("request failed")
            self.metrics.request(endpoint, 500)
            return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @staticmethod
    def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
        """OpenAI's logit_bias (token ids as strings) as (id, bias) pairs, checked."""
        if not bias:
            return ()
        if len(bias) > 1024:
            raise ApiError(400, "logit_bias: at most 1024 tokens", param="logit_bias")
        out = []
        for key, value in bias.items():
            if not (key.isdigit() and int(key) < vocab):
                raise ApiError(400, f"logit_bias: {key[:20]!r} is not a token id in [0, {vocab})", param="logit_bias")
            if not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias: {value} for token {key} is outside [-100, 100]", param="logit_bias")
            out.append((int(key), float(value)))
        return tuple(sorted(out))

    def _chat_prompt(self, messages) -> str:
        """The conversation through the model's own chat template."""
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json): use /v1/completions",
                           param="messages")
        try:
            return self.chat_template.render([{"role": m.role, "content": m.text} for m in messages])
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):  # constant time
            raise ApiError(401, "invalid or missing API key", "authentication_error", "invalid_api_key")

    async def _parse(self, request: Request, schema):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.settings.max_body_bytes:
            raise ApiError(413, f"request body larger than {self.settings.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > self.settings.max_body_bytes:
            raise ApiError(413, f"request body larger than {self.settings.max_body_bytes} bytes")
        try:
            data = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, NaN, over-long integers, deep nesting
            raise ApiError(400, f"body is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            first = max(exc.errors(), key=lambda e: len(e["loc"]))  # of a union's branches, the deepest says most
            where = ".".join(str(p) for p in first["loc"])
            message = f"{where}: {first['msg']}" if where else first["msg"].removeprefix("Value error, ")
            raise ApiError(400, message, param=where or None) from None

    def _validate(self, body, prompts: list[str | list[int]]) -> tuple[list[list[int]], SamplingParams]:
        s = self.settings
        if body.model != s.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server has {s.model_name!r}",
                           code="model_not_found", param="model")
        ids = [self.tokenizer.encode(p).ids if isinstance(p, str) else p for p in prompts]
        if not prompts or any(not i or (isinstance(p, str) and not p.strip()) for p, i in zip(prompts, ids,
                                                                                             strict=True)):
            raise ApiError(400, "prompt must not be empty", param="prompt")
        vocab = self.tokenizer.get_vocab_size()
        if any(t < 0 or t >= vocab for i in ids for t in i):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        if max(len(i) for i in ids) > s.max_prompt_tokens:
            raise ApiError(400, f"prompt has {max(len(i) for i in ids)} tokens; the limit is {s.max_prompt_tokens}",
                           code="context_length_exceeded", param="prompt")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                          min(64, s.max_tokens_limit))
        if max_tokens > s.max_tokens_limit:
            raise ApiError(400, f"max_tokens {max_tokens} is above the limit {s.max_tokens_limit}",
                           param="max_tokens")
        echo = getattr(body, "echo", False)
        if max_tokens == 0 and not echo:
            raise ApiError(400, "max_tokens 0 needs echo (it scores the prompt)", param="max_tokens")
        stops = body.stops()
        if len(stops) > s.max_stop or any(not x for x in stops):
            raise ApiError(400, f"at most {s.max_stop} non-empty stop strings", param="stop")
        bias = self._logit_bias(body.logit_bias, vocab)
        stop_ids = tuple(body.stop_token_ids or ())
        if len(stop_ids) > 64 or any(not 0 <= t < vocab for t in stop_ids):
            raise ApiError(400, f"stop_token_ids: at most 64 ids in [0, {vocab})", param="stop_token_ids")
        if body.min_tokens > max_tokens:
            raise ApiError(400, "min_tokens: must not exceed max_tokens", param="min_tokens")
        try:
            constraint = body.constraint()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="response_format") from None
        if constraint is not None and body.ignore_eos:
            raise ApiError(400, "ignore_eos: cannot be combined with structured output (a complete output ends "
                                "with EOS)", param="ignore_eos")
        try:
            k = body.token_logprobs()
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                    seed=body.seed, stop=stops, ignore_eos=body.ignore_eos, logprobs=k,
                                    prompt_logprobs=k if echo and k is not None else None,
                                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                    repetition_penalty=body.repetition_penalty, top_k=max(0, body.top_k),
                                    min_p=body.min_p, logit_bias=bias, stop_token_ids=stop_ids,
                                    min_tokens=body.min_tokens, constraint=constraint,
                                    drafters=self._drafters(body.drafter))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return ids, params

    def _drafters(self, asked: str | list[str] | None) -> tuple[str, ...] | None:
        """The drafter kinds a request allows, checked against those served (a 400 otherwise)."""
        if asked is None:
            return None
        kinds = tuple(dict.fromkeys([asked] if isinstance(asked, str) else asked))
        served = self._served_kinds
        if not kinds or not set(kinds) <= set(served):
            raise ApiError(400, f"drafter: this server drafts with {', '.join(served) or 'no drafter'}",
                           param="drafter")
        return kinds

    async def _deltas(self, prompt: list[int], params: SamplingParams):
        """Deltas of one request; an `EngineError` becomes an `ApiError`. If the engine unit dies
        under it, the request is resubmitted as its prompt plus the tokens already produced (at
        most twice): the client sees one stream."""
        produced: list[int] = []
        for attempt in range(RESUBMITS + 1):
            if params.max_tokens and len(produced) >= params.max_tokens:  # it died after its last token
                yield Delta("", [], True, "length", len(prompt), len(produced))
                return
            stream = self.engine.options(stream=True).generate.remote(GenerateRequest(prompt, params, produced))
            try:
                async for item in stream:
                    if isinstance(item, EngineError):
                        raise ApiError.of(item)
                    produced += item.token_ids
                    yield item
                    if item.finished:
                        return
                return
            except ENGINE_GONE as exc:
                if attempt == RESUBMITS:
                    raise ApiError(503, "the engine failed repeatedly; retry the request", "server_error",
                                   "engine_unavailable", headers={"Retry-After": "2"}) from None
                log.warning("engine unit died mid-request (%s); resubmitting with %d tokens done",
                            type(exc).__name__, len(produced))
            finally:
                stream.cancel()

    async def _first(self, stream) -> Delta:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the stream without output", "server_error") from None

    async def _collect(self, stream) -> dict:
        text, tokens, logprobs, prompt_logprobs, last = [], [], [], None, None
        async for d in stream:
            text.append(d.text)
            tokens += d.token_ids
            logprobs += d.logprobs if d.logprobs is not None else [None] * len(d.token_ids)
            prompt_logprobs = prompt_logprobs or d.prompt_logprobs
            last = d
        if last is None:
            raise ApiError(500, "the engine ended the stream without output", "server_error")
        return {"text": "".join(text), "token_ids": tokens, "finish_reason": last.finish_reason,
                "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "steps": last.steps, "accepted": last.accepted, "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs}

def build_app(args: ServeSettings) -> serve.Application:
    """App builder for `serve run` / `serve deploy` and `dcut serve`: typed settings in."""
    settings = (args if isinstance(args, ServeSettings) else ServeSettings(**args)).resolved()
    # One engine replica = one placement group holding its coordinator, EP ranks and drafters.
    layout = settings.unit_layout()
    deployment = EngineDeployment.options(placement_group_bundles=layout.bundles(),
                                          placement_group_strategy=settings.unit_strategy,
                                          ray_actor_options={"num_cpus": layout.coordinator["CPU"],
                                                             "num_gpus": layout.coordinator.get("GPU", 0)},
                                          health_check_period_s=settings.health_check_period_s,
                                          health_check_timeout_s=max(30.0, settings.health_check_period_s),
                                          graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s)
    if settings.engine_autoscaling:
        deployment = deployment.options(autoscaling_config=settings.engine_autoscaling, num_replicas="auto")
    engine = deployment.bind(settings)
    return Ingress.options(num_replicas=settings.ingress_replicas).bind(engine, settings)
