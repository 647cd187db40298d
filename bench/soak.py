"""Soak: does anything grow? (issue 14, Benchmark.)

Runs `flexlb up` (embedded Redis, 2 prefill + 2 decode workers, 2 gateway replicas), sends an open
loop of mixed streaming and non-streaming requests over both replicas (prompts share prefixes:
`--families` prefix families, each prompt = a family's prefix + a unique tail), and every
`--sample-s` seconds samples (finished records expire after `--lifecycle-ttl-s`, default 60 s
instead of the product's 3600 s, so a soak shorter than an hour still reaches steady state):

- RSS of every process of the stack (gateways, workers, the stack supervisor, redis-server);
- Redis `used_memory` and `DBSIZE`;
- the length of every stream under the cluster prefix, summed by kind (queue, replies, cache);
- the gateways' own counters: `flexlb_reconciled_total` and `flexlb_loop_errors_total`;
- each prefill worker's KV in use (`kv_used_tokens`: its prefix cache plus pinned handles).

Much of a young stack's memory follows the prefill workers' prefix caches while they fill (the
workers' LRU and diff log, the gateways' cache mirrors, Redis's cache streams and snapshots), and
all of it is bounded by the workers' KV capacity. The profile's 450,000 tokens take far longer
than a soak to fill at 50 req/s, so `--prefill-kv-tokens` (default 40,000) shrinks it at start-up:
the caches fill within minutes and then evict, the steady state of a long-running stack.

At the end it fits a line to each series after the warm-up — `--warmup-s` (at least 2 x the TTL),
or later, once every prefill worker's KV reached 90 % of its capacity — and states its growth in
% per hour of its mean (Redis's series also per request answered in the last TTL, which a swing
of the achieved rate on a shared box does not move); the target is
<= 1 %/h for every series, 0 reconciler corrections and 0 loop errors. With `--faults` it also
runs the chaos suite (tests/test_faults.py) and prints its table (case, sent, ok, typed, hung,
lost). Results go to `--output` as JSON.

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 50] [--sample-s 30] [--faults]

Every process started here is stopped here (SIGINT to `flexlb up`, which stops its children;
SIGKILL of its process group after a bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "soak-" + secrets.token_hex(6)


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (a worker's Triton server and Python stubs count with it)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        for k in kids:
            out.append(int(k))
            todo.append(int(k))
    return out


def tree_rss(pid: int) -> int:
    return rss_kib(pid) + sum(rss_kib(c) for c in children(pid))


class OpenLoop:
    """Open-loop load at `rate` req/s over `urls` from its own thread and event loop."""

    def __init__(self, urls: list[str], rate: float, families: int, max_inflight: int = 400) -> None:
        self.urls, self.rate, self.families, self.max_inflight = urls, rate, families, max_inflight
        self.codes: Counter[str] = Counter()
        self.skipped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.max_inflight, max_keepalive_connections=100)
        inflight: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            i, next_at = 0, time.monotonic()
            while not self._stop.is_set():
                if len(inflight) >= self.max_inflight:
                    self.skipped += 1
                else:
                    t = asyncio.create_task(self._one(c, i))
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                i += 1
                next_at += 1 / self.rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*inflight)

    async def _one(self, c: httpx.AsyncClient, i: int) -> None:
        fam = i % self.families
        prompt = (
            f"family {fam}: " + "shared context sentence. " * (8 + fam % 8) + f"question {uuid.uuid4().hex}"
        )
        body = {"prompt": prompt, "max_new_tokens": 4 + i % 13, "stream": i % 2 == 1}
        url = self.urls[i % len(self.urls)] + "/v1/generate"
        try:
            if body["stream"]:
                async with c.stream("POST", url, json=body) as r:
                    code = "ok" if r.status_code == 200 else str(r.status_code)
                    async for line in r.aiter_lines():
                        if line.startswith('data: {"error"'):
                            code = json.loads(line[6:])["error"]["code"]
            else:
                r = await c.post(url, json=body)
                code = (
                    "ok"
                    if r.status_code == 200
                    else r.json().get("error", {}).get("code", str(r.status_code))
                )
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        self.codes[code] += 1


def counters(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def worker_status(address: str) -> dict[str, Any]:
    """One control call to a worker (its gRPC port), from this sync script."""
    from app.rpc.worker_client import WorkerClient

    async def call() -> dict[str, Any]:
        c = WorkerClient(address)
        try:
            return await c.status(0, timeout=5.0)
        finally:
            await c.close()

    return asyncio.run(call())


def configure_prefill(manifest: dict[str, Any], kv_tokens: int) -> None:
    from app.rpc.worker_client import WorkerClient

    async def call(address: str) -> None:
        c = WorkerClient(address)
        try:
            await c.configure(kv_capacity_tokens=kv_tokens)
        finally:
            await c.close()

    for w in manifest["workers"]:
        if w["role"] == "prefill":
            asyncio.run(call(w["address"]))


def sample(manifest: dict[str, Any], r: redis.Redis, prefix: str, up_pid: int) -> dict[str, float]:
    out: dict[str, float] = {"t": time.time()}
    for w in manifest["workers"]:
        if w["role"] != "prefill":
            continue
        try:
            st = worker_status(w["address"])
        except Exception:  # a worker being restarted: the series skips this sample
            continue
        out[f"kv_used_tokens:{w['name']}"] = float(st["kv_total_tokens"] - st["kv_free_tokens"])
        out[f"kv_total_tokens:{w['name']}"] = float(st["kv_total_tokens"])
    for g in manifest["gateways"]:
        out[f"rss_kib:{g['name']}"] = tree_rss(int(g["pid"]))
    for w in manifest["workers"]:
        out[f"rss_kib:{w['name']}"] = tree_rss(int(w["pid"]))
    out["rss_kib:supervisor"] = rss_kib(up_pid)
    info = r.info()
    out["rss_kib:redis-server"] = rss_kib(int(info["process_id"]))
    out["redis_used_memory"] = float(info["used_memory"])
    out["redis_dbsize"] = float(r.dbsize())
    lengths: Counter[str] = Counter()
    for key in r.scan_iter(match=f"{prefix}:*", count=1000, _type="stream"):
        k = key.decode()
        lengths[k.rsplit(":", 1)[-1]] += r.xlen(key)
    for kind in ("queue", "replies", "cache"):
        out[f"stream_len:{kind}"] = float(lengths.get(kind, 0))
    rec = errs = 0.0
    for g in manifest["gateways"]:
        try:
            text = httpx.get(g["url"] + "/metrics", timeout=10).text
        except httpx.HTTPError:  # a starved box: this sample goes without the counters
            return out
        rec += counters(text, "flexlb_reconciled_total")
        errs += counters(text, "flexlb_loop_errors_total")
    out["reconciled_total"], out["loop_errors_total"] = rec, errs
    return out


def growth_pct_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope, as % of the series mean per hour (0 for a flat or all-zero series)."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0 or my == 0:
        return 0.0
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var
    return slope * 3600 / my * 100


def caches_full_s(samples: list[dict[str, float]]) -> float:
    """Seconds into the run from which every prefill worker's KV stayed >= 90 % of its capacity
    (0 when never sampled; the run's length when never full, so nothing is fitted as steady)."""
    names = {k.split(":", 1)[1] for s in samples for k in s if k.startswith("kv_total_tokens:")}
    if not names:
        return 0.0
    t0 = samples[0]["t"]
    full_from: float | None = None
    for s in samples:
        full = all(
            s.get(f"kv_used_tokens:{n}", 0.0) >= 0.9 * s.get(f"kv_total_tokens:{n}", float("inf"))
            for n in names
        )
        if full and full_from is None:
            full_from = s["t"] - t0
        elif not full:
            full_from = None
    return full_from if full_from is not None else samples[-1]["t"] - t0


def per_request(samples: list[dict[str, float]], ttl_s: float) -> None:
    """Add `redis_dbsize/req` and `redis_used_memory/req`: the series divided by the requests
    answered in the last `ttl_s` (the ones whose records Redis still holds). The achieved rate on a
    shared box swings by tens of %, and the raw series follow it; per retained request, a leak
    still shows as growth and a rate swing does not."""
    for i, s in enumerate(samples):
        at = s["t"] - ttl_s
        j = max((k for k in range(i) if samples[k]["t"] <= at), default=None)
        if j is None or j + 1 > i or "answered" not in s or "answered" not in samples[j]:
            continue
        a, b = samples[j], samples[j + 1]  # interpolated: samples are not spaced by the TTL
        f = (at - a["t"]) / (b["t"] - a["t"]) if b["t"] > a["t"] else 0.0
        retained = s["answered"] - (a["answered"] + f * (b.get("answered", a["answered"]) - a["answered"]))
        if retained > 0:
            s["redis_dbsize/req"] = s["redis_dbsize"] / retained
            s["redis_used_memory/req"] = s["redis_used_memory"] / retained


def start_stack(log_dir: Path, port: int, time_scale: float, ttl_s: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "FLEXLB_ADMIN_TOKEN": TOKEN,
        "FLEXLB_LIFECYCLE_TTL_S": str(ttl_s),
        # Settled-batch tombstones (600 s in the product) expire with the records, so the key count
        # reaches its steady state after 2 x TTL instead of after 10 minutes.
        "FLEXLB_SETTLED_BATCH_TTL_S": str(ttl_s),
    }
    env.pop("FLEXLB_REDIS_URL", None)
    args = [sys.executable, "-m", "app.cli", "up", "--port", str(port), "--log-dir", str(log_dir)]
    args += ["--time-scale", str(time_scale)]
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def wait_ready(log_dir: Path, up: subprocess.Popen[bytes], timeout: float = 180) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if up.poll() is not None:
            raise RuntimeError(f"flexlb up exited with {up.returncode}; see {log_dir}")
        path = log_dir / "latest" / "stack.json"
        try:
            man = json.loads(path.read_text())
            if man["gateways"] and all(
                httpx.get(g["url"] + "/readyz", timeout=2).json().get("ready") for g in man["gateways"]
            ):
                return man  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(1)
    raise RuntimeError("the stack did not become ready")


def stop_stack(up: subprocess.Popen[bytes]) -> None:
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)


