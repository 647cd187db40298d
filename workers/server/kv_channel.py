"""The KV side channel: how a decode worker claims a prefill worker's KV handle.

In a disaggregated deployment the KV moves over its own data plane (RDMA, NIXL), beside the
inference server's request path; what starts the move is one small claim message. Sent as a Triton
`control` call, that claim cost ~5 ms of CPU per request over the two workers (tritonserver, the
Python-backend stub and PyTriton on the prefill side, a gRPC client on the decode side): a third of
all the worker CPU a request needed. Here it is one JSON line each way over a persistent TCP
connection between the two worker processes.

A decode worker finds a peer's endpoint once with `control.kv_endpoint` and keeps one connection
per peer; a peer that answers that op with an error (an older worker) is claimed through
`control.release` as before. Both ends run on a private event loop thread (`SideLoop`), so neither
depends on which loop PyTriton runs an infer function on.

Wire format (docs/worker-protocol.md §5): request `{"id": n, "request_id": r, "epoch": e}` and
answer `{"id": n, "status": s}`, one JSON object per line; answers may come out of order. A real
engine's decode worker adds `"fetch": true`: an `ok` answer then carries `"frame_bytes": N` and is
followed on the connection by N bytes, the request's KV frame (kv_frames.py), and the handle is
released as by a claim.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hmac
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from app.protocol.codes import EngineStatus

log = logging.getLogger("flexlb.worker.kv")
T = TypeVar("T")

MAX_LINE = 4096  # a claim is ~100 bytes; a longer line is a wrong client: its connection is closed
MAX_FRAME_BYTES = 1 << 30  # a longer announced frame is a wrong peer: its connection is closed

Answer = tuple[str, bytes | None]  # (status, KV frame or None)


class SideLoop:
    """An asyncio loop on its own daemon thread, for the side channel's server and clients."""

    def __init__(self, name: str = "kv-side") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Blocking: for start-up and shutdown from another thread."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


class KvClaimServer:
    """Prefill side: answers claims with `claim(request_id, epoch) -> status`."""

    def __init__(
        self,
        claim: Callable[[str, str], Awaitable[str]],
        fetch: Callable[[str, str], Awaitable[Answer]] | None = None,
        secret: str = "",
    ) -> None:
        # With a secret, a connection's first line must be it; anything else closes the connection
        # before a claim is read (KV handles are only for the workers of this cluster).
        self._secret = secret.encode()
        self._claim = claim
        self._fetch = fetch  # a real engine: hand over the KV frame with the claim
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_LINE)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)
        try:
            if self._secret:
                first = (await reader.readline()).rstrip(b"\n")
                if not hmac.compare_digest(first, self._secret):
                    log.warning("kv channel: a connection without the worker secret was closed")
                    return
            while line := await reader.readline():
                # Each claim answers on its own: one slow engine call does not hold the others.
                t = asyncio.create_task(self._answer(line, writer))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        except (OSError, ValueError, asyncio.LimitOverrunError):
            pass  # reset by the peer, or a line over MAX_LINE: drop the connection
        except asyncio.CancelledError:
            # close() ended the connection: end normally. Re-raised, Python 3.11's start_server
            # callback calls exception() on the cancelled task and logs that as an error.
            pass
        finally:
            if me is not None:
                self._tasks.discard(me)
            writer.close()

    async def _answer(self, line: bytes, writer: asyncio.StreamWriter) -> None:
        msg_id: Any = None
        frame: bytes | None = None
        try:
            msg = json.loads(line)
            msg_id = msg["id"]
            rid, epoch = str(msg["request_id"]), str(msg.get("epoch") or "")
            if msg.get("fetch") and self._fetch is not None:
                status, frame = await self._fetch(rid, epoch)
            else:
                status = await self._claim(rid, epoch)
        except (ValueError, KeyError, TypeError):
            status = EngineStatus.INVALID
        except Exception:  # an engine failure is the claimer's "no KV", never a silent hang
            log.exception("kv claim failed")
            status = EngineStatus.ENGINE_ERROR
        if not writer.is_closing():
            answer: dict[str, Any] = {"id": msg_id, "status": str(status)}
            if frame is not None:
                answer["frame_bytes"] = len(frame)
            # One write: the line and its frame can never interleave with another answer's.
            writer.write(json.dumps(answer).encode() + b"\n" + (frame or b""))


