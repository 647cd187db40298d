"""One typed error model for every endpoint (DESIGN §8): HTTP status + stable code + retryable,
rendered as an OpenAI-style body. Nothing else reaches a client: no tracebacks, no engine text."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import metrics as M

log = logging.getLogger("flexlb.errors")


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    retryable: bool


KINDS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(400, "invalid_request_error", False),
    "unauthorized": ErrorKind(401, "authentication_error", False),
    "not_found": ErrorKind(404, "invalid_request_error", False),
    "model_not_found": ErrorKind(404, "invalid_request_error", False),
    "duplicate_request": ErrorKind(409, "invalid_request_error", False),
    "rate_limited": ErrorKind(429, "rate_limit_error", True),
    "overloaded": ErrorKind(429, "rate_limit_error", True),
    "slo_unattainable": ErrorKind(429, "rate_limit_error", True),
    "no_worker": ErrorKind(503, "service_unavailable", True),
    "state_unavailable": ErrorKind(503, "service_unavailable", True),
    "draining": ErrorKind(503, "service_unavailable", True),
    "worker_error": ErrorKind(502, "server_error", True),
    "deadline_exceeded": ErrorKind(504, "timeout_error", True),
    "cancelled": ErrorKind(499, "cancelled", False),
    "internal": ErrorKind(500, "server_error", True),
}
for _code in KINDS:  # bounded, pre-registered label values (DESIGN §9)
    M.REJECTIONS.labels(_code)


class ApiError(Exception):
    def __init__(self, code: str, message: str, *, retry_after_s: float | None = None) -> None:
        if code not in KINDS:
            code = "internal"
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return KINDS[self.code].status

    def body(self) -> dict[str, dict[str, object]]:
        k = KINDS[self.code]
        return {
            "error": {"message": self.message, "type": k.type, "code": self.code, "retryable": k.retryable}
        }

    def response(self) -> JSONResponse:
        M.REJECTIONS.labels(self.code).inc()  # every error status a client gets goes through here
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid"))
        return ApiError("invalid_request", msg).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "invalid_request"}.get(
            exc.status_code, "internal"
        )
        err = ApiError(code, str(exc.detail))
        resp = err.response()
        resp.status_code = exc.status_code
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError("internal", "internal error").response()
