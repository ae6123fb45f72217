"""OpenAI-compatible request and response bodies (the subset we serve), and error bodies."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from actors.drafter import KINDS

# Strict scalars: a JSON true is not the integer 1, "0.5" is not a number, 2.5 is not an integer
# (ints are still numbers). 8.0 is the integer 8, as JSON Schema's "integer" says (schema-driven
# clients send it so). Any integer size is accepted; the range checks say what fits.


def _integral(value):
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral)]


def _unicode(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800); they are not text, and a tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
DrafterKind = Literal[KINDS]  # one of actors.drafter.KINDS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = Field(False, description="with include_usage: every chunk also carries its "
                                                                  "choice's usage so far (vLLM's extension)")

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


# OpenAI fields this server does not implement yet: accepted at their neutral value (what a
# client sends when it does not use the feature), refused with a 400 naming the field otherwise.
# A field in neither this table nor the schema is refused too: nothing a client sends is ignored.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text = "response"
    description: Text | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: given exactly when type is json_schema")
        return self


class StructuredOutputs(BaseModel):
    """Extension (vLLM's field): one constraint on the output."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | Text | None = Field(None, alias="json", description="a JSON schema")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = Field(None, description="a Lark grammar (llguidance's dialect)")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar")
        return self


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 that names it, never ignored

    model: str
    max_tokens: Int | None = Field(None, ge=0, description="0 only with echo (score the prompt)")
    max_completion_tokens: Int | None = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    seed: Int | None = Field(None, description="any integer; the same seed reproduces a sampled output")
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, ge=1, description="choices per prompt, each with its own seed from the request's")
    user: str | None = None
    ignore_eos: StrictBool = Field(False, description="extension: generate max_tokens tokens, past the EOS token")
    # Controls on the target's distribution, applied before verification (speculation stays exact).
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat] | None = Field(None, description="token id (as a string) -> bias in "
                                                                        "[-100, 100], added to its logit")
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, le=10.0, description="extension (vLLM's)")
    top_k: Int = Field(0, ge=-1, le=2**31 - 1, description="extension: sample among the k most likely "
                                                                  "(0 or -1: all)")
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0, description="extension: drop tokens below min_p × the top one")
    min_tokens: Int = Field(0, ge=0, description="extension: no EOS, stop token or stop string before this")
    stop_token_ids: list[Int] | None = Field(None, description="extension: finish after any of these tokens")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    drafter: DrafterKind | list[DrafterKind] | None = Field(
        None, description="extension: the drafter kind(s) this request may draft with (default: any the server "
                          "hosts, chosen per step); output is the same whatever drafts")

    def constraint(self) -> tuple[str, str] | None:
        """The output's constraint as (kind, spec) for the engine, or None."""
        import json

        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise ValueError("response_format and structured_outputs: give one")
        if rf is not None and rf.type == "json_object":
            return "json_object", ""
        if rf is not None and rf.type == "json_schema":
            return "json_schema", json.dumps(rf.json_schema.schema_ or {})
        if so is None:
            return None
        if so.json_ is not None:
            return "json_schema", so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        if so.regex is not None:
            return "regex", so.regex
        if so.choice is not None:
            return "choice", json.dumps(so.choice)
        return "lark", so.grammar

    @model_validator(mode="before")
    @classmethod
    def _not_implemented(cls, data):
        """Drop not-yet-implemented OpenAI fields at their neutral value; refuse any other value."""
        if isinstance(data, dict):
            for name in NOT_IMPLEMENTED.keys() & data.keys():
                value = data[name]
                neutral = (value == n and isinstance(value, bool) == isinstance(n, bool) for n in NOT_IMPLEMENTED[name])
                if not any(neutral):
                    raise ValueError(f"{name}: not supported by this server yet (got {str(value)[:60]})")
            data = {k: v for k, v in data.items() if k not in NOT_IMPLEMENTED}
        return data

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Common):
    # Text, several texts, token ids (scoring clients send them), or several lists of token ids.
    prompt: Text | list[Text] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=20, description="each token's log-probability under the "
                                                                      "target and this many alternatives")
    echo: StrictBool = Field(False, description="return the prompt before the completion (with logprobs: the "
                                                "prompt tokens' log-probabilities too)")
    best_of: Int | None = Field(None, ge=1, description="generate this many per prompt, return the n of "
                                                              "highest log-probability (not with stream)")

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of: must be at least n")
        return self

    def token_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart]  # a string, or text parts as many clients send (other parts: 400)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20, description="alternatives per token (needs logprobs)")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERRORS = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
          404: "no such model", 413: "body too large", 429: "engine full: retry after Retry-After",
          503: "engine unavailable: retry after Retry-After"}


