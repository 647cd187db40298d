"""CPU per call of each worker process (the PyTriton process, tritonserver, the Python-backend stub).

Starts one prefill and one decode worker at zero modelled time (as bench/gateway_overhead.py
does), then makes N sequential calls of each kind and reads the processes' CPU times before and
after: `prefill` (a batch of one 1,000-token prompt), `control_release` (one control call),
`decode_nokv` (3 new tokens) and `prefill+decode_kv` (what one gateway request costs the workers:
a prefill, then a decode that claims that KV from the prefill worker). Sequential on purpose: CPU
per call, not throughput. Prints one line per kind; ms of CPU per call by process.

    .venv/bin/python bench/worker_cpu.py [N]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import psutil
from _gw_cluster import start_gateway_workers  # bench/ is sys.path[0] when run as a script

from app.rpc.worker_client import WorkerClient


def cpu_by_process(pid: int) -> dict[str, float]:
    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            name = p.name()
            key = "pytriton" if p.pid == pid else "tritonserver" if "tritonserver" in name else "stub"
            t = p.cpu_times()
            out[key] = out.get(key, 0.0) + t.user + t.system
        except psutil.Error:
            pass
    return out


async def main(n: int) -> None:
    pw, dw = start_gateway_workers(["prefill", "decode"], Path(tempfile.mkdtemp(prefix="worker-cpu-")))
    try:
        pa, pe, de = pw.info["address"], pw.info["epoch"], dw.info["epoch"]
        pc, dc = WorkerClient(pa), WorkerClient(dw.info["address"])
        rng = np.random.default_rng(0)
        prompt = rng.integers(32, 127, 1000).astype(np.int32)

        async def prefill(rid: str) -> None:
            async for _ in pc.prefill(f"b-{rid}", pe, [(rid, prompt)], timeout=10):
                pass

        async def control(rid: str) -> None:
            await pc.control({"op": "release", "request_id": rid, "epoch": pe}, timeout=5)

        async def decode_nokv(rid: str) -> None:
            async for _ in dc.decode(rid, de, 1000, 3, timeout=10):
                pass

        async def decode_kv(rid: str) -> None:
            await prefill(rid)
            async for _ in dc.decode(rid, de, 1000, 3, kv_worker=pa, kv_epoch=pe, timeout=10):
                pass

        kinds: dict[str, Callable[[str], Awaitable[None]]] = {
            "prefill": prefill,
            "control_release": control,
            "decode_nokv": decode_nokv,
            "prefill+decode_kv": decode_kv,
        }
        for name, fn in kinds.items():
            for i in range(20):  # warm-up: channels, the side connection, first-call costs
                await fn(f"warm-{name}-{i}-{uuid.uuid4().hex[:6]}")
            before = (cpu_by_process(pw.pid), cpu_by_process(dw.pid))
            t0 = time.perf_counter()
            for i in range(n):
                await fn(f"{name}-{i}-{uuid.uuid4().hex[:6]}")
            wall = (time.perf_counter() - t0) * 1000 / n
            after = (cpu_by_process(pw.pid), cpu_by_process(dw.pid))
            parts = []
            total = 0.0
            for role, a, b in (("prefill", before[0], after[0]), ("decode", before[1], after[1])):
                per = {k: (b[k] - a.get(k, 0.0)) * 1000 / n for k in b}
                total += sum(per.values())
                parts.append(f"{role} " + " ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
            print(f"{name:18s} wall {wall:6.2f} ms/call | CPU {total:5.2f} ms/call | " + " | ".join(parts))
        await pc.close()
        await dc.close()
    finally:
        pw.stop()
        dw.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
