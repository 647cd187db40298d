"""Calls on long-lived `ModelStreamInfer` streams (issue #20): multiplexed, or reused one at a time.

A stream per call costs each call an HTTP/2 stream's set-up and tear-down on both sides: ~2 ms of
latency and ~0.8 ms of the client's CPU (`bench/_wb_mux_probe.py`). Here a few long-lived
streams per model carry every call, each request with an id of its own, and a stream's reader
routes every response to its call by `infer_response.id`: one stream while calls come one after
the other (an owner's polls), another only when each open one has `share` calls in flight, `pool`
at most (see `StreamMux._stream`). Short answers are multiplexed (`control`, `prefill`: `SHARE`,
`POOL`). Decode streams are reused but never shared (`share=1`, no cap): one HTTP/2 stream has one
flow-control window and tritonserver writes a stream's responses one at a time, so token streams
sharing one would queue behind each other; a decode takes an idle stream or opens one, and the
stream is idle again once the call's final response has arrived.

What makes a shared stream safe (docs/benchmarks.md, "Issue #20, third pass"):

- **The worker's stop.** tritonserver's shutdown waits for every open stream, so a stream is
  retired (half-closed: its calls finish, new calls open a fresh stream) at `MAX_AGE_S` and when
  idle for `IDLE_S`. An owner polls `control` 5 times a second, so the age is what bounds a
  worker's stop under polling: `MAX_AGE_S` plus the longest call in flight (a stopping worker ends
  its engine streams at once). A call that times out also retires its stream, in case the
  connection under it is the reason.
- **Ending a call.** Each request asks for the final flag (`triton_enable_empty_final_response`;
  our workers put it on their last response, workers/server/stream_end.py). tritonserver sends
  its own error responses (an unknown input, a wrong datatype, a model not ready) with the id but
  without the flag, so an error ends its call too, and only that call.
- **Deadlines.** The stream's end no longer bounds a call, so each call has its own (`timeout`);
  a call without one is bounded by the stream: a broken stream fails every call on it at once
  with `WorkerUnavailable`, and the next call opens a new one.
- **Cancelling.** A cancelled caller only stops listening: its late responses are dropped, and
  writes are made by the stream's writer task, never by a caller (grpc.aio cancels the whole RPC
  when a write is cancelled). Engine work is cancelled explicitly, as before (`control.cancel`).
  The abandoned call still counts as in flight on its stream until its final (or error) response
  arrives: a decode stream is not handed to the next decode while the last one's tokens are still
  coming, which would queue the new call's tokens behind them.
- **A worker that never answers.** A retired stream ends when the worker ends it; one that hangs
  (alive, accepting, answering nothing) never does, and each poll past its deadline retires its
  stream, so the next opens another: ~1 stream (its gRPC call, reader task, timers, queues) kept
  per timed-out call for as long as the hang lasted (bench/leak_probe.py, a wedged decode worker:
  ~350 streams and ~30K gc objects in 13 min). So a retired stream on which nobody listens any
  more (every call in it ended or abandoned) is cancelled `ABANDONED_S` after its retirement.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

MAX_AGE_S = 2.0  # a stream takes new calls this long at most: bounds a worker's stop under polling
IDLE_S = 0.5  # a stream with no call this long is half-closed
ABANDONED_S = 5.0  # a retired stream nobody listens on is cancelled this long after retirement
SHARE = 4  # calls in flight on every open stream before another is opened
POOL = 8  # open streams per model at most; beyond, calls share the least busy
_FINAL = "triton_final_response"
_ASK_FINAL = "triton_enable_empty_final_response"


class WorkerUnavailable(ConnectionError):
    """The worker did not answer (connection refused, deadline, stream broken). ``timed_out``: the
    call ran past its deadline, so the worker may only be slow (the poller's health tells these
    apart, app/cluster/health.py)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Broken:
    """Put in a call's queue when its stream ends under it."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Stream:
    """One `ModelStreamInfer` call: a writer task sends the requests queued by callers, a reader
    task routes responses to the waiting calls' queues."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.ModelStreamInfer()
        # The calls in flight; None: its caller stopped listening before the call's end.
        self.waiting: dict[str, asyncio.Queue[Any] | None] = {}
        self.open = True  # takes new calls
        self.broken = ""  # why the stream ended (under its calls or not), once it did
        self.last_used = asyncio.get_running_loop().time()
        self.timers: list[asyncio.TimerHandle] = []
        self.reaped = False  # cancelled by `_reap` (tests, diagnostics)
        self._outbox: asyncio.Queue[service_pb2.ModelInferRequest | None] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def send(self, rid: str, req: service_pb2.ModelInferRequest) -> asyncio.Queue[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting[rid] = q
        self._outbox.put_nowait(req)
        return q

    def release(self, rid: str, ended: bool) -> None:
        """The caller of `rid` stops listening. A call that did not end yet (cancelled caller,
        deadline) stays in flight, abandoned, until its final or error response; one that did
        (its last response may still be unread in its queue) leaves now."""
        q = self.waiting.get(rid)
        if not ended and q is not None:
            while not q.empty():
                item = q.get_nowait()
                if isinstance(item, _Broken) or item.error_message or _final(item.infer_response):
                    ended = True
        if ended or q is None:
            self.waiting.pop(rid, None)
            self.last_used = asyncio.get_running_loop().time()
        else:
            self.waiting[rid] = None

    def retire(self) -> None:
        """Take no new calls; half-close once what is queued is written, so the server ends the
        stream after the calls in flight."""
        if self.open:
            self.open = False
            self._outbox.put_nowait(None)
            for t in self.timers:
                t.cancel()
            self.timers = [asyncio.get_running_loop().call_later(ABANDONED_S, self._reap)]

    def _reap(self) -> None:
        """Cancel the retired stream if it has not ended and nobody listens on it: its calls all
        ended or were abandoned (their callers gave up: a deadline, a cancel), so only a late
        response from a slow or hung worker could still come, and none is wanted. A caller
        still listening keeps it (bounded by its own deadline, or by the stream)."""
        if self.reader.done():
            return
        if any(q is not None for q in self.waiting.values()):
            self.timers = [asyncio.get_running_loop().call_later(ABANDONED_S, self._reap)]
            return
        self.reaped = True
        self.call.cancel()

    def _fail(self, reason: str) -> None:
        self.open = False
        self.broken = reason
        for t in self.timers:
            t.cancel()
        for q in self.waiting.values():
            if q is not None:  # an abandoned call (None) has nobody to tell
                q.put_nowait(_Broken(reason))
        self.waiting.clear()
        self._outbox.put_nowait(None)  # the writer stops (its writes would fail anyway)

    async def _write(self) -> None:
        try:
            while (req := await self._outbox.get()) is not None:
                await self.call.write(req)
            if not self.broken:
                await self.call.done_writing()
        except grpc.aio.AioRpcError as exc:
            self._fail(_short(exc))
        except asyncio.InvalidStateError as exc:  # the RPC ended: the reader reports why
            self._fail(str(exc))

    async def _read(self) -> None:
        reason = "stream ended"
        try:
            async for resp in self.call:
                r = resp.infer_response
                q = self.waiting.get(r.id)
                if q is not None:
                    q.put_nowait(resp)
                elif r.id in self.waiting:  # an abandoned call: dropped; its end frees the stream
                    if resp.error_message or _final(r):
                        del self.waiting[r.id]
                        self.last_used = asyncio.get_running_loop().time()
                elif resp.error_message and not r.id:
                    # An error that names no request cannot be routed: no call could end on it.
                    reason = f"unroutable error: {resp.error_message}"
                    self.call.cancel()
                    break
                # else: a late response of a call whose stream was given back (none should be)
        except grpc.aio.AioRpcError as exc:
            reason = _short(exc)
        except asyncio.CancelledError:
            self._fail("abandoned" if self.reaped else "client closed")
            raise
        self._fail(reason)


class StreamMux:
    """The long-lived streams of one model of one worker, opened on demand, renewed at `MAX_AGE_S`
    and half-closed when idle. `one_each`: a stream carries one call at a time and as many are
    opened as calls are in flight (decode); else calls share them (`SHARE`, `POOL`)."""

    def __init__(self, stub: Any, address: str, model: str, one_each: bool = False) -> None:
        self._stub = stub
        self._one_each = one_each
        self._label = f"{address} {model}"
        self._open: list[_Stream] = []  # taking new calls
        self._live: set[_Stream] = set()  # not ended yet (open or draining)
        self._ids = itertools.count()
        self.opened = 0  # streams opened so far (tests, diagnostics)

    def _stream(self) -> _Stream:
        """The open stream with the fewest calls in flight; a new one when each has `SHARE` or
        more and fewer than `POOL` are open (with `one_each`: when none is idle). grpc.aio keeps
        one receive (and one send) pending per stream, each completed by a turn of the event loop,
        so calls that all share one stream get their responses one loop turn apart: under load (32
        clients through a gateway) that cost more throughput than the set-ups it saved
        (bench/router_overhead.py, 32 clients, medians of 3 runs at load 4-6: one stream ~93
        req/s, a stream per call ~119, up to 4 calls a stream and 8 streams ~124). Streams are
        still reused call after call, which is where the saving is."""
        best: _Stream | None = None
        still = []
        for s in self._open:
            if s.open:
                still.append(s)
                if best is None or len(s.waiting) < len(best.waiting):
                    best = s
        self._open = still
        if (
            best is None
            or (self._one_each and best.waiting)
            or (len(best.waiting) >= SHARE and len(still) < POOL and not self._one_each)
        ):
            best = _Stream(self._stub)
            self.opened += 1
            self._open.append(best)
            self._live.add(best)
            best.reader.add_done_callback(lambda _t, s=best: self._live.discard(s))
            loop = asyncio.get_running_loop()
            best.timers.append(loop.call_later(MAX_AGE_S, best.retire))
            best.timers.append(loop.call_later(IDLE_S, self._idle, best))
        return best

    def _idle(self, s: _Stream) -> None:
        if not s.open:
            return
        loop = asyncio.get_running_loop()
        left = IDLE_S if s.waiting else s.last_used + IDLE_S - loop.time()
        if left > 0.001:
            s.timers.append(loop.call_later(left, self._idle, s))
            return
        s.retire()

    async def call(
        self,
        req: service_pb2.ModelInferRequest,
        timeout: float | None,
        wrap: Callable[[Any], Any],
    ) -> AsyncIterator[Any]:
        """The call's responses (those with outputs, through `wrap`) until its final flag; an
        error response, a broken stream or the deadline raise `WorkerUnavailable`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        s = self._stream()
        rid = f"{req.id}.{next(self._ids):x}" if req.id else f"{next(self._ids):x}"
        req.id = rid
        req.parameters[_ASK_FINAL].bool_param = True
        q = s.send(rid, req)
        ended = False
        try:
            while True:
                if q.empty() and deadline is not None:
                    try:
                        async with asyncio.timeout_at(deadline):
                            item = await q.get()
                    except TimeoutError:
                        s.retire()  # the connection may be why: new calls get a fresh stream
                        raise WorkerUnavailable(f"{self._label}: deadline exceeded", timed_out=True) from None
                else:
                    item = await q.get()
                if isinstance(item, _Broken):
                    ended = True
                    raise WorkerUnavailable(f"{self._label}: {item.reason}")
                if item.error_message:
                    ended = True
                    raise WorkerUnavailable(f"{self._label}: {item.error_message[-1500:]}")
                r = item.infer_response
                ended = _final(r)
                if r.outputs:
                    yield wrap(r)
                if ended:
                    return
        finally:
            s.release(rid, ended)

    def close(self) -> list[asyncio.Task[None]]:
        """Half-close every stream; returns their readers, which end when the server ends them
        (the caller bounds the wait; the channel's close cancels what is left)."""
        for s in self._open:
            s.retire()
        self._open = []
        return [s.reader for s in self._live]


def _final(r: Any) -> bool:
    """Whether an `infer_response` carries the final flag."""
    return _FINAL in r.parameters and bool(r.parameters[_FINAL].bool_param)


def _short(exc: Any) -> str:
    msg = exc.message() if hasattr(exc, "message") else str(exc)
    return str(msg)[-1500:]
