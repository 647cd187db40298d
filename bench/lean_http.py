"""A small HTTP/1.1 keep-alive client for the gateway benchmark's load generator.

Why not httpx: the load generator shares the 2-core box with what it measures. At 100 req/s httpx
used 0.47 of a core (~4.7 ms of CPU per POST), a quarter of the machine taken from the gateways
and workers under test. This client does only what the benchmark needs: POST a prepared body on a
pooled keep-alive connection, parse the response with httptools (already installed with uvicorn),
and hand back the status and body. No redirects, no TLS, no chunked request bodies.
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlparse

import httptools


class HttpError(Exception):
    """The request could not be completed (connection refused, closed early, timed out)."""


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.fut: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.keep_alive = True
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpError(f"bad response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(HttpError(f"connection closed: {exc or 'by peer'}"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        fut, self.fut = self.fut, None
        if fut is not None and not fut.done():
            fut.set_result((self.parser.get_status_code(), b"".join(self.body)))
        self.body = []

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        fut, self.fut = self.fut, None
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class LeanClient:
    """POSTs to one base URL over at most `max_conns` keep-alive connections."""

    def __init__(self, base_url: str, max_conns: int, timeout_s: float) -> None:
        u = urlparse(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.max_conns = max_conns
        self.timeout_s = timeout_s
        self._idle: deque[_Conn] = deque()
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def _acquire(self) -> _Conn:
        while True:
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    return c
                self._open -= 1
            if self._open < self.max_conns:
                self._open += 1
                try:
                    _, c = await asyncio.get_running_loop().create_connection(_Conn, self.host, self.port)
                except OSError as exc:
                    self._open -= 1
                    raise HttpError(f"connect failed: {exc}") from exc
                return c
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    def _release(self, c: _Conn) -> None:
        if c.closed or not c.keep_alive:
            if c.transport is not None:
                c.transport.close()
            self._open -= 1
        else:
            self._idle.append(c)
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                break

    async def post(self, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        c = await self._acquire()
        try:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
            c.fut = fut
            assert c.transport is not None
            c.transport.write(head + body)
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await fut
            except TimeoutError:
                c._fail(HttpError("timed out"))
                raise HttpError(f"no answer in {self.timeout_s} s") from None
        except BaseException:
            c.closed = True
            raise
        finally:
            self._release(c)

    async def aclose(self) -> None:
        while self._idle:
            c = self._idle.pop()
            if c.transport is not None:
                c.transport.close()
        self._open = 0
