"""Soak with faults: mixed load against a running `flexlb up` while replicas, workers and Redis
fail (docs/benchmarks.md "Soak with faults"). Everything on 127.0.0.1; it signals only the pids
that the stack's manifest and the Redis pidfile name.

Start a private Redis and a stack on it, then this script:

    redis-server --port 16391 --bind 127.0.0.1 --save "" --appendonly yes --daemonize yes \
        --pidfile /tmp/soak/redis.pid --dir /tmp/soak
    FLEXLB_LIFECYCLE_TTL_S=60 FLEXLB_SETTLED_BATCH_TTL_S=60 PYTHONPATH=bench/_maps_hook \
        .venv/bin/flexlb up --gateways 3 --port 18500 --time-scale 0.2 --log-dir /tmp/soak/logs \
        --redis-url redis://127.0.0.1:16391/0
    AOF=yes .venv/bin/python bench/soak_faults.py /tmp/soak/logs/latest/stack.json 240 25 \
        "30:stopgw1,70:stopwprefill-1,110:redis,150:bigburst,190:killgw0,200:stopwdecode-0" /tmp/soak/out.json

Arguments: manifest, seconds of load, requests/s (Poisson), faults (`<s>:<what>`, comma-separated:
`killgw<N>` SIGKILL a gateway, `stopgw<N>` SIGSTOP it 6 s, `killw<name>` SIGKILL a worker,
`stopw<name>` SIGSTOP it 8 s, `redis` SIGKILL and restart Redis (from its AOF with `AOF=yes`,
else empty), `burst` 300 requests at once, `bigburst` 1,500), output JSON. Env `REDIS_PORT`
(16391) and `REDIS_DIR` (/tmp/soak, holding `redis.pid`). The mix: native, completions and chat,
streaming and not, 6 % client disconnects, 5 % cancels through another replica, 20 % client ids.
Every 15 s it samples Redis keys by kind (ids replaced by `*`), keys without a TTL, `used_memory`
and the gateways' RSS; at the end it counts every outcome, and 20 s after the load what is still
held (reservations, ledgers, live sets, pending queue entries, non-terminal records).
`bench/_maps_hook` (on the stack's PYTHONPATH) makes each gateway write, every 20 s, the size of
every dict/set/list attribute of its `app.*` objects to `$FLEXLB_MAPS_DIR` (/tmp/soak/maps).
"""

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import redis

STACK = json.loads(Path(sys.argv[1]).read_text())
DURATION = float(sys.argv[2])
RATE = float(sys.argv[3])
FAULTS = sys.argv[4] if len(sys.argv) > 4 else ""
REDIS_PORT = int(os.environ.get("REDIS_PORT", "16391"))
REDIS_DIR = Path(os.environ.get("REDIS_DIR", "/tmp/soak"))
URLS = [g["url"] for g in STACK["gateways"]]
R = redis.Redis(port=REDIS_PORT)
rng = random.Random(1)
results: list[dict] = []
t_start = time.monotonic()
PREFIXES = ["".join(rng.choice("abcdefghij ") for _ in range(300)) for _ in range(10)]


def norm(k: str) -> str:
    return re.sub(r"\{([qrwt]):[^}]*\}", r"{\1:*}", k)


def redis_sample() -> dict:
    try:
        cats: Counter = Counter()
        nottl: Counter = Counter()
        for raw in R.scan_iter(count=2000):
            k = raw.decode()
            c = norm(k)
            cats[c] += 1
            if R.ttl(raw) == -1:
                nottl[c] += 1
        mem = R.info("memory")["used_memory"]
        return {"keys": sum(cats.values()), "cats": dict(cats), "nottl": dict(nottl), "mem": mem}
    except redis.RedisError as e:
        return {"err": str(e)}


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return -1
    return -1


def gw_pids() -> dict:
    doc = json.loads(Path(sys.argv[1]).read_text())
    return {g["name"]: g["pid"] for g in doc["gateways"]}


