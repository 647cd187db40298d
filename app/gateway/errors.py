"""One typed error model for every endpoint (DESIGN §8): HTTP status + stable code + retryable,
rendered as an OpenAI-style body. Nothing else reaches a client: no tracebacks, no engine text."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import metrics as M
from app.gateway.validation import validation_message

log = logging.getLogger("flexlb.errors")


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    retryable: bool


KINDS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(400, "invalid_request_error", False),
    "unsupported_media_type": ErrorKind(415, "invalid_request_error", False),
    "method_not_allowed": ErrorKind(405, "invalid_request_error", False),
    "unauthorized": ErrorKind(401, "authentication_error", False),
    "forbidden": ErrorKind(403, "permission_error", False),
    "not_found": ErrorKind(404, "invalid_request_error", False),
    "model_not_found": ErrorKind(404, "invalid_request_error", False),
    "duplicate_request": ErrorKind(409, "invalid_request_error", False),
    "request_too_large": ErrorKind(413, "invalid_request_error", False),
    "rate_limited": ErrorKind(429, "rate_limit_error", True),
    "overloaded": ErrorKind(429, "rate_limit_error", True),
    "slo_unattainable": ErrorKind(429, "rate_limit_error", True),
    "deadline_too_short": ErrorKind(400, "invalid_request_error", False),
    "no_worker": ErrorKind(503, "service_unavailable", True),
    "state_unavailable": ErrorKind(503, "service_unavailable", True),
    "draining": ErrorKind(503, "service_unavailable", True),
    # The request's origin replica died (or stalled past its membership) before it finished;
    # the master's reconciler ended it. Retrying the id starts a new attempt (retryable).
    "owner_lost": ErrorKind(503, "service_unavailable", True),
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
        retry_after = self.retry_after_s
        if retry_after is None and self.status in (429, 503):
            retry_after = 1  # every 429/503 says when to come back, wherever it was raised
        if retry_after is not None:
            headers["Retry-After"] = str(max(1, round(retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def check_token_ids(ids: list[int], vocab: int, field: str) -> None:
    """Every id in [0, vocab): one C-speed min/max, the index found only when one is out."""
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(i for i, t in enumerate(ids) if t < 0 or t >= vocab)
        raise ApiError("invalid_request", f"{field}[{bad}]: token id must be in [0, {vocab}); got {ids[bad]}")


def json_media_type(ctype: str | None) -> bool:
    """A missing content type is read as JSON (FastAPI does too); else application/json or +json."""
    if ctype is None:
        return True
    media = ctype.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


#: What Starlette's own HTTP errors become (routing: unknown path, wrong method).
HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}


def allowed_methods(request: Request, given: str = "") -> list[str]:
    """The methods the app serves at this path, for the `Allow` header of a 405: those of the
    published document's operations on the matching path template (a path may have several
    routes, e.g. GET and DELETE /v1/requests/{id}), plus what Starlette named (`given`)."""
    methods = {m.strip().upper() for m in given.split(",") if m.strip()}
    for template, item in request.app.openapi().get("paths", {}).items():
        pattern = "^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, request.url.path):
            methods |= {m.upper() for m in item}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


#: FastAPI's 400 for a body its JSON decode raised on other than a JSON syntax error (chained).
FASTAPI_UNPARSEABLE = "There was an error parsing the body"


def unparseable_body(cause: BaseException | None, encoding: str | None) -> str:
    """What was wrong with a body FastAPI could not parse, for a message a person can act on
    (FastAPI says only "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        sent = f"; content-encoding {encoding.strip()!r} is not supported" if encoding else ""
        return f"request body: not UTF-8 at byte {cause.start}{sent}; send uncompressed UTF-8 JSON"
    if isinstance(cause, RecursionError):
        return "request body: JSON nested too deeply"
    if isinstance(cause, ValueError):  # e.g. an integer literal over Python's digit limit
        return f"request body: {str(cause).split(':', 1)[0]}"  # not Python's advice after the colon
    return "request body: cannot be parsed as JSON"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A body of another content type is never parsed, so it always fails validation: it is
        # answered 415 here, at no cost to well-formed requests (no per-request check).
        ctype = request.headers.get("content-type")
        if not json_media_type(ctype):
            media = (ctype or "").split(";", 1)[0].strip()
            msg = f"content-type {media!r} is not supported; send application/json"
            return ApiError("unsupported_media_type", msg).response()
        return ApiError("invalid_request", validation_message(exc.errors(), exc.body)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "internal")
        detail = str(exc.detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110: every method the path has, not just one route's
            headers["Allow"] = ", ".join(allowed_methods(request, headers.get("Allow", "")))
            method = request.method if request.method != "OTHER" else "this method"  # see _BoundedMethod
            detail = f"{method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        elif exc.status_code == 404 and detail == "Not Found":
            detail = f"no such endpoint: {request.url.path}"
        elif exc.status_code == 400 and detail == FASTAPI_UNPARSEABLE:
            detail = unparseable_body(exc.__cause__, request.headers.get("content-encoding"))
        resp = ApiError(code, detail).response()
        resp.status_code = exc.status_code
        resp.headers.update(headers)
        return resp

    async def _redis_away(_: Request, exc: Exception) -> JSONResponse:
        # Redis not answering now (refused, timed out, still loading its data after a restart,
        # a Sentinel-demoted master): any read or write a handler makes on Redis, not only the
        # request path's (which checks `redis_ok` first), is the typed, retryable 503 of DESIGN
        # §6. It was a 500 "internal" with a traceback: `DELETE /v1/requests/{id}` during the
        # soak's Redis restart. A script or argument error is still a 500 (a bug, not an outage).
        log.warning("shared state unavailable: %r", exc)
        return ApiError("state_unavailable", f"shared state unavailable: {exc}", retry_after_s=1).response()

    for kind in (RedisConnectionError, RedisTimeoutError, ReadOnlyError):  # BusyLoading is a Connection
        app.add_exception_handler(kind, _redis_away)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError("internal", "internal error").response()
