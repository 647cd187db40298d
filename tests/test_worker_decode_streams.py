"""Decode calls on long-lived, reused gRPC streams that carry one decode at a time (issue #20,
app/rpc/mux_stream.py with `one_each`, FLEXLB_GRPC_MUX_DECODE), against real Triton workers:
reuse one after the other, a stream per decode in flight (no decode's tokens queue behind
another's), an abandoned decode keeping its stream until its final response, an error ending only
its call, a deadline retiring its stream, a killed worker failing the decode in flight, and a
decode worker's SIGTERM stop bounded as with a stream per call."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from app.protocol import worker_api as W
from app.rpc import mux_stream
from app.rpc.mux_stream import StreamMux
from app.rpc.tensors import bytes_tensor, inp
from app.rpc.worker_client import DecodeEvent, WorkerClient, WorkerUnavailable
from workers.engine.tokens import output_tokens

from .conftest import back_on_its_port, start_worker
from .test_worker_triton import collect_decode, uid


def pool_of(c: WorkerClient) -> StreamMux:
    return c._mux[W.DECODE_MODEL]


async def until(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Bounded poll on the event loop."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.01)


def tokens_of(evs: list[DecodeEvent]) -> list[int]:
    return [t for ev in evs if ev.event == "tokens" for t in ev.tokens]


async def test_decodes_one_after_another_reuse_one_stream(clients) -> None:
    d = clients["decode"][0]
    assert W.DECODE_MODEL in d._mux, "decode streams are reused by default"
    await d.configure(profile="formula", formula="1", time_scale=0.05)
    epoch = (await d.status())["epoch"]
    before = pool_of(d).opened
    t0 = time.monotonic()
    for n in range(6):
        rid = f"seq{n}-" + uid()
        evs = await collect_decode(d, rid, epoch, 100, 20)
        assert tokens_of(evs) == output_tokens(0, rid, 1, 20)
        assert evs[-1].finish_reason == "length"
    rotations = int((time.monotonic() - t0) / mux_stream.MAX_AGE_S)
    assert pool_of(d).opened - before <= 1 + rotations


async def test_concurrent_decodes_each_have_a_stream_and_run_side_by_side(clients) -> None:
    """Each decode in flight has a stream to itself (sampled all along), so no decode's responses
    wait behind another's on a shared flow-control window; and the engine ran them side by side:
    in its modelled time every decode started before any ended."""
    d = clients["decode"][0]
    await d.configure(profile="formula", formula="1", time_scale=1.0)
    epoch = (await d.status())["epoch"]
    n, new = 8, 100
    most_on_one, most_busy = 0, 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal most_on_one, most_busy
        while not done.is_set():
            busy = [len(s.waiting) for s in pool_of(d)._open if s.waiting]
            most_on_one = max([most_on_one, *busy])
            most_busy = max(most_busy, len(busy))
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    rids = [f"par{k}-" + uid() for k in range(n)]
    try:
        runs = await asyncio.gather(*(collect_decode(d, rid, epoch, 100, new) for rid in rids))
    finally:
        done.set()
        await sampler
    for rid, evs in zip(rids, runs, strict=True):
        assert tokens_of(evs) == output_tokens(0, rid, 1, new)
    assert most_on_one == 1, "a decode stream carried two decodes at once"
    assert most_busy == n
    first = [next(ev.t_first_ms for ev in evs if ev.event == "tokens") for evs in runs]
    last = [evs[-1].t_last_ms for evs in runs]
    assert max(first) < min(last), "a decode started on the engine only after another ended"


async def test_an_abandoned_decode_keeps_its_stream_until_its_final_response(clients) -> None:
    """A caller that stops listening (client gone) leaves its decode running on the engine: its
    stream is not handed to the next decode while its tokens still come, and is given back once
    its final response (here the explicit cancel's `finish`) has arrived."""
    d = clients["decode"][0]
    await d.configure(profile="formula", formula="1", time_scale=1.0)
    epoch = (await d.status())["epoch"]
    await collect_decode(d, "warm-" + uid(), epoch, 10, 2)  # one idle stream in the pool
    pool = pool_of(d)
    gone = "gone-" + uid()
    got: list[DecodeEvent] = []

    async def consume() -> None:
        async for ev in d.decode(gone, epoch, 100, 10_000, timeout=60):
            got.append(ev)

    task = asyncio.create_task(consume())
    await until(lambda: bool(got), 10, "the first tokens")
    held = [s for s in pool._open if gone in next(iter(s.waiting), "")]
    assert len(held) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (s,) = held
    assert s.open and list(s.waiting.values()) == [None]  # abandoned, still in flight
    opened = pool.opened
    rid = "next-" + uid()
    evs = await collect_decode(d, rid, epoch, 100, 30)
    assert tokens_of(evs) == output_tokens(0, rid, 1, 30)  # none of the abandoned call's
    assert pool.opened == opened + 1, "the next decode got the abandoned call's stream"
    assert s.waiting, "the abandoned call left its stream before its end"
    assert (await d.cancel(gone))["result"] == "cancelled"
    await until(lambda: not s.waiting, 10, "the abandoned call's final response")
    assert s.open
    opened = pool.opened
    rid = "after-" + uid()
    evs = await collect_decode(d, rid, epoch, 100, 30)
    assert tokens_of(evs) == output_tokens(0, rid, 1, 30)
    assert pool.opened == opened  # an idle stream (maybe that one) carried it
    assert (await d.status())["running"] == 0


async def test_an_error_response_ends_only_its_decode_and_the_stream_is_reused(clients) -> None:
    d = clients["decode"][0]
    await d.configure(profile="formula", formula="1", time_scale=0.05)
    epoch = (await d.status())["epoch"]
    await collect_decode(d, "warm-" + uid(), epoch, 10, 2)
    opened = pool_of(d).opened
    bad = [
        inp(W.D_REQUEST_ID, bytes_tensor(["bad-" + uid()]), "BYTES"),
        inp(W.D_EPOCH, bytes_tensor([epoch]), "BYTES"),
        inp(W.D_INPUT_TOKENS, np.array([1.0], dtype=np.float32), "FP32"),  # Triton refuses it
    ]
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailable, match=r"(?i)data-type|FP32"):
        async for _ in d._call(W.DECODE_MODEL, bad, timeout=5):
            raise AssertionError("no response expected")
    assert time.monotonic() - t0 < 2  # ended by the error response, not by the deadline
    rid = "ok-" + uid()
    evs = await collect_decode(d, rid, epoch, 100, 10)
    assert tokens_of(evs) == output_tokens(0, rid, 1, 10)
    assert pool_of(d).opened == opened  # the errored call's stream was free again


