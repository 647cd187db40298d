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
from app.gateway.errors import ApiError

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


#: Paths whose POSTs run a generation: the ones the per-replica cap and the tenant buckets count.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/generate")
#: Priority classes, lowest first (`x-flexlb-priority`), and the share of the replica's cap each
#: may fill: under overload the lower classes are refused first, and `system` always has room
#: the others cannot take.
PRIORITIES = ("bulk", "default", "interactive", "system")
CAP_SHARE = {"bulk": 0.5, "default": 0.8, "interactive": 0.95, "system": 1.0}
#: What a caller may ask for when no tenant grants more (FLEXLB_AUTH=none, or the tenant default).
DEFAULT_MAX_PRIORITY = "interactive"


def ask_priority(state: dict[str, Any], asked: str | int) -> None:
    """A class asked for in the body (`/v1/generate`'s `priority`: a class name, or its level
    0-3 with anything beyond clamped), where the header's was settled before the body was read.
    Clamped to what the caller may ask for, like the header. A lower class than the cap admitted
    this request under must also fit its own share of the cap (the body came too late to be
    refused at the door): else 429 `overloaded`."""
    if isinstance(asked, int):
        asked = PRIORITIES[min(max(asked, 0), len(PRIORITIES) - 1)]
    top = state.get("max_priority", DEFAULT_MAX_PRIORITY)
    cls = PRIORITIES[min(PRIORITIES.index(asked), PRIORITIES.index(top))]
    room = state.get("cap_room")
    if room is not None and not room(cls):
        raise ApiError(
            "overloaded", f"this replica is past the share of its cap class {cls!r} may fill", retry_after_s=1
        )
    state["priority"] = cls


def _header(scope: Any, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return str(v.decode("latin-1"))
    return None


class ConcurrencyCap:
    """At most `limit` generation requests in flight on this replica (a stream counts until its last
    byte); past it 429 `overloaded` with `Retry-After: 1` before the body is read, so an overloaded
    replica spends nothing on work it cannot start. 0 turns the cap off.

    Each priority class may fill its share of the cap (`CAP_SHARE`): the class comes from
    `x-flexlb-priority`, clamped to what the caller may ask for (`state["max_priority"]`, set by
    the tenant gate from the tenant's limits), and is left in `state["priority"]`."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0
        self._limits = {c: max(1, int(limit * share)) for c, share in CAP_SHARE.items()}

    def _room(self, cls: str) -> bool:
        """Whether the requests in flight, the asking one among them, fit `cls`'s share."""
        return self.limit <= 0 or self.in_flight <= self._limits[cls]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        header = _header(scope, b"x-flexlb-priority")
        asked = "default" if header is None else header  # present but empty is a bad value
        if asked not in CAP_SHARE:
            msg = f"x-flexlb-priority: must be one of {', '.join(PRIORITIES)}"
            await _send_error(send, 400, "invalid_request", "invalid_request_error", msg)
            return
        top = state.get("max_priority", DEFAULT_MAX_PRIORITY)
        cls = PRIORITIES[min(PRIORITIES.index(asked), PRIORITIES.index(top))]
        state["priority"] = cls
        state["cap_room"] = self._room  # a body's `priority` is checked against it (ask_priority)
        if self.limit > 0 and self.in_flight >= self._limits[cls]:
            await _send_error(
                send,
                429,
                "overloaded",
                "rate_limit_error",
                f"this replica has {self.in_flight} requests in flight, the most class {cls!r} may "
                "join; retry shortly or on another",
                [(b"retry-after", b"1")],
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
