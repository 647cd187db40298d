"""Control and prefill calls multiplexed on one long-lived gRPC stream per model (issue #20,
app/rpc/mux_stream.py), against real Triton workers: routing by request id under concurrency, an
error response ending only its call, a caller's cancel leaving the stream usable, rotation at the
maximum age and idle close, a killed worker failing the calls in flight at once, and the stop
delay of a worker that is being polled."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from app.protocol import worker_api as W
from app.rpc import mux_stream
from app.rpc.tensors import bytes_tensor, inp
from app.rpc.worker_client import WorkerClient, WorkerUnavailable

from .conftest import back_on_its_port, start_worker
from .test_worker_triton import collect_prefill, prompt, uid


def opened(c: WorkerClient, model: str) -> int:
    return c._mux[model].opened


@pytest.fixture
def one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call shares one stream per model (by default a stream takes a second call in flight
    only when `POOL` streams are open): what these tests check is the sharing."""
    monkeypatch.setattr(mux_stream, "POOL", 1)


async def test_interleaved_prefill_and_control_calls_get_their_own_answers(clients, one_stream) -> None:
    p = clients["prefill"][0]
    assert p._mux, "the pool's clients multiplex by default"
    await p.configure(formula="5")  # 5 modelled ms per batch: many batches queue at once
    epoch = (await p.status())["epoch"]
    before = opened(p, W.PREFILL_MODEL)

    async def batch(n: int) -> None:
        reqs = [(f"r{n}-{k}-{uid()}", prompt(n * 10 + k, 64 * (1 + k) + n)) for k in range(1 + n % 3)]
        bid = f"b{n}-{uid()}"
        evs = await collect_prefill(p, bid, epoch, reqs)
        assert {ev.batch_id for ev in evs} == {bid}
        got = {r["request_id"]: r for ev in evs for r in ev.results}
        assert set(got) == {r for r, _ in reqs}
        for rid, toks in reqs:
            assert got[rid]["status"] == "ok" and got[rid]["input_tokens"] == len(toks)

    async def control(n: int) -> None:
        if n % 2:
            assert (await p.describe())["epoch"] == epoch
        else:
            op = f"op-{n}-{uid()}"  # refused, naming its own op: an answer names its call
            assert op in (await p.control({"op": op}))["error"]

    await asyncio.gather(*(f(n) for n in range(30) for f in (batch, control)))
    # one stream per model carried them (a rotation at the maximum age may add one)
    assert opened(p, W.PREFILL_MODEL) - before <= 1 + int(10 / mux_stream.MAX_AGE_S)


async def test_error_response_ends_only_its_call(clients, one_stream) -> None:
    p = clients["prefill"][0]
    await p.configure(formula="300")  # a batch in flight on the same stream meanwhile
    epoch = (await p.status())["epoch"]
    slow = asyncio.create_task(collect_prefill(p, "slow-" + uid(), epoch, [("s-" + uid(), prompt(1, 64))]))
    await asyncio.sleep(0.05)
    streams = opened(p, W.PREFILL_MODEL)
    bad = [
        inp(W.P_BATCH_ID, bytes_tensor(["bad-" + uid()]), "BYTES"),
        inp(W.P_EPOCH, bytes_tensor([epoch]), "BYTES"),
        inp(W.P_REQUEST_IDS, bytes_tensor(["a"]), "BYTES"),
        inp(W.P_INPUT_IDS, np.array([1.0, 2.0], dtype=np.float32), "FP32"),  # Triton refuses it
        inp(W.P_INPUT_LENGTHS, np.array([2], dtype=np.int32), "INT32"),
    ]
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailable, match=r"(?i)data-type|FP32"):
        async for _ in p._call(W.PREFILL_MODEL, bad, timeout=5):
            raise AssertionError("no response expected")
    assert time.monotonic() - t0 < 2  # ended by the error response, not by the deadline
    evs = await asyncio.wait_for(slow, 10)
    assert [r["status"] for ev in evs for r in ev.results] == ["ok"]
    assert opened(p, W.PREFILL_MODEL) == streams  # the same stream carried both


async def test_a_cancelled_caller_leaves_the_stream_usable_and_explicit_cancel_still_works(
    clients, one_stream
) -> None:
    p = clients["prefill"][0]
    await p.configure(formula="400")
    epoch = (await p.status())["epoch"]
    rid, bid = "gone-" + uid(), "b-" + uid()
    accepted = asyncio.Event()

    async def consume() -> None:
        async for ev in p.prefill(bid, epoch, [(rid, prompt(2, 64))]):
            if ev.event == "accepted":
                accepted.set()

    task = asyncio.create_task(consume())
    live: list = []
    for _ in range(200):  # bounded: until the batch runs on the worker
        live = (await p.status())["live"]
        if live:
            break
        await asyncio.sleep(0.01)
    assert live, "the batch never reached the engine"
    streams = opened(p, W.PREFILL_MODEL)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Stopping listening cancels nothing on the worker: the explicit cancel still finds the work.
    assert (await p.cancel(rid))["result"] == "cancelled"
    ok = await collect_prefill(p, "b2-" + uid(), epoch, [("ok-" + uid(), prompt(3, 64))])
    assert [r["status"] for ev in ok for r in ev.results] == ["ok"]
    assert opened(p, W.PREFILL_MODEL) == streams  # the cancelled caller did not break the stream