class _Conn:
    """One connection to a peer's claim server; answers are matched to callers by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._waiting: dict[int, asyncio.Future[Answer]] = {}
        self._next = 0
        self.closed = False
        self._reader_task = asyncio.create_task(self._read())

    async def ask(self, request_id: str, epoch: str, fetch: bool = False) -> Answer:
        if self.closed:
            raise ConnectionError("kv channel closed")
        n = self._next
        self._next += 1
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[n] = fut
        try:
            body: dict[str, Any] = {"id": n, "request_id": request_id, "epoch": epoch}
            if fetch:
                body["fetch"] = True
            self._writer.write(json.dumps(body).encode() + b"\n")
            return await fut
        finally:
            self._waiting.pop(n, None)  # a late answer to a timed-out claim is dropped

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                msg = json.loads(line)
                frame: bytes | None = None
                size = msg.get("frame_bytes")
                if size is not None:
                    if not isinstance(size, int) or not 0 <= size <= MAX_FRAME_BYTES:
                        raise ValueError(f"announced frame of {size} bytes")
                    frame = await self._reader.readexactly(size)
                fut = self._waiting.get(msg.get("id"))
                if fut is not None and not fut.done():
                    fut.set_result((str(msg.get("status", EngineStatus.UNKNOWN)), frame))
        except (OSError, ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            pass  # a truncated frame closes the connection: its waiter gets ConnectionError
        finally:
            self.close()

    def close(self) -> None:
        self.closed = True
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("kv channel closed"))
        self._writer.close()


Resolver = Callable[[str], Awaitable[str | None]]
Fallback = Callable[[str, str, str], Awaitable[str]]


class KvClaimClient:
    """Decode side: one connection per peer (prefill `host:grpc_port`), found by `resolve(peer)`
    (None: the peer has no side channel, so `fallback(peer, request_id, epoch)` claims instead)."""

    def __init__(
        self, resolve: Resolver, fallback: Fallback, timeout_s: float = 5.0, secret: str = ""
    ) -> None:
        self._resolve, self._fallback, self.timeout_s = resolve, fallback, timeout_s
        self._secret = secret.encode()  # sent as each connection's first line
        self._endpoints: dict[str, str | None] = {}
        self._conns: dict[str, _Conn] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def claim(self, peer: str, request_id: str, epoch: str) -> str:
        async with asyncio.timeout(self.timeout_s):
            conn = await self._conn(peer)
            if conn is None:
                return await self._fallback(peer, request_id, epoch)
            return (await conn.ask(request_id, epoch))[0]

    async def fetch(self, peer: str, request_id: str, epoch: str) -> Answer:
        """Claim the handle and take its KV frame (a real engine's decode). A peer without a side
        channel cannot send KV: `no_kv_channel`."""
        async with asyncio.timeout(self.timeout_s):
            conn = await self._conn(peer)
            if conn is None:
                return "no_kv_channel", None
            return await conn.ask(request_id, epoch, fetch=True)

    async def _conn(self, peer: str) -> _Conn | None:
        conn = self._conns.get(peer)
        if conn is not None and not conn.closed:
            return conn
        async with self._locks.setdefault(peer, asyncio.Lock()):
            conn = self._conns.get(peer)
            if conn is not None and not conn.closed:
                return conn
            for attempt in (0, 1):
                if peer not in self._endpoints:
                    self._endpoints[peer] = await self._resolve(peer)
                endpoint = self._endpoints[peer]
                if endpoint is None:
                    return None
                host, _, port = endpoint.rpartition(":")
                host = host.strip("[]")
                try:
                    reader, writer = await asyncio.open_connection(host, int(port), limit=MAX_LINE)
                except OSError:
                    # The peer may have restarted on the same gRPC address with a new side port.
                    del self._endpoints[peer]
                    if attempt:
                        raise
                    continue
                if self._secret:
                    writer.write(self._secret + b"\n")
                conn = self._conns[peer] = _Conn(reader, writer)
                return conn
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for peer, conn in self._conns.items():
            try:
                conn.close()
            except (OSError, RuntimeError) as exc:  # a transport already gone or its loop closed
                log.debug("kv channel to %s: close failed: %s", peer, exc)
        self._conns.clear()
