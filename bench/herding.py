"""Replicas herding on stale snapshots, live, with and without the fresh pick (FLEXLB_FRESH_PICK,
issue 15 Deliver 3).

Two gateway replicas over the same prefill workers; cache-blind prompts (unique), so the default
`cost` policy ranks on load alone. Each replica counts its own hand-offs at once but sees the
other's only through the owners' snapshots (one poll, `--poll-ms`, late) — so both send to the
worker that looked idlest at the last poll. With the fresh pick the hand-off script weighs the
pick against the runner-up on both workers' live queued/owed ms instead.

Open-loop Poisson arrivals alternate between the replicas; `max_new_tokens` 1, so a request's
latency is its time to first token plus the gateway's path. Each arm restarts the replicas on a
fresh cluster prefix over the same workers and Redis.

    nice -n 10 .venv/bin/python bench/herding.py --rate 14 --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import DEFAULT_OUT, ROOT, Proc, console, pct, start_workers, wait_until

from app.state.embedded_redis import start_embedded_redis

TOKEN = "herding-bench"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gateway(
    log_dir: Path, redis_url: str, cluster: str, env: dict[str, str], workers: str | None
) -> tuple[Proc, str]:
    port = _free_port()
    rid = f"gw-{uuid.uuid4().hex[:6]}"
    full = {
        **{k: v for k, v in os.environ.items() if k != "FLEXLB_REDIS_URL"},
        "FLEXLB_CLUSTER": cluster,
        "FLEXLB_ADMIN_TOKEN": TOKEN,
        "FLEXLB_REPLICA_ID": rid,
        **env,
    }
    cmd = [sys.executable, "-m", "app.cli", "gateway", "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--redis-url", redis_url, "--log-level", "WARNING"]
    if workers:
        cmd += ["--workers", workers]
    log_path = log_dir / f"{rid}.log"
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=full, start_new_session=True
        )
    proc = Proc(f"gateway {rid}", popen, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200,
            60,
            "healthz",
            ok=(httpx.HTTPError,),
        )
    except RuntimeError:
        proc.stop()
        raise
    return proc, url


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _load(urls: list[str], n: int, rate: float, prompt_tokens: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    lat: list[float] = []
    codes: dict[int, int] = {}
    where: dict[str, int] = {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)

    async with httpx.AsyncClient(timeout=120, limits=limits) as c:

        async def one(i: int) -> None:
            salt = f"{seed}-{i}-{uuid.uuid4().hex} "
            body = {"prompt": (salt * (prompt_tokens // len(salt) + 1))[:prompt_tokens], "max_new_tokens": 1}
            t0 = time.perf_counter()
            r = await c.post(urls[i % len(urls)] + "/v1/generate", json=body)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            if r.status_code == 200:
                lat.append((time.perf_counter() - t0) * 1000)
                w = r.json()["prefill_worker"]
                where[w] = where.get(w, 0) + 1

        tasks = []
        t_next = time.perf_counter()
        for i in range(n):
            t_next += rnd.expovariate(rate)
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return {
        "ok": len(lat),
        "codes": codes,
        "p50_ms": round(pct(lat, 50), 1),
        "p90_ms": round(pct(lat, 90), 1),
        "p99_ms": round(pct(lat, 99), 1),
        "mean_ms": round(sum(lat) / max(len(lat), 1), 1),
        "per_worker": dict(sorted(where.items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rate", type=float, default=14.0, help="requests/s over all replicas")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument(
        "--formula", default="100 + sum(0.5*computeTokens)", help="workers' and gateways' prefill ms"
    )
    ap.add_argument(
        "--poll-ms", type=int, default=200, help="FLEXLB_POLL_INTERVAL_MS (default: the product's)"
    )
    ap.add_argument("--arms", default="off,on", help="FLEXLB_FRESH_PICK values to run, in order")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", type=Path, default=DEFAULT_OUT / "herding.json")
    args = ap.parse_args()
    log_dir = DEFAULT_OUT / f"herding-{time.strftime('%H%M%S')}"
    log_dir.mkdir(parents=True, exist_ok=True)
    emb = start_embedded_redis(f"herd-{uuid.uuid4().hex[:6]}", idle_s=3600, owner_pid=os.getpid())
    wargs = ["--profile", "formula", "--formula", args.formula]
    specs = [("prefill", wargs)] * args.prefill + [("decode", ["--profile", "formula", "--formula", "1"])]
    workers = start_workers(specs, log_dir, attempts=2)
    spec = ",".join(f"{w.role}@{w.address}" for w in workers)
    results: list[dict[str, Any]] = []
    try:
        for arm in args.arms.split(","):
            cluster = f"herd-{arm}-{uuid.uuid4().hex[:6]}"
            env = {
                "FLEXLB_FRESH_PICK": "1" if arm == "on" else "0",
                "FLEXLB_POLL_INTERVAL_MS": str(args.poll_ms),
                "FLEXLB_PREFILL_TIME_FORMULA": args.formula,
                "FLEXLB_ADMISSION": "off",  # measure the routing, not the refusals
            }
            gws: list[tuple[Proc, str]] = []
            try:
                for i in range(args.replicas):
                    gws.append(_gateway(log_dir, emb.url, cluster, env, spec if i == 0 else None))
                urls = [u for _, u in gws]
                for u in urls:
                    wait_until(
                        lambda u=u: httpx.get(u + "/readyz", timeout=2).json().get("ready"), 60, "ready"
                    )
                # warm-up (connections, scripts), not measured
                asyncio.run(_load(urls, 20, args.rate, args.prompt_tokens, args.seed + 99))
                res = asyncio.run(_load(urls, args.requests, args.rate, args.prompt_tokens, args.seed))
                res["moved"] = sum(_metric(u, "flexlb_fresh_pick_moved_total") for u in urls)
                res["fresh_pick"] = arm
                results.append(res)
                console.print(json.dumps(res))
            finally:
                for p, _ in gws:
                    p.stop()
    finally:
        for w in workers:
            w.stop()
        emb.stop()
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2))
    console.print(f"written {args.output}")


if __name__ == "__main__":
    main()
