"""(d) The direct path: one request straight to the workers (prefill, then decode claiming that KV),
through the Triton workers vs through the HTTP facades (workers/http_facade) over the same engine
core, both at zero modelled time. Answers issue #20's "direct path within 2x the facade's".

The Triton request is what a gateway's owner and origin do, minus the gateway: `prefill` until its
`results` (the stream's end drained beside it), then `decode` of max_new - 1 tokens with the KV
claimed over the side channel. The facade request is vLLM-router's P/D flow: a prefill
`/v1/completions` with `max_tokens: 1` and `do_remote_decode`, then the decode one with the
answer's `kv_transfer_params` (the decode facade fetches and releases the KV on the prefill
facade: two more HTTP exchanges). Sequential requests, so the figures are latency, not capacity;
CPU per request is summed over each side's processes (for Triton: PyTriton, tritonserver, stubs).

    .venv/bin/python bench/workers_bench.py --sections paths
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _harness import CpuMeter, Proc, console, pct, r2, start_workers

from app.netports import free_port
from app.rpc.worker_client import WorkerClient

# as bench/_gw_cluster.py's workers; a handle waits 10,000 s (30 modelled s at this scale is 30 ms)
ZERO_TIME = [
    "--profile",
    "formula",
    "--formula",
    "0",
    "--time-scale",
    "0.001",
    "--kv-handle-ttl-ms",
    "10000000",
]
WARMUP = 20


async def _triton_one(pc: WorkerClient, pe: str, pa: str, dc: WorkerClient, de: str, ids: np.ndarray) -> str:
    rid = uuid.uuid4().hex[:12]
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[str, str]] = loop.create_future()

    async def run_prefill() -> None:
        async for ev in pc.prefill(f"b-{rid}", pe, [(rid, ids)], timeout=30):
            if ev.event == "results" and not got.done():
                got.set_result((ev.results[0]["status"], ev.epoch))
            elif ev.event == "error" and not got.done():
                got.set_result((ev.error, ""))
        if not got.done():
            got.set_result(("no result", ""))

    ptask = asyncio.create_task(run_prefill())
    status, kv_epoch = await got
    if status != "ok":
        await ptask
        return status
    n, finish = 0, ""
    async for ev in dc.decode(rid, de, len(ids), 3, kv_worker=pa, kv_epoch=kv_epoch, timeout=30):
        if ev.event == "tokens":
            n += len(ev.tokens)
        else:
            finish = ev.finish_reason
    await ptask
    return "ok" if finish == "length" and n == 3 else f"decode {finish} {n}"


async def _facade_one(http: httpx.AsyncClient, p_url: str, d_url: str, ids: list[int]) -> str:
    body = {
        "model": "flexlb-sim",
        "prompt": ids,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    r = await http.post(f"{p_url}/v1/completions", json=body)
    if r.status_code != 200:
        return f"prefill {r.status_code}"
    ktp = r.json()["kv_transfer_params"]
    r = await http.post(f"{d_url}/v1/completions", json={**body, "max_tokens": 4, "kv_transfer_params": ktp})
    return "ok" if r.status_code == 200 else f"decode {r.status_code}"


def _start_facades(log_dir: Path) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    for role in ("prefill", "decode"):
        port = free_port()
        extra = ["--bootstrap-port", str(free_port())] if role == "prefill" else []
        log = open(log_dir / f"facade-{role}.log", "w")  # noqa: SIM115 - the child owns it
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "workers.http_facade",
                    "--role",
                    role,
                    "--port",
                    str(port),
                    *extra,
                    *ZERO_TIME,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    for role, p in zip(("prefill", "decode"), procs, strict=True):
        path = log_dir / f"facade-{role}.log"
        for _ in range(600):
            if "facade_ready" in path.read_text() or p.poll() is not None:
                break
            time.sleep(0.1)
        if "facade_ready" not in path.read_text():
            for q in procs:
                q.terminate()
            raise RuntimeError(f"{role} facade did not start: {path.read_text()[-500:]}")
    return procs, urls[0], urls[1]


async def _timed(n: int, one: Any, pids: list[int]) -> dict[str, Any]:
    for _ in range(WARMUP):
        await one()
    meter = CpuMeter(pids, tree=True)
    c0 = meter.seconds()
    lat: list[float] = []
    bad: dict[str, int] = {}
    for _ in range(n):
        t = time.perf_counter()
        code = await one()
        lat.append((time.perf_counter() - t) * 1000)
        if code != "ok":
            bad[code] = bad.get(code, 0) + 1
    cpu = (meter.seconds() - c0) * 1000 / n
    return {
        "requests": n,
        "p50_ms": r2(pct(lat, 50)),
        "p99_ms": r2(pct(lat, 99)),
        "mean_ms": r2(sum(lat) / len(lat)),
        "server_cpu_ms_per_request": r2(cpu),
        "not_ok": bad,
    }


async def _measure(
    n: int, prompt_len: int, tw: list[Proc], facades: tuple[list[int], str, str]
) -> dict[str, Any]:
    ids = np.random.default_rng(5).integers(32, 127, prompt_len).astype(np.int32)
    pw, dw = tw
    pc, dc = WorkerClient(pw.address), WorkerClient(dw.address)
    f_pids, p_url, d_url = facades
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "new_tokens": 4}
    try:
        async with httpx.AsyncClient(timeout=30) as http:

            async def triton() -> str:
                return await _triton_one(pc, pw.epoch, pw.address, dc, dw.epoch, ids)

            async def facade() -> str:
                # a fresh prompt per request for both paths would change nothing: zero modelled time
                return await _facade_one(http, p_url, d_url, ids.tolist())

            out["triton"] = await _timed(n, triton, [pw.pid, dw.pid])
            out["facade"] = await _timed(n, facade, f_pids)
    finally:
        await pc.close()
        await dc.close()
    out["ratio_p50"] = r2(out["triton"]["p50_ms"] / max(out["facade"]["p50_ms"], 1e-9))
    out["target_ratio"] = 2.0
    out["meets_target"] = bool(out["ratio_p50"] <= 2.0)
    return out


def direct_paths(log_dir: Path, n: int = 300, prompt_len: int = 1000) -> dict[str, Any]:
    """Start 1 + 1 Triton workers and 1 + 1 facades (zero modelled time), measure, stop them all."""
    workers: list[Proc] = []
    fprocs: list[subprocess.Popen[bytes]] = []
    try:
        workers = start_workers([(r, ZERO_TIME) for r in ("prefill", "decode")], log_dir)
        fprocs, p_url, d_url = _start_facades(log_dir)
        res = asyncio.run(_measure(n, prompt_len, workers, ([p.pid for p in fprocs], p_url, d_url)))
        res["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        console.print(
            f"  direct path p50: triton {res['triton']['p50_ms']} ms, facade {res['facade']['p50_ms']} ms "
            f"(x{res['ratio_p50']}); server CPU/request {res['triton']['server_cpu_ms_per_request']} / "
            f"{res['facade']['server_cpu_ms_per_request']} ms"
        )
        console.print(json.dumps({k: res[k] for k in ("triton", "facade")}))
        return res
    finally:
        for p in fprocs:
            p.terminate()
        for p in fprocs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for w in workers:
            w.stop()