def run_faults() -> list[str]:
    """The chaos suite's table lines (tests/test_faults.py prints one per case with -s)."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "tests/test_faults.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[chaos]")]
    tail = res.stdout.strip().splitlines()[-1:] if res.stdout.strip() else []
    return lines + tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--families", type=int, default=20)
    ap.add_argument("--time-scale", type=float, default=0.2, help="worker time scale (CPU-bound box)")
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument(
        "--lifecycle-ttl-s",
        type=int,
        default=60,
        help="finished records' TTL: shorter than the warm-up, so DBSIZE reaches its steady state",
    )
    ap.add_argument(
        "--prefill-kv-tokens",
        type=int,
        default=40_000,
        help="prefill workers' KV capacity (0: the profile's): small, so their prefix caches fill early",
    )
    ap.add_argument("--output", default="")
    ap.add_argument("--faults", action="store_true", help="also run the chaos suite and print its table")
    a = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="flexlb-soak-"))
    up = start_stack(log_dir, a.port, a.time_scale, a.lifecycle_ttl_s)
    samples: list[dict[str, float]] = []
    load: OpenLoop | None = None
    try:
        man = wait_ready(log_dir, up)
        if a.prefill_kv_tokens:
            configure_prefill(man, a.prefill_kv_tokens)
        r = redis.Redis.from_url(man["redis_url"])
        prefix = os.environ.get("FLEXLB_CLUSTER", "flexlb")
        load = OpenLoop([g["url"] for g in man["gateways"]], a.rate, a.families)
        load.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.minutes * 60:
            samples.append(sample(man, r, prefix, up.pid))
            samples[-1]["answered"] = float(sum(load.codes.values()))
            s = samples[-1]
            print(
                f"[{time.monotonic() - t0:7.0f} s] redis {s['redis_used_memory'] / 2**20:6.1f} MiB "
                f"dbsize {s['redis_dbsize']:.0f} reconciled {s.get('reconciled_total', -1):.0f} "
                f"loop errors {s.get('loop_errors_total', -1):.0f} requests {dict(load.codes)}",
                flush=True,
            )
            time.sleep(max(0.0, a.sample_s - (time.monotonic() - t0) % a.sample_s))
        load.stop()
        samples.append(sample(man, r, prefix, up.pid))
        samples[-1]["answered"] = float(sum(load.codes.values()))
    finally:
        if load is not None:
            load.stop()
        stop_stack(up)
    t_start = samples[0]["t"]
    warmup = max(a.warmup_s, caches_full_s(samples))
    steady = [s for s in samples if s["t"] - t_start >= warmup] or samples
    series = {}
    print(f"\nsoak: {a.minutes} min at {a.rate} req/s; requests {dict(load.codes) if load else {}}")
    print(
        f"growth fitted from {warmup:.0f} s (--warmup-s {a.warmup_s:.0f}; prefill KV >= 90 % full from then)"
    )
    print(f"{'series':32s} {'first':>14s} {'last':>14s} {'growth %/h':>11s}  target <= 1 %/h")
    per_request(samples, a.lifecycle_ttl_s)
    for key in sorted(k for k in steady[-1] if k not in ("t", "answered") and not k.startswith("kv_total")):
        ys = [s[key] for s in steady if key in s]
        ts = [s["t"] for s in steady if key in s]
        g = growth_pct_per_hour(ts, ys)
        ok = key.startswith(("reconciled", "loop_errors")) or g <= 1.0
        series[key] = {"first": ys[0], "last": ys[-1], "growth_pct_per_hour": round(g, 3), "ok": ok}
        print(f"{key:32s} {ys[0]:14.6g} {ys[-1]:14.6g} {g:11.2f}  {'ok' if ok else 'MISSED'}")
    last = next((s for s in reversed(samples) if "reconciled_total" in s), {})
    last = {"reconciled_total": -1.0, "loop_errors_total": -1.0, **last}
    print(f"reconciler corrections: {last['reconciled_total']:.0f} (target 0)")
    print(f"loop errors: {last['loop_errors_total']:.0f} (target 0)")
    faults = run_faults() if a.faults else []
    for line in faults:
        print(line)
    doc = {
        "minutes": a.minutes,
        "rate": a.rate,
        "sample_s": a.sample_s,
        "warmup_s": warmup,
        "prefill_kv_tokens": a.prefill_kv_tokens,
        "requests": dict(load.codes) if load else {},
        "skipped": load.skipped if load else 0,
        "series": series,
        "reconciled_total": last["reconciled_total"],
        "loop_errors_total": last["loop_errors_total"],
        "samples": samples,
        "faults": faults,
    }
    if a.output:
        Path(a.output).write_text(json.dumps(doc, indent=2) + "\n")
    bad = [k for k, v in series.items() if not v["ok"]]
    return 1 if bad or last["reconciled_total"] or last["loop_errors_total"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
