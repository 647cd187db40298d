"""What tenants and their limits cost, and what they protect (issue 16).

1. Cost: one replica with `FLEXLB_AUTH=keys` in front of real (formula-profile) workers, three
   tenants taking turns in rounds of sequential requests: `free` (no limits: the key lookup only,
   cached), `limited` (requests/s and tokens/min, never reached: the round trip runs inside the
   limit's GATE script) and `concurrent` (+ the concurrency slot, given back with the next
   admission). Per tenant: client latency p50, the origin overhead p50/p99 (the gateway's own
   samples, arrival -> hand-off appended, which now includes the limit check) and Redis commands
   per request (the gateway's own `commands_total`, net of its idle rate).
2. Protection: two tenants with the same limit (`--limit` req/s); `calm` sends at half of it, `hog`
   at 0, 1x and 5x of it. Calm's latency p50/p99 in each run: 5x against 1x is what the refused
   excess costs the other tenant (the admitted 1x is real work either way).

    .venv/bin/python bench/tenant_limits.py [--rounds 6] [--per-round 50] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _gw_cluster import Gateway, Proc, start_gateway, start_gateway_workers, wait_for  # bench/ on sys.path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "x" * 200


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 3) if xs else float("nan")


def add_key(gw: Gateway, tenant: str, **limits: Any) -> str:
    r = gw.post("/admin/keys", {"tenant": tenant, **limits})
    r.raise_for_status()
    return str(r.json()["key"])


def commands(gw: Gateway) -> int:
    return int(gw.stats()["redis_commands_total"])


def cost_phase(gw: Gateway, keys: dict[str, str], rounds: int, per_round: int) -> dict[str, Any]:
    lat: dict[str, list[float]] = {t: [] for t in keys}
    cmds: dict[str, list[float]] = {t: [] for t in keys}
    origin: dict[str, list[float]] = {t: [] for t in keys}  # arrival -> hand-off appended, ms
    t0, c0 = time.monotonic(), commands(gw)
    time.sleep(3.0)
    idle_rate = (commands(gw) - c0) / (time.monotonic() - t0)  # background loops, per second
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for _ in range(rounds):
            for tenant, key in keys.items():
                headers = {"Authorization": f"Bearer {key}"}
                body = {"prompt": PROMPT, "max_new_tokens": 2, "deadline_ms": 60_000}  # no SLO refusals
                gw.post("/admin/stats/reset", {})  # this round's origin samples only
                start, c_start = time.monotonic(), commands(gw)
                for _ in range(per_round):
                    s = time.perf_counter()
                    res = client.post("/v1/generate", json=body, headers=headers)
                    lat[tenant].append((time.perf_counter() - s) * 1000)
                    if res.status_code != 200:
                        raise RuntimeError(f"{tenant}: {res.status_code} {res.text[:200]}")
                elapsed = time.monotonic() - start
                net = commands(gw) - c_start - idle_rate * elapsed
                cmds[tenant].append(net / per_round)
                samples = gw.post("/admin/stats/reset", {}).json()["samples"]["origin_overhead_s"]
                origin[tenant] += [x * 1000 for x in samples]
    return {
        "idle_cmds_per_s": round(idle_rate, 1),
        "tenants": {
            t: {
                "n": len(lat[t]),
                "latency_p50_ms": pct(lat[t], 50),
                "latency_p99_ms": pct(lat[t], 99),
                "redis_cmds_per_req_net": round(float(np.median(cmds[t])), 2),
                "origin_p50_ms": pct(origin[t], 50),
                "origin_p99_ms": pct(origin[t], 99),
            }
            for t in keys
        },
    }


async def _open_loop(
    url: str,
    key: str,
    rate: float,
    seconds: float,
    out: dict[str, list[float]],
    ttft: list[float] | None = None,
) -> None:
    """`rate` requests/s for `seconds`, open loop; latency per answer code into `out`, and the
    gateway's own time to first token (`timings.first_token_ms`) of each 200 into `ttft`."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt": PROMPT, "max_new_tokens": 2, "deadline_ms": 60_000}  # no SLO refusals
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=200)) as c:

        async def one() -> None:
            s = time.perf_counter()
            try:
                res = await c.post("/v1/generate", json=body, headers=headers)
                code = "ok" if res.status_code == 200 else res.json()["error"]["code"]
                if code == "ok" and ttft is not None:
                    ttft.append(float(res.json()["timings"]["first_token_ms"]))
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            out.setdefault(code, []).append((time.perf_counter() - s) * 1000)

        tasks = []
        t0 = time.perf_counter()
        i = 0
        while (at := i / rate) < seconds:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
            i += 1
        await asyncio.gather(*tasks)
        out["_span_s"] = [time.perf_counter() - t0]  # sending to the last answer: stretched when overloaded