async def one(c: httpx.AsyncClient, i: int) -> None:
    url = rng.choice(URLS)
    kind = rng.choices(["gen", "gen_s", "cmpl", "cmpl_s", "chat", "chat_s"], [2, 2, 1, 2, 1, 2])[0]
    prompt = rng.choice(PREFIXES) + f" req {i} " + uuid.uuid4().hex * rng.randint(1, 4)
    mnt = rng.choice([1, 4, 8, 16, 32])
    disconnect = rng.random() < 0.06
    cancel = rng.random() < 0.05
    client_id = rng.random() < 0.2
    rid = f"probe-{i}-{uuid.uuid4().hex[:6]}" if client_id or cancel else None
    headers = {}
    stream = kind.endswith("_s")
    if kind.startswith("gen"):
        path = "/v1/generate"
        body = {"prompt": prompt, "max_new_tokens": mnt, "stream": stream, "timeout_ms": 30000}
        if rid:
            body["request_id"] = rid
    elif kind.startswith("cmpl"):
        path = "/v1/completions"
        body = {"model": "flexlb-sim", "prompt": prompt, "max_tokens": mnt, "stream": stream}
        if rid:
            headers["x-request-id"] = rid
    else:
        path = "/v1/chat/completions"
        body = {
            "model": "flexlb-sim",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": mnt,
            "stream": stream,
        }
        if rid:
            headers["x-request-id"] = rid
    rec = {
        "i": i,
        "kind": kind,
        "url": url,
        "t0": time.monotonic() - t_start,
        "rid": rid,
        "disc": disconnect,
        "cancel": cancel,
    }
    results.append(rec)
    canceller = None
    if cancel and rid:

        async def do_cancel() -> None:
            await asyncio.sleep(rng.uniform(0.01, 0.5))
            try:
                r = await c.delete(rng.choice(URLS) + f"/v1/requests/{rid}")
                rec["cancel_status"] = r.status_code
            except httpx.HTTPError as e:
                rec["cancel_status"] = type(e).__name__

        canceller = asyncio.create_task(do_cancel())
    try:
        if stream:
            async with c.stream("POST", url + path, json=body, headers=headers) as r:
                rec["status"] = r.status_code
                n = 0
                err = None
                if r.status_code != 200:
                    rec["err"] = (await r.aread())[:200].decode(errors="replace")
                    rec["t1"] = time.monotonic() - t_start
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if '"error"' in line:
                            err = line[:200]
                        if line == "data: [DONE]":
                            rec["done"] = True
                    if disconnect and n >= 2:
                        rec["disconnected"] = True
                        break
                rec["err"] = err
        else:
            if disconnect:
                try:
                    r = await c.post(url + path, json=body, headers=headers, timeout=0.05)
                    rec["status"] = r.status_code
                except httpx.TimeoutException:
                    rec["disconnected"] = True
            else:
                r = await c.post(url + path, json=body, headers=headers)
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["err"] = r.text[:200]
    except httpx.TimeoutException as e:
        rec["exc"] = "timeout:" + type(e).__name__
    except httpx.HTTPError as e:
        rec["exc"] = type(e).__name__ + ":" + str(e)[:80]
    rec["t1"] = time.monotonic() - t_start
    if canceller:
        await canceller


async def burst(c: httpx.AsyncClient, base: int, n: int, tasks: set) -> None:
    for k in range(n):
        t = asyncio.create_task(one(c, base + k))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


def restart_redis() -> None:
    pid = int(REDIS_DIR / "redis.pid".read_text())
    os.kill(pid, signal.SIGKILL)
    time.sleep(1.5)
    subprocess.run(
        [
            "redis-server",
            "--port",
            str(REDIS_PORT),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            os.environ.get("AOF", "no"),
            "--daemonize",
            "yes",
            "--pidfile",
            str(REDIS_DIR / "redis.pid"),
            "--logfile",
            str(REDIS_DIR / "redis.log"),
            "--dir",
            str(REDIS_DIR),
        ],
        check=True,
    )


