"""For bench/request_timeline.py, on a gateway's PYTHONPATH: wall-clock marks on one request's path
(HTTP in and out, every lean-client Redis round trip, the owner's send and reply, the gRPC prefill
and decode events, the terminal write), written to `$TIMELINE_DIR/<pid>.json` every 2 s. Nothing
runs unless `TIMELINE_DIR` is set and the process imports the gateway's request path. Measurement
only, never product code: the wrappers cost a few µs a mark."""

import functools
import json
import os
import sys
import threading
import time

EV: list[tuple[float, str]] = []
_pc = time.perf_counter
_NEED = (
    "app.api.arrival",
    "app.state.resp",
    "app.rpc.worker_client",
    "app.request.pipeline",
    "app.dispatch.owner",
)


def _mark(label: str) -> None:
    EV.append((_pc(), label))


def _dump(out: str) -> None:
    if EV:
        tmp = f"{out}/{os.getpid()}.json.tmp"
        with open(tmp, "w") as f:
            json.dump(EV[:], f)
        os.replace(tmp, f"{out}/{os.getpid()}.json")


def _wrap_co(cls, name, label):
    f = getattr(cls, name)

    @functools.wraps(f)
    async def w(*a, **k):
        _mark(label + ">")
        try:
            return await f(*a, **k)
        finally:
            _mark(label + "<")

    setattr(cls, name, w)


def _wrap_agen(cls, name, label):
    f = getattr(cls, name)

    @functools.wraps(f)
    async def w(*a, **k):
        _mark(label + ">")
        async for ev in f(*a, **k):
            _mark(f"{label}:{getattr(ev, 'event', '?')}")
            yield ev
        _mark(label + "<")

    setattr(cls, name, w)


def _patch(out: str) -> None:
    for _ in range(3000):  # the gateway imports these within its start-up; other processes never do
        if all(m in sys.modules for m in _NEED) and hasattr(sys.modules[_NEED[-1]], "OwnerDispatcher"):
            break
        time.sleep(0.01)
    else:
        return
    arr = sys.modules["app.api.arrival"]
    stamp = arr.StampArrival.__call__

    async def call(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await stamp(self, scope, receive, send)
        _mark("HTTP_IN")

        async def send_marked(msg):
            last = msg.get("type") == "http.response.body" and not msg.get("more_body")
            if last:
                _mark("response_body>")
            await send(msg)
            if last:
                _mark("response_body<")

        await stamp(self, scope, receive, send_marked)
        _mark("HTTP_OUT")

    arr.StampArrival.__call__ = call
    resp = sys.modules["app.state.resp"]
    pipeline = resp.RespConnection.pipeline

    @functools.wraps(pipeline)
    async def pl(self, commands, *a, **k):
        label = "redis[" + ",".join(str(c[0]) for c in commands)[:60] + "]"
        _mark(label + ">")
        try:
            return await pipeline(self, commands, *a, **k)
        finally:
            _mark(label + "<")

    resp.RespConnection.pipeline = pl
    wc = sys.modules["app.rpc.worker_client"].WorkerClient
    _wrap_agen(wc, "prefill", "grpc_prefill")
    _wrap_agen(wc, "decode", "grpc_decode")
    pipe = sys.modules["app.request.pipeline"].Pipeline
    _wrap_co(pipe, "_prefill", "handoff")
    _wrap_co(pipe, "_finish", "terminal_write")
    od = sys.modules["app.dispatch.owner"].OwnerDispatcher
    _wrap_co(od, "_send", "owner_send")
    _wrap_co(od, "_reply", "owner_reply")
    while True:
        time.sleep(2)
        _dump(out)


if os.environ.get("TIMELINE_DIR"):
    threading.Thread(target=_patch, args=(os.environ["TIMELINE_DIR"],), name="timeline", daemon=True).start()
