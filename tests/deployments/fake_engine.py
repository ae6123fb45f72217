"""A fake engine deployment that speaks the real engine's typed interface (`GenerateRequest` in,
`Delta`s or an `EngineError` out), so the HTTP → handle → ingress path can be tested in seconds,
beside the tests against the real app.

Behaviour by the prompt's first token id (the tiny tokenizer: "w1" is id 1):
1 → INVALID, 2 → OVERLOADED, 3 → UNAVAILABLE, 4 → INTERNAL, before any output;
5 → one delta, then UNAVAILABLE mid-stream; anything else → the prompt echoed back, one token
per delta, up to max_tokens.
"""

from __future__ import annotations

from ray import serve

from actors.engine.api import Delta, EngineError, ErrorKind, GenerateRequest, Health

ERROR_BY_FIRST_TOKEN = {1: ErrorKind.INVALID, 2: ErrorKind.OVERLOADED, 3: ErrorKind.UNAVAILABLE,
                        4: ErrorKind.INTERNAL}


@serve.deployment(name="engine")
class FakeEngine:
    def __init__(self) -> None:
        self.health_now = Health(True)
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        kind = ERROR_BY_FIRST_TOKEN.get(request.prompt[0])
        if kind is not None:
            yield EngineError(kind, f"fake {kind.value}")
            return
        out = (request.prompt * request.params.max_tokens)[: request.params.max_tokens]
        for i, t in enumerate(out):
            if request.prompt[0] == 5 and i == 1:
                yield EngineError(ErrorKind.UNAVAILABLE, "fake failure mid-stream")
                return
            done = i == len(out) - 1
            yield Delta(f" w{t}", [t], done, "length" if done else None, len(request.prompt), i + 1, i + 1, 0)

    def stats(self) -> dict:
        return {"in_flight": 0, "steps": len(self.requests)}

    def health(self) -> Health:
        return self.health_now

    def set_health(self, ok: bool, reason: str = "") -> None:
        self.health_now = Health(ok, reason, in_flight=3, steps=7, idle_s=99.0 if not ok else 0.0)

    def last_request(self) -> GenerateRequest:
        return self.requests[-1]

    def placement(self) -> dict:
        return {}
