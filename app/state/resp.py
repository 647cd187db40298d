"""A lean, pipelined RESP2 connection for the origin's one serial round trip (DESIGN §3).

Why not redis-py here: on the 2-core benchmark VM, redis-py's asyncio client spends ~0.43 ms of
CPU on a single PING after a few milliseconds idle (pool checkout, retry wrapper, timeout
context, StreamReader hops), while the same PING over a bare `asyncio.Protocol` with the hiredis
reader costs ~0.11 ms. The origin's record + reserve + hand-off pipeline sits on every request's
critical path, so it gets this connection. Blocking stream reads on the hand-off and reply paths
(an owner's XREADGROUP, an origin's XREAD) use one of their own each, created with a timeout
longer than their BLOCK; a connection that carries a blocking read carries nothing else. The
rest keeps redis-py.

Replies are matched to requests in order (RESP guarantees it on one connection): one future per
pipeline, completed inside `data_received` once all its replies are parsed, so the waiting
coroutine resumes without another task hop. A pipeline that times out raises redis-py's
`TimeoutError` while its replies, when they come, are read and dropped; a connection that fails
or closes fails every waiter with redis-py's `ConnectionError` (callers already handle both as
"shared state unavailable") and is replaced on the next call. Error replies come back as
redis-py's `ResponseError` subclasses (e.g. `NoScriptError`, `ReadOnlyError`) in the reply list,
but for LOADING: a Redis still loading its data set refuses every command, so the pipeline fails
as a whole with redis-py's `BusyLoadingError` (a `ConnectionError`), as redis-py itself raises it
— retried as transient. As a reply in the list it was a plain `ResponseError`, which the terminal
writes' retry loop took for a script error and died on (test_faults case 5: Redis restarted from
its AOF, the replica's requests then stayed non-terminal).

A pipeline may name `on_replies`, called with its replies the moment they are parsed, whether or
not its caller still waits (cancelled, timed out): for replies that carry a hand-over which must
not be dropped with the caller (the hand-off's entries for this replica's owner, issue 20).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

import hiredis
from redis.exceptions import BusyLoadingError, NoScriptError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = Any  # bytes | str | int | float, or anything whose str() is the wire form
#: Called with a pipeline's replies as they arrive (see the module doc).
OnReplies = Callable[[list[Any]], None]

log = logging.getLogger("flexlb.state")


def encode(commands: Sequence[Sequence[Arg]]) -> bytes:
    """RESP arrays of bulk strings, every command of a pipeline in one buffer (one write)."""
    out: list[bytes] = []
    for cmd in commands:
        out.append(b"*%d\r\n" % len(cmd))
        for a in cmd:
            if isinstance(a, bytes):
                b = a
            elif isinstance(a, str):
                b = a.encode()
            elif isinstance(a, int):
                b = b"%d" % a
            elif isinstance(a, float):
                b = repr(a).encode()
            else:  # numpy scalars and the like: their text form, as redis-py's encoder does
                b = str(a).encode()
            out.append(b"$%d\r\n" % len(b))
            out.append(b)
            out.append(b"\r\n")
    return b"".join(out)


def _error(err: hiredis.ReplyError) -> ResponseError | BusyLoadingError:
    msg = str(err)
    if msg.startswith("NOSCRIPT"):
        return NoScriptError(msg)
    if msg.startswith("READONLY"):
        return ReadOnlyError(msg)
    if msg.startswith("LOADING"):
        return BusyLoadingError(msg)
    return ResponseError(msg)


class _Waiter:
    __slots__ = ("busy", "fut", "left", "on_replies", "replies")

    def __init__(self, fut: asyncio.Future[list[Any]], n: int, on_replies: OnReplies | None = None) -> None:
        self.fut = fut
        self.left = n
        self.on_replies = on_replies
        self.replies: list[Any] = []
        self.busy: BusyLoadingError | None = None  # a LOADING reply among them (see the module doc)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiters: deque[_Waiter] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.outbox: list[bytes] = []  # pipelines encoded this loop turn, written together by `flush`

    def queue(self, data: bytes) -> None:
        """Write `data` now when nothing else waits on this connection; else hold it, with every
        other pipeline sent meanwhile, for one `write` at the start of the next loop turn (which
        polls for I/O without waiting: no timer). At 32 clients several requests reach a round
        trip together: 32 concurrent 4-command pipelines cost 12 µs of CPU each instead of 19 on
        the 2-core VM (#20). A lone pipeline is written at once: held, it paid a loop turn more
        (the sequential A/B's CPU per request went up). The order on the wire is the order of
        the calls, as the waiters' is."""
        if self.outbox:
            self.outbox.append(data)
        elif len(self.waiters) > 1:  # others in flight (the caller's waiter is already queued)
            self.outbox.append(data)
            asyncio.get_running_loop().call_soon(self.flush)
        elif self.transport is not None:
            self.transport.write(data)

    def flush(self) -> None:
        data, self.outbox = self.outbox, []
        if self.closed or self.transport is None:  # `fail` failed their waiters already
            return
        try:
            self.transport.write(data[0] if len(data) == 1 else b"".join(data))
        except (OSError, RuntimeError) as exc:  # a transport that broke under us: as a lost connection
            self.fail(RedisConnectionError(f"write failed: {exc}"))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(RedisConnectionError(f"protocol error: {exc}"))
                return
            if reply is False:
                return
            if not self.waiters:  # a reply nobody waits for: the stream is out of step
                self.fail(RedisConnectionError("unexpected reply"))
                return
            w = self.waiters[0]
            if isinstance(reply, hiredis.ReplyError):
                reply = _error(reply)
                if isinstance(reply, BusyLoadingError):
                    w.busy = reply
            w.replies.append(reply)
            w.left -= 1
            if w.left == 0:
                self.waiters.popleft()
                if w.busy is not None:  # nothing of it ran (see the module doc)
                    if not w.fut.done():
                        w.fut.set_exception(w.busy)
                    continue
                if w.on_replies is not None:
                    try:
                        w.on_replies(w.replies)
                    except Exception as exc:  # the hook's bug: its caller's, not the connection's
                        if w.fut.done():
                            log.exception("a pipeline's reply hook failed after its caller left")
                        else:
                            w.fut.set_exception(exc)
                        continue
                if not w.fut.done():
                    w.fut.set_result(w.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection lost: {exc or 'closed by server'}"))

    def fail(self, exc: Exception) -> None:
        self.closed = True
        while self.waiters:
            w = self.waiters.popleft()
            if not w.fut.done():
                w.fut.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class RespConnection:
    """One connection, many concurrent pipelines (requests are written in call order)."""

    def __init__(self, url: str, timeout_s: float = 2.0, connect_timeout_s: float = 2.0) -> None:
        u = urlparse(url)
        if u.scheme not in ("redis", "unix"):
            raise ValueError(f"unsupported Redis URL scheme for the lean client: {u.scheme!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 6379
        self.path = u.path if u.scheme == "unix" else ""
        self.db = int((u.path or "/0").lstrip("/") or 0) if u.scheme == "redis" else 0
        self.username = unquote(u.username) if u.username else None
        self.password = unquote(u.password) if u.password else None
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 2.0) -> RespConnection | None:
        """None when the URL needs more than this client speaks (TLS, sentinel, options)."""
        u = urlparse(url)
        if u.scheme not in ("redis", "unix") or u.query:
            return None
        return cls(url, timeout_s=timeout_s)

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._proto is not None and not self._proto.closed:
                return self._proto
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    if self.path:
                        _, proto = await loop.create_unix_connection(_Protocol, self.path)
                    else:
                        _, proto = await loop.create_connection(_Protocol, self.host, self.port)
            except (OSError, TimeoutError) as exc:
                raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
            hello: list[list[Arg]] = []
            if self.password is not None:
                hello.append(["AUTH", *([self.username] if self.username else []), self.password])
            if self.db:
                hello.append(["SELECT", self.db])
            if hello:
                res = await self._send(proto, hello)
                bad = [r for r in res if isinstance(r, ResponseError)]
                if bad:
                    proto.fail(RedisConnectionError("handshake failed"))
                    raise bad[0]
            self._proto = proto
            return proto

    async def _send(
        self, proto: _Protocol, commands: Sequence[Sequence[Arg]], on_replies: OnReplies | None = None
    ) -> list[Any]:
        assert proto.transport is not None
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        proto.waiters.append(_Waiter(fut, len(commands), on_replies))
        proto.queue(encode(commands))
        try:
            async with asyncio.timeout(self.timeout_s):
                return await fut
        except TimeoutError:
            # Late is not lost: the waiter stays queued and its replies are dropped when they
            # come, so the connection stays in step and the other pipelines on it are unharmed.
            raise RedisTimeoutError("Redis did not answer in time") from None

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], on_replies: OnReplies | None = None
    ) -> list[Any]:
        """Every command's reply in order; error replies are returned, not raised. `on_replies`:
        see the module doc (never called when the connection fails before they arrive)."""
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._connect()
        return await self._send(proto, commands, on_replies)

    async def call(self, *command: Arg) -> Any:
        """One command; an error reply is raised (redis-py's `ResponseError` family)."""
        (reply,) = await self.pipeline([command])
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def close(self) -> None:
        """Close the connection; pipelines still waiting fail with `ConnectionError`."""
        proto, self._proto = self._proto, None
        if proto is not None:
            proto.fail(RedisConnectionError("connection closed by the client"))
            await asyncio.sleep(0)  # let the transport finish closing


def stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """An XREAD/XREADGROUP reply as (entry id, fields) over all its streams, in order; nil (no
    entries, or a BLOCK that timed out) is []. An entry deleted while pending has no fields: {}."""
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    for _key, entries in reply or []:
        for entry_id, flat in entries:
            fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
            out.append((entry_id, fields))
    return out
