"""Probe (#20): one long-lived, multiplexed ModelStreamInfer stream vs a stream per call.

The prototype of what `WorkerClient` now does for control and prefill calls (app/rpc/mux_stream.py,
FLEXLB_GRPC_MUX), kept as the measurement that motivated it. This starts one zero-time prefill
worker, keeps one bidirectional stream open to its `prefill` model, sends every request on it with
`triton_enable_empty_final_response` (so the final flag, which our workers put on the last real
response, ends each request; workers/server/stream_end.py) and routes responses by request id; the
other arm is `WorkerClient._stream`, a stream per call (still the decode path and the
FLEXLB_GRPC_MUX=off path). The arms alternate on the same worker; then CPU per call (this process
and the worker's three) in alternating blocks.

Found with it (2026-12-01): the stream stays open while idle, and tritonserver's shutdown waits for
open streams: the worker ignored SIGTERM for 30 s (killed by the harness), so a product version
needs the client to close idle streams (or the worker to end them) before it can land. The product
retires its streams at 2 s of age and 0.5 s idle (tests/test_worker_mux.py bounds the stop).

    .venv/bin/python bench/_wb_mux_probe.py [N] [BATCH] [TOKENS]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from _harness import start_worker
from tritonclient.grpc import InferResult
from worker_cpu import cpu_by_process

from app.protocol import worker_api as W
from app.rpc.events import prefill_event
from app.rpc.tensors import bytes_tensor, infer_request, inp, prompt_input
from app.rpc.worker_client import WorkerClient, WorkerUnavailable

WORKER_ARGS = ["--profile", "formula", "--formula", "0", "--kv-handle-ttl-ms", "1"]


class MuxStream:
    """One stream, many requests: responses are routed to their request's queue by id."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.ModelStreamInfer()
        self.waiting: dict[str, asyncio.Queue[Any]] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for resp in self.call:
            q = self.waiting.get(resp.infer_response.id)
            if q is not None:
                q.put_nowait(resp)

    async def stream(self, model: str, inputs: list[Any], rid: str) -> AsyncIterator[InferResult]:
        req = infer_request(model, inputs, rid)
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting[rid] = q
        try:
            await self.call.write(req)
            while True:
                resp = await q.get()
                if resp.error_message:
                    raise WorkerUnavailable(resp.error_message)
                if resp.infer_response.outputs:
                    yield InferResult(resp.infer_response)
                final = resp.infer_response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return
        finally:
            self.waiting.pop(rid, None)

    async def close(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self.reader, 5)


def _q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[int(p * (len(s) - 1))]


async def main(n: int, size: int, length: int) -> None:
    w = start_worker("prefill", WORKER_ARGS, Path(tempfile.mkdtemp(prefix="mux-probe-")))
    client = WorkerClient(w.address)
    mux: MuxStream | None = None
    try:
        ks = await client._key_space(w.epoch, 5)
        mux = MuxStream(client._stub)
        rng = np.random.default_rng(0)

        def inputs(bid: str) -> list[Any]:
            ids = rng.integers(0, 30000, size * length, dtype=np.int32)
            reqs = [(uuid.uuid4().hex, ids[i * length : (i + 1) * length]) for i in range(size)]
            return [
                inp(W.P_BATCH_ID, bytes_tensor([bid]), "BYTES"),
                inp(W.P_EPOCH, bytes_tensor([w.epoch]), "BYTES"),
                inp(W.P_REQUEST_IDS, bytes_tensor([r for r, _ in reqs]), "BYTES"),
                prompt_input(reqs, ks, None),
                inp(W.P_INPUT_LENGTHS, np.array([len(t) for _, t in reqs], dtype=np.int32), "INT32"),
            ]

        async def one(multiplexed: bool) -> float:
            assert mux is not None
            bid = uuid.uuid4().hex
            inp = inputs(bid)
            t0 = time.monotonic()
            src = (
                mux.stream(W.PREFILL_MODEL, inp, bid)
                if multiplexed
                else client._stream(W.PREFILL_MODEL, inp, 20, request_id=bid)
            )
            events = [prefill_event(r).event async for r in src]
            assert events == ["results"], events  # zero time: accepted + results + final in one
            return (time.monotonic() - t0) * 1000

        for arm in (False, True):
            for _ in range(20):
                await one(arm)
        lat: dict[bool, list[float]] = {False: [], True: []}
        for i in range(n):
            for arm in (False, True) if i % 2 == 0 else (True, False):
                lat[arm].append(await one(arm))
        for arm, xs in lat.items():
            name = "multiplexed" if arm else "stream per call"
            print(f"{name:16s} {size}x{length}: p50 {_q(xs, 0.5):.2f} ms, p90 {_q(xs, 0.9):.2f} ms")
        for arm in (False, True, False, True):
            c0, t0 = cpu_by_process(w.pid), time.process_time()
            for _ in range(n // 2):
                await one(arm)
            c1, t1 = cpu_by_process(w.pid), time.process_time()
            per = {k: (c1[k] - c0.get(k, 0.0)) * 2000 / n for k in c1}
            name = "multiplexed" if arm else "stream per call"
            print(
                f"{name:16s} CPU ms/call: client {(t1 - t0) * 2000 / n:.2f}, "
                + ", ".join(f"{k} {v:.2f}" for k, v in per.items())
            )
    finally:
        if mux is not None:
            await mux.close()  # an open stream holds up the worker's stop (see above)
        await client.close()
        w.stop()


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:4]]
    asyncio.run(main(*(a + [400, 1, 1024][len(a) :])))