async def main() -> None:
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    samples = []
    tasks: set = set()
    fault_plan = []
    if FAULTS:
        for item in FAULTS.split(","):
            t, what = item.split(":")
            fault_plan.append((float(t), what))
    fault_plan.sort()
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits) as c:
        i = 0
        next_t = 0.0
        next_sample = 0.0
        while (now := time.monotonic() - t_start) < DURATION:
            if now >= next_sample:
                s = await asyncio.to_thread(redis_sample)
                s["t"] = now
                s["served"] = sum(1 for r in results if "t1" in r)
                s["rss"] = {n: rss(p) for n, p in gw_pids().items()}
                samples.append(s)
                print(json.dumps({k: v for k, v in s.items() if k not in ("cats", "nottl")}), flush=True)
                next_sample = now + 15
            while fault_plan and fault_plan[0][0] <= now:
                _, what = fault_plan.pop(0)
                print(f"FAULT {what} at {now:.1f}", flush=True)
                if what.startswith("killgw"):
                    os.kill(gw_pids()["gateway-" + what[-1]], signal.SIGKILL)
                elif what.startswith("killw"):
                    doc = json.loads(Path(sys.argv[1]).read_text())
                    pid = next(w["pid"] for w in doc["workers"] if w["name"] == what[5:])
                    os.kill(pid, signal.SIGKILL)
                elif what == "redis":
                    await asyncio.to_thread(restart_redis)
                elif what == "burst":
                    await burst(c, 1_000_000 + i, 300, tasks)
                elif what == "bigburst":
                    await burst(c, 2_000_000 + i, 1500, tasks)
                elif what.startswith("stopgw"):
                    pid = gw_pids()["gateway-" + what[-1]]
                    os.kill(pid, signal.SIGSTOP)
                    asyncio.get_running_loop().call_later(6.0, os.kill, pid, signal.SIGCONT)
                elif what.startswith("stopw"):
                    doc = json.loads(Path(sys.argv[1]).read_text())
                    pid = next(w["pid"] for w in doc["workers"] if w["name"] == what[5:])
                    os.kill(pid, signal.SIGSTOP)
                    asyncio.get_running_loop().call_later(8.0, os.kill, pid, signal.SIGCONT)
            if now >= next_t:
                t = asyncio.create_task(one(c, i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
                next_t += rng.expovariate(RATE)
            await asyncio.sleep(max(0.0, min(next_t, next_sample) - (time.monotonic() - t_start)))
        print("load stopped; waiting for in-flight", len(tasks), flush=True)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)
    s = await asyncio.to_thread(redis_sample)
    s["t"] = time.monotonic() - t_start
    s["served"] = len(results)
    s["rss"] = {n: rss(p) for n, p in gw_pids().items()}
    samples.append(s)
    Path(sys.argv[5] if len(sys.argv) > 5 else "/tmp/soak/out.json").write_text(
        json.dumps({"results": results, "samples": samples})
    )
    st = Counter()
    for r in results:
        if "exc" in r:
            st["exc:" + r["exc"].split(":")[0]] += 1
        elif r.get("disconnected"):
            st["disc"] += 1
        else:
            code = r.get("status")
            e = r.get("err") or ""
            m = re.search(r'"code": ?"([a-z_]+)"', e)
            st[f"{code}:{m.group(1) if m else ''}"] += 1
    print(dict(st))
    print(json.dumps(samples[-1]["cats"], indent=0)[:3000])
    print("NOTTL", json.dumps(samples[-1]["nottl"]))
    await asyncio.sleep(20)
    live = Counter()
    for raw in R.scan_iter(count=2000):
        k = raw.decode()
        t = R.type(raw).decode()
        if k.endswith(":req"):
            st = (R.hget(raw, "state") or b"").decode()
            if st not in ("completed", "failed", "cancelled", "timed_out", "owner_lost"):
                live["nonterminal:" + st] += 1
                print("NONTERMINAL", k, R.hgetall(raw))
        elif t == "stream" and k.endswith(":queue"):
            live["queue_pending"] += R.xpending(raw, "owner")["pending"] if R.exists(raw) else 0
        elif (
            t in ("hash", "set", "zset")
            and not k.endswith((":tomb", ":info", ":snap", ":cache_snap", ":config", ":member", "apikeys"))
            and k not in ("flexlb:workers", "flexlb:replicas", "flexlb:members")
        ):
            n = R.hlen(raw) if t == "hash" else R.scard(raw) if t == "set" else R.zcard(raw)
            live[norm(k)] += n
    print("AFTER 20s", dict(live))


asyncio.run(main())
