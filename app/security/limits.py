"""Input limits enforced before any work (issue 16): a request body larger than the limit is refused
while it streams in, a replica past its concurrency cap answers 429 at once, and ids that become
parts of Redis keys or log lines are checked.

Both limits are plain ASGI middleware, outside FastAPI's routing: FastAPI reads a JSON body whole
(`await request.body()`) before validation, so a limit inside a route would come after the memory
was spent. Here the body is counted chunk by chunk as uvicorn delivers it (uvicorn pauses reading
the socket while ~64 KiB wait unread), so a 10 MiB upload costs the server at most the limit.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from app import metrics as M

#: A request id, from the body, `X-Request-Id` or a URL path: it becomes part of Redis keys
#: (`{q:<id>}` is a hash tag, so a brace would move the key to another slot) and of log lines.
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
REQUEST_ID_RULE = "request id must be 1-128 characters of A-Z a-z 0-9 . _ : -"
#: W3C trace context: version-traceid-parentid-flags, lower-case hex; an all-zero id is invalid.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_ZERO_TRACE = "0" * 32

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def valid_request_id(rid: str) -> bool:
    return bool(REQUEST_ID.match(rid))


def trace_id_from(traceparent: str | None) -> str:
    """The trace id of a valid `traceparent`, else a fresh one: a malformed header is ignored (as
    the W3C spec asks a receiver to do), never copied into logs."""
    m = _TRACEPARENT.match((traceparent or "").strip())
    if m and m.group(1) != _ZERO_TRACE:
        return m.group(1)
    return uuid.uuid4().hex


def _error_body(code: str, kind: str, message: str) -> bytes:
    retryable = code != "request_too_large"
    err = {"message": message, "type": kind, "code": code, "retryable": retryable}
    return json.dumps({"error": err}).encode()


async def _send_error(
    send: Any, status: int, code: str, kind: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = _error_body(code, kind, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    # The unread rest of the body stays on the socket: the connection cannot be reused.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
    M.REJECTIONS.labels(code).inc()


class _TooLarge(BaseException):
    """Raised from the counted `receive` when the body passes the limit. A BaseException on
    purpose: FastAPI turns any Exception raised while it reads the body into a 400 ("error parsing
    the body"); this must reach `BodyLimit` instead, and nothing between catches BaseException."""


class BodyLimit:
    """413 `request_too_large` for a body over `limit` bytes: at once from `Content-Length`, else
    as soon as the streamed count (chunked uploads) passes it — before the body is read whole."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS or self.limit <= 0:
            await self.app(scope, receive, send)
            return
        message = f"request body exceeds {self.limit} bytes"
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.limit:
                    await _send_error(send, 413, "request_too_large", "invalid_request_error", message)
                    return
        seen = 0
        started = False

        async def counted() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        async def watched_send(msg: Any) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted, watched_send)
        except _TooLarge:
            if started:  # the app answered before reading the whole body; nothing more to say
                return
            await _send_error(send, 413, "request_too_large", "invalid_request_error", message)


#: Paths whose POSTs run a generation: the ones the per-replica cap counts.
_CAPPED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/generate")


class ConcurrencyCap:
    """At most `limit` generation requests in flight on this replica (a stream counts until its last
    byte); the next one gets 429 `overloaded` with `Retry-After: 1` before its body is read, so
    an overloaded replica spends nothing on work it cannot start. 0 turns the cap off."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            self.limit <= 0
            or scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith(_CAPPED_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await _send_error(
                send,
                429,
                "overloaded",
                "rate_limit_error",
                f"this replica has {self.limit} requests in flight; retry shortly or on another",
                [(b"retry-after", b"1")],
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