async def test_a_decode_past_its_deadline_fails_timed_out_and_retires_its_stream(clients) -> None:
    d = clients["decode"][0]
    await d.configure(profile="formula", formula="1", time_scale=1.0)
    epoch = (await d.status())["epoch"]
    rid = "late-" + uid()
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailable) as info:
        async for _ in d.decode(rid, epoch, 100, 10_000, timeout=0.5):
            pass
    assert info.value.timed_out and time.monotonic() - t0 < 5
    (s,) = [s for s in pool_of(d)._live if rid in next(iter(s.waiting), "")]
    assert not s.open  # retired: the next decode opens a fresh stream
    assert (await d.cancel(rid))["result"] == "cancelled"
    await asyncio.wait_for(s.reader, 10)  # the cancel's finish ended it, and the stream with it
    ok = "ok-" + uid()
    assert tokens_of(await collect_decode(d, ok, epoch, 100, 5)) == output_tokens(0, ok, 1, 5)


def test_a_killed_decode_worker_fails_its_decode_and_a_stopping_one_is_not_held(worker_tmp: Path) -> None:
    """Dedicated workers (one is killed, its successor stopped): the decode in flight fails with
    `WorkerUnavailable` within a second of the kill; after a restart on the same port the same
    client decodes again; SIGTERM with a decode in flight and an idle stream in the pool stops the
    worker within 10 s, an unpolled worker's bound (test_worker_triton's SIGTERM case): the idle
    stream is half-closed at `IDLE_S` and a stopping worker ends its decode at once. Measured at
    load 7-15: 5.2 s, and 5.2 s with a stream per decode call (`decode_mux=False`)."""
    w = start_worker("decode", worker_tmp, "--profile", "formula", "--formula", "1")
    port = w.ready["grpc_port"]
    w2 = None

    async def run() -> None:
        nonlocal w2
        c = WorkerClient(w.address, mux=True, decode_mux=True)
        try:
            epoch = (await c.status())["epoch"]
            got: list[DecodeEvent] = []

            async def long(rid: str, e: str) -> None:
                async for ev in c.decode(rid, e, 100, 100_000):  # no deadline: the stream bounds it
                    got.append(ev)

            call = asyncio.create_task(long("k-" + uid(), epoch))
            await until(lambda: bool(got), 10, "the first tokens")
            t0 = time.monotonic()
            w.kill_hard()
            with pytest.raises(WorkerUnavailable):
                await asyncio.wait_for(call, 5)
            assert time.monotonic() - t0 < 1.0
            w2, e2 = await back_on_its_port("decode", worker_tmp, port, c, epoch)
            rids = ["a-" + uid(), "b-" + uid()]  # two streams in the pool
            runs = await asyncio.gather(*(collect_decode(c, rid, e2, 100, 5) for rid in rids))
            assert [tokens_of(evs) for evs in runs] == [output_tokens(0, rid, 1, 5) for rid in rids]
            assert pool_of(c).opened >= 3
            got.clear()
            call = asyncio.create_task(long("s-" + uid(), e2))  # on one; the other stays idle
            await until(lambda: bool(got), 10, "the first tokens")
            t0 = time.monotonic()
            w2.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(w2.proc.wait, 25)
            took = time.monotonic() - t0
            try:
                await asyncio.wait_for(call, 5)
                assert got[-1].event == "finish" and got[-1].finish_reason == "engine_error"
            except WorkerUnavailable:
                pass  # the stream broke under it as the worker went: also an ended call
            assert rc == 0
            assert took < 10, f"stop took {took:.1f} s with reused decode streams"
        finally:
            await c.close()

    try:
        asyncio.run(run())
    finally:
        w.stop()
        if w2 is not None:
            w2.stop()