def _hog_process(url: str, key: str, rate: float, seconds: float, q: Any) -> None:
    """The hog's load generator in a process of its own: in the calm client's event loop, its
    hundreds of requests/s delayed the calm client's own sends and reads (client-side latency
    that no gateway caused)."""
    out: dict[str, list[float]] = {}
    asyncio.run(_open_loop(url, key, rate, seconds, out))
    q.put(out)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def refusal_cost(gw: Gateway, n: int = 400) -> dict[str, Any]:
    """What one request costs the gateway (CPU ms, Redis commands), admitted vs refused at the
    door: `n` sequential requests each of a tenant without limits and of one whose bucket is empty
    (0.01 req/s: every request after the first is refused at the door). CPU time, not wall time,
    so a loaded box inflates it little."""
    free, shut = add_key(gw, "cost-free"), add_key(gw, "cost-shut", rps=0.01)
    time.sleep(0.5)
    out: dict[str, Any] = {}
    body = {"prompt": PROMPT, "max_new_tokens": 2, "deadline_ms": 60_000}
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for label, key in (("admitted", free), ("refused", shut)):
            headers = {"Authorization": f"Bearer {key}"}
            client.post("/v1/generate", json=body, headers=headers)  # warm-up; takes shut's token
            t0, cpu0, c0 = time.monotonic(), _cpu_s(gw.proc.pid), commands(gw)
            codes: dict[int, int] = {}
            for _ in range(n):
                res = client.post("/v1/generate", json=body, headers=headers)
                codes[res.status_code] = codes.get(res.status_code, 0) + 1
            wall = time.monotonic() - t0
            out[label] = {
                "codes": codes,
                "gateway_cpu_ms_per_req": round((_cpu_s(gw.proc.pid) - cpu0) * 1000 / n, 2),
                "redis_cmds_per_req": round((commands(gw) - c0) / n, 2),  # idle loops included
                "wall_s": round(wall, 1),
            }
    return out


def overload_phase(gw: Gateway, limit: float, seconds: float) -> dict[str, Any]:
    calm, hog = add_key(gw, "calm", rps=limit), add_key(gw, "hog", rps=limit)
    time.sleep(0.5)  # runtime config applied (poll interval 200 ms)
    out: dict[str, Any] = {"per_request_cost": refusal_cost(gw)}
    print(json.dumps(out, indent=1))
    runs = (("hog silent", 0.0), ("hog at its limit", limit), ("hog at 5x its limit", 5 * limit))
    ctx = mp.get_context("spawn")
    for label, hog_rate in runs:
        calm_res: dict[str, list[float]] = {}
        ttft: list[float] = []
        hog_res: dict[str, list[float]] = {}
        q = ctx.Queue()
        proc = (
            ctx.Process(target=_hog_process, args=(gw.url, hog, hog_rate, seconds, q)) if hog_rate else None
        )
        load = os.getloadavg()[0]
        cpu0, c0 = _cpu_s(gw.proc.pid), commands(gw)
        if proc is not None:
            proc.start()
        asyncio.run(_open_loop(gw.url, calm, limit / 2, seconds, calm_res, ttft))
        if proc is not None:
            hog_res = q.get(timeout=seconds + 60)
            proc.join(10)
        cpu, cmds = _cpu_s(gw.proc.pid) - cpu0, commands(gw) - c0
        ok = calm_res.get("ok", [])
        refused = len(hog_res.get("rate_limited", []))
        out[label] = {
            "load_avg_1m": round(load, 1),
            "calm": {code: len(v) for code, v in calm_res.items() if code != "_span_s"},
            "span_s": round(calm_res["_span_s"][0], 1),
            "calm_p50_ms": pct(ok, 50),
            "calm_p99_ms": pct(ok, 99),
            # the gateway's own arrival -> first token of calm's requests: what the gateway and
            # the workers did to them, without the client's side
            "calm_server_ttft_p50_ms": pct(ttft, 50),
            "calm_server_ttft_p99_ms": pct(ttft, 99),
            "hog": {code: len(v) for code, v in hog_res.items() if code != "_span_s"},
            # the limit holds per second of the run as the gateway saw it (longer than planned
            # when the box cannot keep up): admitted / span should be <= the limit + its burst
            "hog_admitted_per_s": round(len(hog_res.get("ok", [])) / hog_res["_span_s"][0], 1)
            if hog_res
            else None,
            "hog_429_p50_ms": pct(hog_res.get("rate_limited", []), 50),
            "gateway_cpu_s": round(cpu, 2),
            "redis_cmds": cmds,
            "hog_refused": refused,
        }
        time.sleep(1.5)  # buckets refill between the runs
    return out