async def test_streams_are_reused_and_a_few_more_opened_under_concurrency(clients) -> None:
    c = WorkerClient(clients["prefill"][0].address, mux=True)
    try:
        for _ in range(10):  # one after the other: one stream (a rotation at most)
            await c.describe()
        assert opened(c, W.CONTROL_MODEL) <= 2
        before = opened(c, W.CONTROL_MODEL)
        answers = await asyncio.gather(*(c.describe() for _ in range(5 * mux_stream.POOL)))
        assert len({a["epoch"] for a in answers}) == 1
        assert 2 <= opened(c, W.CONTROL_MODEL) - before <= mux_stream.POOL + 1
        assert len(c._mux[W.CONTROL_MODEL]._open) <= mux_stream.POOL
    finally:
        await c.close()


async def test_rotation_at_max_age_and_idle_close_keep_calls_working(clients, monkeypatch) -> None:
    monkeypatch.setattr(mux_stream, "MAX_AGE_S", 0.3)
    c = WorkerClient(clients["prefill"][0].address, mux=True)
    try:
        epoch = (await c.status())["epoch"]
        t_end = time.monotonic() + 1.5
        width = mux_stream.SHARE + 2  # two streams at a time
        while time.monotonic() < t_end:  # calls overlap every rotation
            await asyncio.gather(*(c.describe() for _ in range(width)))
        mux = c._mux[W.CONTROL_MODEL]
        assert mux.opened >= 2 * 3, "streams rotate at their maximum age"
        assert len(mux._live) <= 2 * 2  # retired streams ended once their calls did
        # idle: the streams are half-closed and the worker ends them
        streams = list(mux._live)
        await asyncio.wait_for(asyncio.gather(*(s.reader for s in streams)), mux_stream.IDLE_S + 2)
        assert all(not s.open and s.broken == "stream ended" for s in streams) and not mux._live
        assert (await c.describe())["epoch"] == epoch  # and the next call opens a fresh one
    finally:
        await c.close()


def test_a_killed_worker_fails_calls_in_flight_then_the_client_reconnects_and_sigterm_is_bounded(
    worker_tmp: Path,
) -> None:
    """Dedicated workers (one is killed, its successor stopped): in-flight calls on the shared
    streams fail within a second of the kill; after a restart on the same port the same client
    works again; a worker polled 5 times a second stops within 10 s + MAX_AGE_S of SIGTERM: 10 s
    is an unpolled worker's bound (test_worker_triton's SIGTERM case), and the shared stream may
    hold the stop up to its maximum age. Measured on an idle box: ~4.9 s, with a stream per call
    as with the shared one (MAX_AGE_S 2); a stream that is never retired holds it 12-30 s."""
    w = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "2000")
    port = w.ready["grpc_port"]
    w2 = None

    async def run() -> None:
        nonlocal w2
        c = WorkerClient(w.address, mux=True)
        try:
            epoch = (await c.status())["epoch"]
            calls = [
                asyncio.create_task(
                    collect_prefill(c, f"k{n}-" + uid(), epoch, [(f"k{n}-" + uid(), prompt(n, 64))])
                )
                for n in range(3)
            ]
            for _ in range(200):
                if len((await c.status())["live"]) == 3:
                    break
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            w.kill_hard()
            for t in calls:
                with pytest.raises(WorkerUnavailable):
                    await asyncio.wait_for(t, 5)
            assert time.monotonic() - t0 < 1.0
            w2, e2 = await back_on_its_port("prefill", worker_tmp, port, c, epoch)
            evs = await collect_prefill(c, "after-" + uid(), e2, [("a-" + uid(), prompt(9, 64))])
            assert [r["status"] for ev in evs for r in ev.results] == ["ok"]

            # SIGTERM while an owner-like poller calls it every 200 ms on the shared stream
            polls: list[float] = []

            async def poller() -> None:
                while True:
                    try:
                        await c.poll(0, None, e2, timeout=0.5)
                        polls.append(time.monotonic())
                    except WorkerUnavailable:
                        pass
                    await asyncio.sleep(0.2)

            pt = asyncio.create_task(poller())
            await asyncio.sleep(1.0)
            assert polls and c._mux[W.CONTROL_MODEL]._open
            t0 = time.monotonic()
            w2.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(w2.proc.wait, mux_stream.MAX_AGE_S + 15)
            took = time.monotonic() - t0
            pt.cancel()
            assert rc == 0
            assert took < 10 + mux_stream.MAX_AGE_S, f"stop took {took:.1f} s under polling"
        finally:
            await c.close()

    try:
        asyncio.run(run())
    finally:
        w.stop()
        if w2 is not None:
            w2.stop()


