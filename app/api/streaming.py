"""Running a request for the API handlers: awaiting it while watching the client's connection,
relaying its events through a bounded buffer, and the SSE framing of the streamed answer.

Split out of `app.api.routes` (issue #18: modules <= ~500 lines); the handlers there build the
request and shape the answer, this module only runs it and carries its events to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response, StreamingResponse

from app.gateway.errors import ApiError
from app.request.pipeline import GenRequest, StoredOutcome

T = TypeVar("T")
log = logging.getLogger("flexlb.api")


# ---- running a request ----------------------------------------------------------------------
async def disconnected(request: Request) -> None:
    """Return when the client goes away. The body was read already, so the next ASGI message the
    server delivers is `http.disconnect`."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # this connection cannot be watched: never report it gone
        await asyncio.Event().wait()


async def guarded(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in a task of its own while watching the client's connection.

    The pipeline registers the task it runs in as the request's (`Pipeline.live`), so a cancel
    from any replica (`DELETE /v1/requests/{id}`) cancels that task, never this handler: the
    client still gets a typed `cancelled` answer instead of the server's bare 500. A client that
    disconnects before the answer (non-streaming, or a stream before its first byte: queued or in
    prefill) cancels the task, and the pipeline's clean-up removes the queued request, cancels the
    engine's work and releases every hold. Uvicorn would otherwise run it to the end for no one.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watch = asyncio.create_task(disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client went away, or this handler itself is being cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if not task.cancelled():
        return task.result()
    if watch.done() and not watch.cancelled():
        raise ApiError("cancelled", "client disconnected")
    raise ApiError("cancelled", "request cancelled")


def answer(body: dict[str, Any]) -> Response:
    """A non-streaming answer, encoded once: FastAPI would first walk a returned dict through
    `jsonable_encoder` (a copy of every value, ~1,000 output ids included) before the same
    `json.dumps` as here (JSONResponse's own settings). Anything json cannot encode still goes
    through FastAPI's encoder."""
    raw = json.dumps(
        body, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=jsonable_encoder
    )
    return Response(raw.encode(), media_type="application/json")


async def collect(r: Any, req: GenRequest) -> dict[str, Any]:
    try:
        async for kind, payload in r.pipeline.run(req):
            if kind == "end":
                return payload  # type: ignore[no-any-return]
    except StoredOutcome as so:
        return stored(so.outcome)
    raise ApiError("internal", "request ended without an outcome")


def stored(outcome: dict[str, Any]) -> dict[str, Any]:
    """The stored outcome of a finished request as the answer to a retry of its id: the result
    when it completed, else its typed error. Records written before errors were objects carry a
    plain string; the state then names the code (`owner_lost`), never a 500."""
    state = str(outcome.get("state", ""))
    if state != "completed":
        err = outcome.get("error") or {}
        if not isinstance(err, dict):
            err = {"message": str(err)}
        default_code = {
            "owner_lost": "owner_lost",
            "timed_out": "deadline_exceeded",
            "cancelled": "cancelled",
        }
        raise ApiError(
            str(err.get("code") or default_code.get(state, "worker_error")),
            str(err.get("message") or f"request ended {state}"),
        )
    return outcome


async def relay(r: Any, req: GenRequest) -> AsyncIterator[tuple[str, Any]]:
    """Run the request in its own task feeding a bounded buffer: the client's reading pace never
    stalls the engine stream, and a client that stops reading (buffer full too long) is cancelled
    instead of buffered forever. Leaving this generator (disconnect) cancels the task.

    With FLEXLB_SSE_KEEPALIVE_S > 0 it also yields ("admitted", None) as soon as the pipeline
    admits the request (`GenRequest.on_admitted`: queued on its prefill worker, decode KV held;
    no typed HTTP refusal is left), and ("keepalive", None) whenever no event came for that long
    after it: the stream answers 200 on the first and sends an SSE comment for both (see
    `stream_response`). Only an empty buffer starts a timer: a busy stream pays nothing."""
    q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=r.settings.sse_buffer_chunks)
    stall = r.settings.sse_stall_timeout_s
    keepalive = float(r.settings.sse_keepalive_s)
    leaving = False  # set when this generator ends: nobody reads `q` any more
    started = False  # an event went out (admitted, or any before it): keep-alives may follow

    def admitted() -> None:
        if not q.full():  # full: events are flowing, the stream started already
            q.put_nowait(("admitted", None))

    if keepalive > 0:
        req.on_admitted = admitted

    def last(ev: tuple[str, Any]) -> None:
        """The final event always fits: tokens still buffered for a request that ends in an
        error are dropped rather than leaving the reader waiting forever."""
        while q.full():
            q.get_nowait()
        q.put_nowait(ev)

    async def produce() -> None:
        try:
            # aclosing: leaving early (stalled client, cancel) runs the pipeline's clean-up now,
            # not whenever the suspended generator is garbage-collected.
            async with contextlib.aclosing(r.pipeline.run(req)) as events:
                async for ev in events:
                    # Not asyncio.wait_for: on 3.11 it swallows a cancel that lands as the put
                    # completes, and a DELETE of a streaming request was then lost for good.
                    async with asyncio.timeout(stall):
                        await q.put(ev)
        except StoredOutcome as so:
            last(("stored", so.outcome))
        except ApiError as err:
            last(("error", err))
        except TimeoutError:
            last(("error", ApiError("cancelled", "client stopped reading")))
        except asyncio.CancelledError:
            if not leaving:  # cancelled by `DELETE /v1/requests/{id}`, not by our reader leaving
                last(("error", ApiError("cancelled", "request cancelled")))
            raise
        except Exception:  # pipeline already logged it
            last(("error", ApiError("internal", "internal error")))

    task = asyncio.create_task(produce())
    try:
        while True:
            if not started or q.qsize():
                kind, payload = await q.get()
            else:
                try:
                    # Queue.get leaves the item queued when the timeout cancels it: nothing lost
                    async with asyncio.timeout(keepalive):
                        kind, payload = await q.get()
                except TimeoutError:
                    yield "keepalive", None
                    continue
            started = keepalive > 0
            yield kind, payload
            if kind in ("end", "error", "stored"):
                return
    finally:
        leaving = True
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def sse_error(err: ApiError) -> bytes:
    return sse(err.body())