def roundtrip_phase(redis_url: str, prefix: str, n: int) -> dict[str, Any]:
    """The origin's first round trip alone, on the same Redis, alternating: the plain pipeline
    (SADD live set, CREATE_REQUEST, RESERVE, HANDOFF: 4 commands) and the same inside the limit's
    GATE (1 command). What the limit adds to the origin overhead, without the gateway's noise."""
    import redis.asyncio as aioredis

    from app.security.apikeys import Limits
    from app.security.ratelimit import Limiter
    from app.state.keys import Keys
    from app.state.store import StateStore

    async def go() -> dict[str, Any]:
        r = aioredis.from_url(redis_url)
        k = Keys(prefix)
        store = StateStore(r, k)
        lim = Limiter(store, prefix)
        limits = Limits(rps=1e6, tpm=10**12, max_concurrent=10**6)
        meta = json.dumps({"rid": "x", "origin": "o", "pred": 1.0, "deadline": 0, "t": 0.0})
        qkeys, ids = [k.queue("p"), k.queued_ms("p"), k.ledger("p")], b"\x01\x00\x00\x00" * 200

        def trip(rid: str) -> list[list[Any]]:
            return [
                ["SADD", k.origin_requests("o"), rid],
                ["EVALSHA", store.sha("create_request"), 1, k.request(rid), "o", "endpoint", "generate"],
                ["EVALSHA", store.sha("reserve"), 1, k.reservations("d"), rid, 300, 10**9],
                ["EVALSHA", store.sha("handoff"), 3, *qkeys, 10**6, "1.0", meta, ids, "1"],
            ]

        plain: list[float] = []
        gated: list[float] = []
        try:
            for i in range(n + 50):  # the first 50 of each: warm-up (script loads)
                s = time.perf_counter()
                await store.execute_scripts(trip(f"p{i}"))
                e = time.perf_counter()
                await lim.run("t", limits, f"g{i}", 10, 60_000, trip(f"g{i}"))
                lim.release("t", f"g{i}")  # as a finished request: rides the next admission
                f = time.perf_counter()
                if i >= 50:
                    plain.append((e - s) * 1000)
                    gated.append((f - e) * 1000)
        finally:
            await r.aclose()
        return {
            "n": n,
            "plain_p50_ms": pct(plain, 50),
            "gated_p50_ms": pct(gated, 50),
            "plain_p99_ms": pct(plain, 99),
            "gated_p99_ms": pct(gated, 99),
        }

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--per-round", type=int, default=50)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--limit", type=float, default=20.0, help="both overload tenants' req/s limit")
    p.add_argument("--output", type=Path, default=None, help="write results.json here")
    p.add_argument("--phase", choices=("all", "cost", "overload", "roundtrip"), default="all")
    args = p.parse_args(argv)
    from app.state.embedded_redis import start_embedded_redis

    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    log_dir = ROOT / "logs" / f"tenant-limits-{time.strftime('%Y%m%d-%H%M%S')}"
    log_dir.mkdir(parents=True, exist_ok=True)
    emb = start_embedded_redis(cluster, idle_s=600)
    procs: list[Proc] = []
    results: dict[str, Any] = {"machine": {"cores": os.cpu_count()}, "args": vars(args) | {"output": None}}
    try:
        if args.phase in ("all", "roundtrip"):
            results["roundtrip"] = roundtrip_phase(emb.url, cluster, 2000)
            print(json.dumps(results["roundtrip"], indent=1))
            if args.phase == "roundtrip":
                if args.output:
                    args.output.mkdir(parents=True, exist_ok=True)
                    (args.output / "results.json").write_text(json.dumps(results, indent=1))
                return 0
        procs += start_gateway_workers(["prefill", "decode"], log_dir)
        os.environ["FLEXLB_AUTH"] = "keys"  # read by the gateway subprocess
        gw = start_gateway(log_dir, emb.url, cluster, "bench-gw", secrets.token_urlsafe(18), "WARNING")
        procs.append(gw.proc)
        wids = ",".join(f"{w.info['role']}@{w.info['address']}" for w in procs[:2])
        gw.post("/admin/workers", {"workers": wids}).raise_for_status()
        wait_for(lambda: gw.get("/readyz").status_code == 200, 60, "gateway ready")
        keys = {
            "free": add_key(gw, "free"),
            "limited": add_key(gw, "limited", rps=1e6, tpm=10**12),
            "concurrent": add_key(gw, "concurrent", rps=1e6, tpm=10**12, max_concurrent=10**6),
        }
        time.sleep(0.5)
        if args.phase in ("all", "cost"):
            results["cost"] = cost_phase(gw, keys, args.rounds, args.per_round)
            print(json.dumps(results["cost"], indent=1))
        if args.phase in ("all", "overload"):
            results["overload"] = overload_phase(gw, args.limit, args.seconds)
            print(json.dumps(results["overload"], indent=1))
    finally:
        for proc in reversed(procs):
            try:  # Proc.stop handles a process that is gone or hung; what else fails is said
                proc.stop()
            except (OSError, subprocess.TimeoutExpired) as exc:
                print(f"could not stop {proc.name} ({proc.pid}): {exc!r}", file=sys.stderr)
        emb.stop()
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
