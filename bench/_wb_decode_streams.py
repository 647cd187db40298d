"""Probe (#20): decode calls on a stream each vs on reused long-lived streams, one decode at a time.

What `WorkerClient` does for decode with FLEXLB_GRPC_MUX_DECODE (app/rpc/mux_stream.py,
`one_each`) against the stream per call it replaced (FLEXLB_GRPC_MUX_DECODE=off). One decode
worker at zero modelled time (as bench/gateway_overhead.py starts them), two clients of the product
(`WorkerClient(..., decode_mux=False/True)`), each decode `TOKENS` new tokens read to its finish.
Sequential: latency per call, arms alternating call by call; then this process's CPU per call and
the worker's (PyTriton, tritonserver, Python-backend stub) in alternating blocks. Concurrent: the
same with `CLIENTS` decodes in flight at once (rounds of CLIENTS calls), latency per call and
CPU per call.

    .venv/bin/python bench/_wb_decode_streams.py [N] [CLIENTS] [TOKENS]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _gw_cluster import start_gateway_workers  # bench/ is sys.path[0] when run as a script
from worker_cpu import cpu_by_process

from app.rpc.worker_client import WorkerClient

ARMS = {False: "stream per call", True: "reused streams"}


def _q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[int(p * (len(s) - 1))]


async def main(n: int, clients: int, tokens: int) -> None:
    (w,) = start_gateway_workers(["decode"], Path(tempfile.mkdtemp(prefix="decode-streams-")))
    addr, epoch = w.info["address"], w.info["epoch"]
    cs = {arm: WorkerClient(addr, mux=True, decode_mux=arm) for arm in ARMS}
    try:

        async def one(arm: bool) -> float:
            rid = uuid.uuid4().hex
            t0 = time.perf_counter()
            last = ""
            async for ev in cs[arm].decode(rid, epoch, 1000, tokens, timeout=10):
                last = ev.event
            assert last == "finish", last
            return (time.perf_counter() - t0) * 1000

        async def wave(arm: bool) -> list[float]:
            return list(await asyncio.gather(*(one(arm) for _ in range(clients))))

        for arm in ARMS:  # warm-up: the channel, first-call costs, the pool's streams
            for _ in range(20):
                await one(arm)
            await wave(arm)

        for label, run, per in (("sequential", one, 1), (f"{clients} concurrent", wave, clients)):
            lat: dict[bool, list[float]] = {False: [], True: []}
            rounds = max(2, n // per)
            for i in range(rounds):
                for arm in (False, True) if i % 2 == 0 else (True, False):
                    got = await run(arm)
                    lat[arm].extend(got if isinstance(got, list) else [got])
            cpu: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for arm in (False, True, False, True):
                c0, t0 = cpu_by_process(w.pid), time.process_time()
                for _ in range(rounds // 2):
                    await run(arm)
                c1, t1 = cpu_by_process(w.pid), time.process_time()
                calls = (rounds // 2) * per
                row = {k: (c1[k] - c0.get(k, 0.0)) * 1000 / calls for k in c1}
                row["client"] = (t1 - t0) * 1000 / calls
                cpu[arm].append(row)
            for arm, name in ARMS.items():
                rows = cpu[arm]
                mean = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in rows[0]}
                print(
                    f"{label:14s} {name:16s} p50 {_q(lat[arm], 0.5):.2f} ms, p90 {_q(lat[arm], 0.9):.2f} ms; "
                    "CPU ms/call: " + ", ".join(f"{k} {v:.2f}" for k, v in mean.items())
                )
        print("streams opened by the reused arm:", cs[True]._mux["decode"].opened)
    finally:
        for c in cs.values():
            await c.close()
        w.stop()


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:4]]
    asyncio.run(main(*(a + [400, 32, 3][len(a) :])))
