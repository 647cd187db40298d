"""A decode in flight when its worker's *process* dies (SIGKILL of that pid alone: an OOM kill, a
supervisor that signals only the pid it started, bench/soak_faults.py's `killw`) must fail fast.

The worker's tritonserver is PyTriton's child with PR_SET_PDEATHSIG=SIGTERM, so it outlives the
worker for its graceful stop, and that stop waits for the in-flight requests, which the dead
worker's infer function will never answer: the gRPC stream stays open and the decode waited for
its full deadline (the soak's one `504` of 7,646 requests, docs/benchmarks.md "Soak with faults";
measured here before the fix: 20.0 s, the deadline, with the old Triton server holding the port
~50 s). Both decode arms: a stream per call and reused decode streams (FLEXLB_GRPC_MUX_DECODE)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from app.protocol import worker_api as W
from app.rpc import mux_stream
from app.rpc.worker_client import DecodeEvent, WorkerClient, WorkerUnavailable

from .conftest import start_worker
from .test_worker_decode_streams import until
from .test_worker_triton import uid

DEADLINE_S = 20.0  # the decodes' own deadline: what they waited before the fix
FAIL_FAST_S = 5.0


def test_decodes_in_flight_fail_fast_when_the_worker_process_alone_is_killed(worker_tmp: Path) -> None:
    w = start_worker("decode", worker_tmp, "--profile", "formula", "--formula", "1")

    async def run() -> None:
        per_call = WorkerClient(w.address, mux=True, decode_mux=False)
        reused = WorkerClient(w.address, mux=True, decode_mux=True)
        try:
            epoch = (await per_call.status())["epoch"]
            got: dict[str, list[DecodeEvent]] = {"per_call": [], "reused": []}
            ended: dict[str, float] = {}

            async def long(name: str, c: WorkerClient) -> None:
                try:
                    async for ev in c.decode("k-" + uid(), epoch, 100, 100_000, timeout=DEADLINE_S):
                        got[name].append(ev)
                finally:
                    ended[name] = time.monotonic()

            calls = {
                "per_call": asyncio.create_task(long("per_call", per_call)),
                "reused": asyncio.create_task(long("reused", reused)),
            }
            await until(lambda: all(got.values()), 15, "the first tokens of both decodes")
            t0 = time.monotonic()
            os.kill(w.proc.pid, signal.SIGKILL)  # the worker process only, not its group
            for name, call in calls.items():
                with pytest.raises(WorkerUnavailable) as err:
                    await asyncio.wait_for(call, DEADLINE_S + 5)
                took = ended[name] - t0
                assert not err.value.timed_out, (name, took, str(err.value))
                assert took < FAIL_FAST_S, (name, took, str(err.value))
        finally:
            await per_call.close()
            await reused.close()

    try:
        asyncio.run(run())
    finally:
        w.kill_hard() if w.proc.poll() is None else _reap(w.proc.pid)


def _reap(pgid: int) -> None:
    """SIGKILL what is left of the worker's group (its Triton server and stubs): test cleanup."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def test_a_broken_shared_stream_fails_its_calls_past_an_abandoned_one(
    worker_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared control stream carrying an abandoned call (its caller cancelled: the entry stays,
    empty, until the call's end) and a live one breaks when the worker is killed: the live call
    fails at once. Before, the stream's failure stopped at the abandoned entry (AttributeError in
    its reader), so the calls after it waited for their deadline, or for ever without one."""
    monkeypatch.setattr(mux_stream, "MAX_AGE_S", 60.0)  # both calls must land on one stream
    monkeypatch.setattr(mux_stream, "IDLE_S", 60.0)
    w = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "1", "--allow-faults")

    async def run() -> None:
        c = WorkerClient(w.address, mux=True)
        try:
            assert (await c.configure(faults={"hang": True}))["ok"]  # status calls now never answer
            mux = c._mux[W.CONTROL_MODEL]
            (s,) = [x for x in mux._live if x.open]
            abandoned = asyncio.create_task(c.status(timeout=None))
            await until(lambda: len(s.waiting) == 1, 5, "the first call on the stream")
            abandoned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await abandoned
            assert list(s.waiting.values()) == [None]  # abandoned, still in flight
            live = asyncio.create_task(c.status(timeout=None))
            await until(lambda: len(s.waiting) == 2, 5, "the second call on the same stream")
            t0 = time.monotonic()
            w.kill_hard()
            with pytest.raises(WorkerUnavailable):
                await asyncio.wait_for(live, 10)
            assert time.monotonic() - t0 < FAIL_FAST_S
        finally:
            await c.close()

    try:
        asyncio.run(run())
    finally:
        w.kill_hard() if w.proc.poll() is None else None