@dataclass(frozen=True)
class Served:
    """What one server enforces beyond the types, published in its /openapi.json."""

    models: tuple[str, ...]
    max_tokens: int
    max_choices: int
    max_stop: int
    vocab: int  # token ids (prompts, stop_token_ids, logit_bias keys) are in [0, vocab)
    drafters: tuple[str, ...] = ()  # the kinds a request's `drafter` may name (none: only null)


def publish_request_bodies(app, bodies: dict[str, type[BaseModel]]) -> None:
    """Declare each POST route's JSON body in the app's /openapi.json (the routes parse bodies
    themselves, to answer errors in OpenAI's format, so FastAPI cannot see them), every error
    answer in OpenAI's error schema, and — once the ingress has said what it serves
    (`app.state.served`, a `Served`) — the model names as an enum and the limits it enforces:
    clients and schema-driven testers get the spec the server really applies."""
    from fastapi.openapi.utils import get_openapi

    def build() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["ErrorResponse"] = ERROR_SCHEMA
            served = getattr(app.state, "served", None)
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = _as_enforced(body, served)
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                post = schema["paths"][path]["post"]
                post["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
                post["responses"] = {"200": {"description": "the completion, or its server-sent events when "
                                                            "streamed (text/event-stream)",
                                             "content": {"application/json": {"schema": {"type": "object"}},
                                                         "text/event-stream": {"schema": SSE_EVENT}}}}
                post["responses"] |= {str(code): {"description": why, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}} for code, why in ERRORS.items()}
            if "StructuredOutputs" in components:  # exactly one constraint that is not null
                components["StructuredOutputs"]["oneOf"] = [
                    {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                    for name in ("json", "regex", "choice", "grammar")]
            if "ChatRequest" in components:  # top_logprobs needs logprobs: true
                components["ChatRequest"] |= {
                    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
            _standard_bounds(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build


# Open API 3.1 (JSON Schema 2020-12) reads the schema of a text/event-stream body as the schema of
# each event: an object with the event's fields, `data` being a chunk as JSON or "[DONE]".
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a completion chunk (JSON), or [DONE] after the last"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(node) -> None:
    """Pydantic writes the bounds of a constrained type inside a union (`Int | None` with ge=1)
    under their Python names ("ge"); JSON Schema's are "minimum" and the like, and a tool that
    reads the spec ignores the others. Renamed in place, everywhere under `node`."""
    if isinstance(node, dict):
        if "type" in node:
            for ours, standard in BOUNDS.items():
                if ours in node:  # a bound _as_enforced set already is the one enforced
                    node.setdefault(standard, node.pop(ours))
        for value in node.values():
            _standard_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _standard_bounds(value)


def _as_enforced(body: dict, served: Served | None) -> dict:
    """A request schema with what validation enforces beyond its types: no empty prompt or stop
    string; and, for a known server, its model names, limits and vocabulary."""
    props = body["properties"]
    prompt, stop, stop_ids = props.get("prompt", {}), props["stop"], props["stop_token_ids"]
    for node in _each(prompt, "string"):
        node |= {"minLength": 1, "pattern": r"\S"}  # not blank
    for node in _each(stop, "string"):
        node["minLength"] = 1
    for node in _each(prompt, "array"):
        node["minItems"] = 1
    for node in _each(stop_ids, "array"):
        node["maxItems"] = 64
    if "echo" not in props:  # max_tokens 0 only scores a prompt (completions with echo)
        for node in _each(props["max_tokens"], "integer"):
            node["minimum"] = 1
    if served is None:
        return body
    props["model"] = {"title": "Model", "type": "string", "enum": list(served.models)}
    kinds = list(served.drafters)
    props["drafter"]["anyOf"] = [*([{"type": "string", "enum": kinds},
                                    {"type": "array", "items": {"type": "string", "enum": kinds}, "minItems": 1}]
                                   if kinds else []), {"type": "null"}]
    for name in ("max_tokens", "max_completion_tokens"):
        for node in _each(props[name], "integer"):
            node["maximum"] = served.max_tokens
    props["n"]["maximum"] = served.max_choices
    for node in _each(props.get("best_of", {}), "integer"):
        node["maximum"] = served.max_choices
    for node in _each(stop, "array"):
        node["maxItems"] = served.max_stop
    for node in [*_each(prompt, "integer"), *_each(stop_ids, "integer")]:
        node |= {"minimum": 0, "maximum": served.vocab - 1}
    for node in _each(props["logit_bias"], "object"):
        node["propertyNames"] = {"pattern": "^[0-9]+$"}
    return body


def _each(node: dict, kind: str):
    """The sub-schemas of JSON type `kind` in `node` (itself, its anyOf variants, its items)."""
    if node.get("type") == kind:
        yield node
    for variant in node.get("anyOf", ()):
        yield from _each(variant, kind)
    if isinstance(node.get("items"), dict):
        yield from _each(node["items"], kind)
