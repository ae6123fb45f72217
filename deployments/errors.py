"""HTTP errors of the API: OpenAI's error body, and the one table from an engine's error kind to
an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from actors.engine.api import EngineError, ErrorKind

# kind -> (HTTP status, OpenAI error type, code, Retry-After seconds)
ERROR_STATUS: dict[ErrorKind, tuple[int, str, str | None, str | None]] = {
    ErrorKind.INVALID: (400, "invalid_request_error", None, None),
    ErrorKind.OVERLOADED: (429, "rate_limit_error", "overloaded", "1"),
    ErrorKind.UNAVAILABLE: (503, "server_error", "engine_unavailable", "2"),
    ErrorKind.INTERNAL: (500, "server_error", None, None),
}


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """An error answered to the client: raised anywhere in the ingress, turned into a response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.headers = status, kind, code, param, headers

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, self.headers)

    @classmethod
    def of(cls, err: EngineError) -> ApiError:
        status, kind, code, retry_after = ERROR_STATUS[err.kind]
        return cls(status, err.message, kind, code, headers={"Retry-After": retry_after} if retry_after else None)