async def hung_listener() -> tuple[asyncio.Server, list[asyncio.StreamWriter]]:
    """A worker that hangs, as the kernel sees it: a real TCP listener on 127.0.0.1 that accepts
    connections and never answers (its connections are kept, to be aborted by the test)."""
    conns: list[asyncio.StreamWriter] = []

    async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)

    return await asyncio.start_server(hold, "127.0.0.1", 0), conns


async def test_a_stream_that_breaks_under_an_abandoned_call_ends_cleanly() -> None:
    """A call past its deadline stays on its stream, abandoned, until its end; when the stream
    then breaks (the worker's process goes away), its reader ends without an error: the abandoned
    call has no caller to tell. It raised `AttributeError` there (seen in the schemathesis test,
    whose made-up workers' polls time out). The hung worker is a real TCP listener on 127.0.0.1
    that accepts the connection and never answers, then closes it."""
    server, conns = await hung_listener()
    port = server.sockets[0].getsockname()[1]
    c = WorkerClient(f"127.0.0.1:{port}", mux=True)
    try:
        with pytest.raises(WorkerUnavailable) as exc:
            await c.control({"op": "status"}, timeout=0.3)
        assert exc.value.timed_out
        (s,) = c._mux[W.CONTROL_MODEL]._live
        assert list(s.waiting.values()) == [None]  # abandoned, in flight until the stream ends
        server.close()
        for w in conns:
            w.transport.abort()
        deadline = time.monotonic() + 30  # bounded: gRPC notices the closed connection
        while not s.reader.done():
            assert time.monotonic() < deadline, "the stream never ended after its connection closed"
            await asyncio.sleep(0.02)
        assert s.reader.exception() is None and s.broken and not s.waiting
    finally:
        await c.close()
        await server.wait_closed()


async def test_streams_to_a_hung_worker_are_cancelled_once_nobody_listens(monkeypatch) -> None:
    """A worker that accepts and never answers (the real TCP listener of the test above): each
    poll past its deadline retires its stream and the next opens another. Those streams never
    ended (the worker never ends them): one kept per timed-out call for as long as the hang lasts
    (bench/leak_probe.py: ~350 streams and ~30K gc objects in 13 min with a wedged decode worker).
    Now a retired stream nobody listens on is cancelled `ABANDONED_S` after its retirement; one
    whose caller still waits (within its deadline) is kept until that caller gives up."""
    monkeypatch.setattr(mux_stream, "ABANDONED_S", 0.3)
    server, conns = await hung_listener()
    port = server.sockets[0].getsockname()[1]
    c = WorkerClient(f"127.0.0.1:{port}", mux=True)
    try:
        mux = c._mux[W.CONTROL_MODEL]
        for _ in range(3):  # an owner's polls, each past its deadline
            with pytest.raises(WorkerUnavailable) as exc:
                await c.control({"op": "status"}, timeout=0.2)
            assert exc.value.timed_out
        assert mux.opened == 3
        streams = list(mux._live)
        assert streams, "the timed-out calls' streams are still live right after their deadlines"
        deadline = time.monotonic() + 5
        while mux._live:
            assert time.monotonic() < deadline, f"{len(mux._live)} streams to a hung worker never end"
            await asyncio.sleep(0.05)
        assert all(s.reaped and s.broken == "abandoned" and not s.waiting for s in streams)

        # a caller still waiting keeps its retired stream until its own deadline
        monkeypatch.setattr(mux_stream, "MAX_AGE_S", 0.1)  # retired at once, its caller waiting
        t0 = time.monotonic()
        call = asyncio.create_task(c.control({"op": "status"}, timeout=1.5))
        await asyncio.sleep(0.8)  # retired at 0.1 s; `ABANDONED_S` passed twice since
        (s,) = mux._live
        assert not s.open and not s.reaped and not call.done()
        with pytest.raises(WorkerUnavailable) as exc:
            await call
        assert exc.value.timed_out and time.monotonic() - t0 >= 1.4
        deadline = time.monotonic() + 5
        while not s.reader.done():
            assert time.monotonic() < deadline, "abandoned after its caller's deadline, never cancelled"
            await asyncio.sleep(0.05)
        assert s.reaped and not mux._live
    finally:
        await c.close()
        server.close()
        for w in conns:
            w.transport.abort()
        await server.wait_closed()