def stored_or_error(outcome: dict[str, Any]) -> dict[str, Any] | ApiError:
    try:
        return stored(outcome)
    except ApiError as e:
        return e


#: An SSE comment line for relay's "admitted" and "keepalive" events: every SSE parser (the
#: openai SDK's included) skips it; it keeps a client's read timeout and a proxy's idle timer from
#: firing while the request waits for a token.
KEEPALIVE = b": keep-alive\n\n"


async def stream_response(request: Request, gen: AsyncIterator[bytes]) -> StreamingResponse:
    """Pull the first chunk before answering 200, so refusals before admission (validation,
    overload, SLO, no worker) are still plain typed HTTP errors, not a 200 with an error event.
    With FLEXLB_SSE_KEEPALIVE_S > 0 the first chunk of an admitted request that has no token yet
    is a `: keep-alive` comment (`relay`), so the 200 goes out at admission and a long prefill or
    queue no longer outlasts a client's read timeout (httpx: 5 s) or a proxy's idle timeout; a
    failure after that is an `Error` event then `data: [DONE]`. With 0 the 200 waits for the
    first token. The wait covers queueing and prefill, so a client that leaves meanwhile cancels
    the request; after the 200, Starlette sees the disconnect and cancels the body, which
    cancels the request the same way."""
    first = await guarded(request, gen.__anext__())
    if first.startswith(b'data: {"error"'):
        err = json.loads(first[6:])["error"]
        try:  # the request has ended (its error event is out): this only finishes the generator
            await gen.aclose()
        except Exception:  # a bug in the generator's ending: logged; the client still gets its error
            log.exception("closing the stream after its error event failed")
        raise ApiError(err["code"], err["message"])

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for b in gen:
            yield b

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
