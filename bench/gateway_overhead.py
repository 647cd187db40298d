"""What the gateway itself costs: two replicas in front of four zero-time simulated workers.

The workers model no GPU time at all (`--profile formula --formula 0 --time-scale 0.001`, which
also makes decode steps ~0), so everything measured here is software: HTTP, the origin's
scheduling, Redis, the owner's hand-off, gRPC and Triton. Three questions, each against a target:

1. Open loop, 100 req/s for 20 s over both replicas (1,000-token prompts, 4 new tokens): the
   origin overhead (arrival -> hand-off appended; p50 <= 1 ms, p99 <= 5 ms), the hand-off latency
   (appended -> owner writes the gRPC prefill; p50 <= 2 ms), Redis commands per request (<= 12;
   raw, and net of the background loops' idle rate measured over a quiet window first), gateway
   CPU per request and errors by code. The samples are the gateways' own (`GET /admin/stats`,
   cleared by `POST /admin/stats/reset`).
2. End-to-end latency added by the gateway: sequential requests through it vs the same prompts
   sent straight to the workers (`WorkerClient.prefill`, then `.decode` fetching that KV).
3. Closed-loop throughput at 1, 32 and 128 concurrent clients.

Setup: an embedded Redis (or `--redis-url`), 2 prefill + 2 decode workers, 2 replicas started
WITHOUT workers; once both are live members the workers are registered through the admin API, so
the sticky owner leases spread (the replica ids are chosen so that rendezvous hashing gives each
replica one prefill and one decode worker). The load generator runs in its own process, so its
CPU never competes inside a gateway's event loop. Everything binds to 127.0.0.1, every load is
bounded in count and time (the open loop keeps at most OPEN_LOOP_MAX_INFLIGHT requests in flight
and counts the ones it could not send), and every process started here is stopped here (SIGTERM,
wait, then SIGKILL of its process group; a replica that ignores SIGTERM gets its stacks saved with
py-spy when installed). Before each phase the cluster must be ready again; a worker that dies
mid-run (a Triton crash) is recorded under `incidents` and each phase says how many deaths it saw.

Schedule: issue #4 measures the path at batch size 1, each request dispatched as its own batch, so
by default the bench sets the cluster's runtime config to `schedule_mode=direct` with no in-flight
cap. `--schedule batching` keeps the product's default batcher instead: at most 2 batches in flight
per worker, so under load a request can wait at the owner for a batch to finish (a batching
policy; that wait then shows in the hand-off figure).

    .venv/bin/python bench/gateway_overhead.py [--quick] [--output DIR] [--redis-url URL] [--rate N]
        [--schedule direct|batching]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np
import psutil
import uvloop
from lean_http import HttpError, LeanClient  # bench/ is sys.path[0] when run as a script
from rich.console import Console
from rich.table import Table

from app.netports import free_port
from workers.server.spawn import ReadyLine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "out"
console = Console(width=None if sys.stdout.isatty() else 160)

PROMPT_TOKENS = 1000
MAX_NEW_TOKENS = 4
TOKEN_LO, TOKEN_HI = 32, 127  # printable bytes: valid ids for the default byte tokenizer
TARGETS = {
    "origin_p50_ms": 1.0,
    "origin_p99_ms": 5.0,
    "handoff_p50_ms": 2.0,
    "redis_cmds_per_req": 12.0,
}
REQUEST_TIMEOUT_S = 30.0
# Open loop: at most this many requests in flight from the client. A request due while the cap is
# reached is not sent and counts as `client_cap_skipped` (the system is already overloaded by then);
# without a cap an overloaded run piles thousands of requests (and connections) onto the gateways
# and the load generator's own bookkeeping.
OPEN_LOOP_MAX_INFLIGHT = 256
WORKER_ARGS = ["--profile", "formula", "--formula", "0", "--time-scale", "0.001"]
# The KV handle TTL is in *modelled* ms: at time scale 0.001 the default 30,000 ms would be 30 wall
# ms, and any queueing under load would expire the KV before decode fetches it (a re-prefill, i.e.
# noise). 10,000,000 modelled ms = 10 wall s; decode fetches (and frees) it long before that.
KV_TTL_ARGS = ["--kv-handle-ttl-ms", "10000000"]


# ---- processes ----------------------------------------------------------------------------------
@dataclass
class Proc:
    """A subprocess started here in its own session; `stop()` is the only way it is ended."""

    name: str
    popen: subprocess.Popen[Any]
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)
    stop_s: float | None = None
    hung: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process, wait; SIGKILL its whole process group only if it ignores that
        (after saving its Python stacks with py-spy, when installed, to show where it hung)."""
        t0 = time.monotonic()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                console.print(
                    f"[red]{self.name} ({self.pid}) ignored SIGTERM for {timeout:g} s; killing its group"
                )
                self.hung = True
                _dump_stacks(self.pid, self.log_path.with_suffix(".hang.txt"))
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(10)
        self.stop_s = round(time.monotonic() - t0, 2)
        return self.popen.returncode

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _dump_stacks(pid: int, path: Path) -> None:
    """Best effort: `py-spy dump` of a process that does not stop (py-spy is optional)."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [str(spy), "dump", "-p", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=20
        )
        path.write_text(out.stdout + out.stderr)
        console.print(f"[red]  its stacks: {path}")


def start_worker(role: str, log_dir: Path, timeout: float = 120.0) -> Proc:
    """`flexlb worker` on 127.0.0.1; waits (bounded) for its `worker_ready` JSON line."""
    log_path = log_dir / f"{role}-{uuid.uuid4().hex[:6]}.log"
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--role",
        role,
        "--host",
        "127.0.0.1",
        "--bind",
        "127.0.0.1",
        "--log-level",
        "WARNING",
        *WORKER_ARGS,
        *KV_TTL_ARGS,
    ]
    with open(log_path, "w") as err:
        popen = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    w = Proc(f"{role} worker", popen, log_path)
    info = ReadyLine(popen).wait(timeout)
    if info is not None:
        w.info = info
        return w
    w.stop()
    raise RuntimeError(f"{role} worker not ready (rc={popen.returncode}): {w.log_tail()}")


def start_workers(roles: Sequence[str], log_dir: Path) -> list[Proc]:
    """All in parallel (each takes seconds); if one fails, the started ones are stopped."""
    with ThreadPoolExecutor(len(roles)) as ex:
        futs = [ex.submit(start_worker, r, log_dir) for r in roles]
        started, errors = [], []
        for f in futs:
            try:
                started.append(f.result())
            except Exception as exc:
                errors.append(exc)
    if errors:
        for w in started:
            w.stop()
        raise errors[0]
    return started


@dataclass
class Gateway:
    proc: Proc
    port: int
    replica_id: str
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, admin: bool = False, timeout: float = 5.0) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if admin else {}
        return httpx.get(self.url + path, headers=headers, timeout=timeout)

    def post(self, path: str, body: dict[str, Any], timeout: float = 5.0) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=timeout)

    def put(self, path: str, body: dict[str, Any], timeout: float = 5.0) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.put(self.url + path, json=body, headers=headers, timeout=timeout)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        if reset:
            r = self.post("/admin/stats/reset", {}, timeout=10.0)
        else:
            r = self.get("/admin/stats", admin=True, timeout=10.0)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]


def start_gateway(
    log_dir: Path, redis_url: str, cluster: str, replica_id: str, token: str, log_level: str
) -> Gateway:
    """`flexlb gateway` with no workers; returns once /healthz answers (bounded)."""
    port = free_port()
    log_path = log_dir / f"{replica_id}.log"
    env = {
        **{k: v for k, v in os.environ.items() if k != "FLEXLB_REDIS_URL"},
        "FLEXLB_CLUSTER": cluster,
        "FLEXLB_ADMIN_TOKEN": token,
        "FLEXLB_REPLICA_ID": replica_id,
    }
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "gateway",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--redis-url",
        redis_url,
        "--log-level",
        log_level,
    ]
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    gw = Gateway(Proc(f"gateway {replica_id}", popen, log_path), port, replica_id, token)
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"gateway exited: {gw.proc.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(gw.url + "/healthz", timeout=1).status_code == 200:
                return gw
        time.sleep(0.1)
    gw.proc.stop()
    raise RuntimeError(f"gateway did not start: {gw.proc.log_tail()}")


def wait_for(cond: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except (httpx.HTTPError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last:
                return last
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}; last={last!r}")


def pick_replica_ids(worker_ids: Sequence[str]) -> tuple[str, str]:
    """Two replica ids for which rendezvous hashing gives each one prefill and one decode worker,
    so both replicas act as owners (leases are sticky, so this is also what they end up holding)."""
    from app.cluster.rendezvous import assign

    pre = [w for w in worker_ids if w.startswith("prefill@")]
    dec = [w for w in worker_ids if w.startswith("decode@")]
    for _ in range(10_000):
        a, b = f"gwb-{uuid.uuid4().hex[:6]}", f"gwb-{uuid.uuid4().hex[:6]}"
        owner = assign(worker_ids, [a, b])
        if {owner[w] for w in pre} == {a, b} and {owner[w] for w in dec} == {a, b}:
            return a, b
    raise RuntimeError("no replica id pair splits the workers")  # pragma: no cover (p = 0.75^10000)


class CpuMeter:
    """CPU seconds (user + system) of processes and, optionally, their live children."""

    def __init__(self, pids: Sequence[int], tree: bool = False) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.tree = tree
        self._last: dict[int, float] = {}

    def seconds(self) -> float:
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):  # a dead process counts what it had, no more
                t = p.cpu_times()
                self._last[p.pid] = t.user + t.system
            total += self._last.get(p.pid, 0.0)
            if self.tree:
                with contextlib.suppress(psutil.Error):
                    for q in p.children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            t = q.cpu_times()
                            total += t.user + t.system
        return total


# ---- load generator (own process) ---------------------------------------------------------------
def _body(rng: np.random.Generator, n_tokens: int, max_new: int) -> bytes:
    ids = rng.integers(TOKEN_LO, TOKEN_HI, n_tokens)
    return b'{"input_ids":[' + ",".join(map(str, ids.tolist())).encode() + b'],"max_new_tokens":%d}' % max_new


class _Clients:
    """One `LeanClient` pool per gateway URL, `n` connections each; httpx cost the box a quarter
    of its CPU at 100 req/s (see bench/lean_http.py)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pools: dict[str, LeanClient] = {}

    def pool(self, url: str) -> LeanClient:
        c = self.pools.get(url)
        if c is None:
            c = self.pools[url] = LeanClient(url, self.n, REQUEST_TIMEOUT_S)
        return c

    async def __aenter__(self) -> _Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.pools.values():
            await c.aclose()


def _client(n: int) -> _Clients:
    return _Clients(n)


async def _one(client: _Clients, url: str, body: bytes, max_new: int) -> str:
    """One native /v1/generate call; the outcome code ('ok' or the error code)."""
    try:
        status, raw = await client.pool(url).post("/v1/generate", body)
    except HttpError as exc:
        return f"transport:{type(exc).__name__}"
    try:
        o = json.loads(raw)
    except ValueError:
        return "bad_json" if status == 200 else f"http_{status}"
    if status == 200:
        return "ok" if len(o.get("output_ids", ())) == max_new else "bad_output"
    try:
        return str(o["error"]["code"])
    except (KeyError, TypeError):
        return f"http_{status}"


async def lg_open_loop(
    urls: list[str], rate: float, duration: float, n_tokens: int, max_new: int, seed: int
) -> dict[str, Any]:
    """Requests at fixed instants t0 + i/rate, alternating replicas, each in its own task; latency
    counts from the scheduled instant (no coordinated omission). Bodies are made up front."""
    n = int(rate * duration)
    rng = np.random.default_rng(seed)
    bodies = [_body(rng, n_tokens, max_new) for _ in range(n)]
    loop = asyncio.get_running_loop()
    lat: list[float] = [float("nan")] * n
    codes: list[str] = [""] * n
    lags: list[float] = []
    inflight = 0
    async with _client(OPEN_LOOP_MAX_INFLIGHT) as client:

        async def go(i: int, at: float) -> None:
            nonlocal inflight
            inflight += 1
            try:
                codes[i] = await _one(client, urls[i % len(urls)], bodies[i], max_new)
                lat[i] = (loop.time() - at) * 1000
            finally:
                inflight -= 1

        tasks = []
        t0 = loop.time() + 0.1
        for i in range(n):
            at = t0 + i / rate
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append((loop.time() - at) * 1000)
            if inflight >= OPEN_LOOP_MAX_INFLIGHT:
                codes[i] = "client_cap_skipped"
                continue
            tasks.append(asyncio.create_task(go(i, at)))
        t_sent = loop.time()
        _, pending = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
        t_end = loop.time()
    return {
        "scheduled": n,
        "sent": len(tasks),
        "send_s": t_sent - t0,
        "wall_s": t_end - t0,
        "latency_ms": [x for x in lat if x == x],
        "codes": dict(Counter(c or "no_answer_in_time" for c in codes)),
        "send_lag_ms": lags,
    }


async def lg_closed_loop(
    urls: list[str], concurrency: int, duration: float, n_tokens: int, max_new: int, seed: int
) -> dict[str, Any]:
    """`concurrency` clients, each sending its next request when the previous one answers,
    until `duration` has passed (in-flight requests are then awaited, bounded)."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    codes: Counter[str] = Counter()
    done_at: list[float] = []
    async with _client(max(16, 2 * concurrency)) as client:
        t0 = loop.time()
        stop_at = t0 + duration

        async def worker(k: int) -> None:
            rng = np.random.default_rng([seed, k])
            url = urls[k % len(urls)]
            while loop.time() < stop_at:
                body = _body(rng, n_tokens, max_new)
                t = loop.time()
                code = await _one(client, url, body, max_new)
                now = loop.time()
                codes[code] += 1
                if code == "ok":
                    lat.append((now - t) * 1000)
                done_at.append(now)

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration + REQUEST_TIMEOUT_S + 5)
        for t in pending:
            t.cancel()
    return {
        "concurrency": concurrency,
        "duration_s": duration,
        "elapsed_s": (max(done_at) - t0) if done_at else duration,
        "latency_ms": lat,
        "codes": dict(codes),
    }


async def _direct_one(
    pre: tuple[Any, str, str],
    dec: tuple[Any, str],
    rid: str,
    ids: np.ndarray,
    max_new: int,
) -> tuple[float, str]:
    """Prefill on one worker, then decode on another fetching that KV, as the gateway does: the
    decode starts at the prefill `results` event (the prefill stream's `final` is drained beside
    it), and it asks for max_new - 1 tokens (the first comes from prefill)."""
    pc, p_epoch, p_addr = pre
    dc, d_epoch = dec
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[str, str]] = loop.create_future()

    async def run_prefill() -> None:
        try:
            async for ev in pc.prefill(f"b-{rid}", p_epoch, [(rid, ids)], timeout=REQUEST_TIMEOUT_S):
                if ev.event == "results" and not got.done():
                    got.set_result((ev.results[0]["status"], ev.epoch))
                elif ev.event == "error" and not got.done():
                    got.set_result((f"prefill_error:{ev.error[:60]}", ""))
        except Exception as exc:
            if not got.done():
                got.set_result((f"prefill:{type(exc).__name__}: {str(exc)[-120:]}", ""))
        if not got.done():
            got.set_result(("prefill:no_result", ""))

    t0 = time.perf_counter()
    ptask = asyncio.create_task(run_prefill())
    status, kv_epoch = await got
    code = status
    if status == "ok":
        n = 0
        finish = ""
        try:
            async with contextlib.aclosing(
                dc.decode(
                    rid,
                    d_epoch,
                    len(ids),
                    max_new - 1,
                    kv_worker=p_addr,
                    kv_epoch=kv_epoch,
                    timeout=REQUEST_TIMEOUT_S,
                )
            ) as events:
                async for ev in events:
                    if ev.event == "tokens":
                        n += len(ev.tokens)
                    else:
                        finish = ev.finish_reason
                        break
            code = "ok" if finish == "length" and n == max_new - 1 else f"decode:{finish or 'none'}"
        except Exception as exc:
            code = f"decode:{type(exc).__name__}: {str(exc)[-120:]}"
    ms = (time.perf_counter() - t0) * 1000
    await ptask
    return ms, code


async def lg_e2e(
    urls: list[str],
    prefill: list[tuple[str, str]],
    decode: list[tuple[str, str]],
    n: int,
    n_tokens: int,
    max_new: int,
    seed: int,
) -> dict[str, Any]:
    """n sequential requests through the gateway interleaved with n straight to the workers (same
    prompt sizes, fresh random prompts each: no prefix-cache hits on either path)."""
    from app.rpc.worker_client import WorkerClient

    rng = np.random.default_rng(seed)
    pcs = [(WorkerClient(a), e, a) for a, e in prefill]
    dcs = [(WorkerClient(a), e) for a, e in decode]
    gw_ms: list[float] = []
    dir_ms: list[float] = []
    gw_codes: Counter[str] = Counter()
    dir_codes: Counter[str] = Counter()
    try:
        async with _client(8) as client:
            for i in range(n):
                body = _body(rng, n_tokens, max_new)
                t = time.perf_counter()
                code = await _one(client, urls[i % len(urls)], body, max_new)
                gw_codes[code] += 1
                if code == "ok":
                    gw_ms.append((time.perf_counter() - t) * 1000)
                ids = rng.integers(TOKEN_LO, TOKEN_HI, n_tokens).astype(np.int32)
                rid = f"direct-{seed}-{i}-{uuid.uuid4().hex[:6]}"
                ms, code = await _direct_one(pcs[i % len(pcs)], dcs[i % len(dcs)], rid, ids, max_new)
                dir_codes[code] += 1
                if code == "ok":
                    dir_ms.append(ms)
    finally:
        for c in [p[0] for p in pcs] + [d[0] for d in dcs]:
            with contextlib.suppress(Exception):
                await c.close()
    return {
        "gateway_ms": gw_ms,
        "direct_ms": dir_ms,
        "gateway_codes": dict(gw_codes),
        "direct_codes": dict(dir_codes),
    }


async def lg_sequential(urls: list[str], n: int, n_tokens: int, max_new: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    codes: Counter[str] = Counter()
    async with _client(8) as client:
        for i in range(n):
            codes[await _one(client, urls[i % len(urls)], _body(rng, n_tokens, max_new), max_new)] += 1
    return {"codes": dict(codes)}


LG_OPS = {
    "open_loop": lg_open_loop,
    "closed_loop": lg_closed_loop,
    "e2e": lg_e2e,
    "sequential": lg_sequential,
}


def _loadgen_main(conn: Any) -> None:
    """The load generator's process: one asyncio run per command received on the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        try:
            res = uvloop.run(LG_OPS[msg["op"]](**msg["args"]))
            conn.send({"ok": True, "result": res})
        except Exception as exc:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


class LoadGen:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_loadgen_main, args=(child,), name="loadgen", daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.conn.send({"op": op, "args": args})
        if not self.conn.poll(timeout):
            raise RuntimeError(f"load generator: {op} gave no answer within {timeout:g} s")
        reply = self.conn.recv()
        if not reply["ok"]:
            raise RuntimeError(f"load generator: {op} failed: {reply['error']}")
        return reply["result"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()  # SIGTERM to its pid
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ---- statistics ---------------------------------------------------------------------------------
def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def r3(x: float) -> float:
    return round(float(x), 3)


def errors_of(codes: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in sorted(codes.items()) if k != "ok"}


# ---- the run ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    open_rate: float = 100.0
    open_s: float = 20.0
    e2e_n: int = 200
    closed_s: float = 10.0
    concurrency: tuple[int, ...] = (1, 32, 128)
    idle_s: float = 5.0
    warmup: int = 20


FULL = Plan()
QUICK = Plan(open_s=5.0, e2e_n=50, closed_s=3.0, warmup=10)


def make_plan(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else FULL
    return replace(plan, open_rate=args.rate) if args.rate else plan


class Bench:
    def __init__(self, plan: Plan, gateways: list[Gateway], workers: list[Proc], redis_pid: int | None):
        self.plan = plan
        self.gws = gateways
        self.workers = workers
        self.urls = [g.url for g in gateways]
        self.gw_cpu = CpuMeter([g.proc.pid for g in gateways])
        self.worker_cpu = CpuMeter([w.pid for w in workers], tree=True)
        self.redis_cpu = CpuMeter([redis_pid]) if redis_pid else None
        self.lg = LoadGen()
        self.lg_cpu = CpuMeter([self.lg.pid])
        self.worker_ids = [f"{w.info['role']}@{w.info['address']}" for w in workers]
        self.incidents: list[dict[str, Any]] = []
        self._dead: set[int] = set()

    def phase(self, name: str, fn: Any, *args: Any) -> Any:
        """Run one measured phase: settle first, then note whether a process died during it."""
        settle_s = self.settle(name)
        before = len(self.incidents)
        out = fn(*args)
        died = self.check_alive(f"after {name}") - before
        for row in out if isinstance(out, list) else [out]:
            row.setdefault("settle_s", settle_s)
            row.setdefault("deaths_during", died)
        return out

    def close(self) -> None:
        self.lg.stop()

    def settle(self, phase: str, timeout: float = 45.0) -> float:
        """Before a phase: both replicas ready again with every worker up and owned (an overloaded
        open loop can leave work draining). Returns the seconds it took; raises when it does not."""
        t0 = time.monotonic()
        self.check_alive(f"before {phase}")
        ids = {f"{w.info['role']}@{w.info['address']}" for w in self.workers if w.popen.poll() is None}

        def ready() -> bool:
            owned: list[str] = []
            for g in self.gws:
                resp = g.get("/readyz")
                body = resp.json()
                if resp.status_code != 200 or any(body["workers"].get(w) != "up" for w in ids):
                    return False
                owned += body["owned"]
            return ids <= set(owned)

        wait_for(ready, timeout, f"the cluster to be ready before {phase}", interval=0.25)
        return round(time.monotonic() - t0, 2)

    def live_workers(self, role: str) -> list[Proc]:
        return [w for w in self.workers if w.info["role"] == role and w.popen.poll() is None]

    def check_alive(self, when: str) -> int:
        """Record every process that died since the last check (a worker's Triton can crash under
        load). The bench goes on with the survivors, and each phase says how many deaths it saw;
        it stops only when a replica died or a role has no worker left. Returns the deaths so far."""
        for p in [*self.workers, *(g.proc for g in self.gws)]:
            if p.popen.poll() is not None and p.pid not in self._dead:
                self._dead.add(p.pid)
                tail = p.log_tail(600).strip().replace("\n", " | ")
                self.incidents.append(
                    {"seen": when, "process": f"{p.name} {p.pid}", "rc": p.popen.returncode, "log_tail": tail}
                )
                console.print(f"[red]{when}: {p.name} ({p.pid}) exited rc={p.popen.returncode}")
                if p.name.startswith("gateway"):
                    raise RuntimeError(f"{when}: {p.name} exited rc={p.popen.returncode}: {tail}")
        for role in ("prefill", "decode"):
            if not self.live_workers(role):
                raise RuntimeError(f"{when}: no {role} worker left")
        return len(self.incidents)

    def stats(self, reset: bool) -> list[dict[str, Any]]:
        return [g.stats(reset=reset) for g in self.gws]

    def cpu(self) -> dict[str, float]:
        return {
            "t": time.monotonic(),
            "gateways": self.gw_cpu.seconds(),
            "workers": self.worker_cpu.seconds(),
            "redis": self.redis_cpu.seconds() if self.redis_cpu else float("nan"),
            "client": self.lg_cpu.seconds(),
        }

    @staticmethod
    def cores(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        dt = b["t"] - a["t"]
        return {f"{k}_cores": r3((b[k] - a[k]) / dt) for k in ("gateways", "workers", "redis", "client")}

    @staticmethod
    def samples(stats: list[dict[str, Any]], name: str) -> list[float]:
        return [v * 1000 for s in stats for v in s["samples"].get(name, [])]

    def idle_rate(self) -> dict[str, Any]:
        """Redis commands per second with no requests: heartbeats, pollers, leases, the owners'
        blocking reads. Subtracted from the loaded count to get the per-request cost."""
        s0, c0 = self.stats(False), self.cpu()
        time.sleep(self.plan.idle_s)
        s1, c1 = self.stats(False), self.cpu()
        t0, t1 = c0["t"], c1["t"]
        per = [
            (b["redis_commands_total"] - a["redis_commands_total"]) / (t1 - t0)
            for a, b in zip(s0, s1, strict=True)
        ]
        return {
            **self.cores(c0, c1),
            "window_s": r3(t1 - t0),
            "per_replica_per_s": [r3(x) for x in per],
            "total_per_s": r3(sum(per)),
        }

    def open_loop(self, idle: dict[str, Any], seed: int) -> dict[str, Any]:
        p = self.plan
        s0 = self.stats(True)  # clears the sample rings: only this phase's samples remain
        c0 = self.cpu()
        res = self.lg.call(
            "open_loop",
            p.open_s + REQUEST_TIMEOUT_S + 60,
            urls=self.urls,
            rate=p.open_rate,
            duration=p.open_s,
            n_tokens=PROMPT_TOKENS,
            max_new=MAX_NEW_TOKENS,
            seed=seed,
        )
        c1 = self.cpu()
        s1 = self.stats(True)
        codes = res["codes"]
        ok = codes.get("ok", 0)
        window = c1["t"] - c0["t"]
        raw = sum(b["redis_commands_total"] - a["redis_commands_total"] for a, b in zip(s0, s1, strict=True))
        background = idle["total_per_s"] * window
        origin = self.samples(s1, "origin_overhead_s")
        handoff = self.samples(s1, "handoff_latency_s")
        lat = res["latency_ms"]
        gw_cpu_s = c1["gateways"] - c0["gateways"]
        out = {
            "rate": p.open_rate,
            "duration_s": p.open_s,
            "sent": res["sent"],
            "ok": ok,
            "errors": errors_of(codes),
            "scheduled": res["scheduled"],
            "pacing_rps": r3(res["scheduled"] / res["send_s"]) if res["send_s"] > 0 else None,
            "send_lag_p99_ms": r3(pct(res["send_lag_ms"], 99)),
            "latency_p50_ms": r3(pct(lat, 50)),
            "latency_p99_ms": r3(pct(lat, 99)),
            "origin_samples": len(origin),
            "origin_p50_ms": r3(pct(origin, 50)),
            "origin_p99_ms": r3(pct(origin, 99)),
            "origin_max_ms": r3(max(origin)) if origin else None,
            "handoff_samples": len(handoff),
            "handoff_p50_ms": r3(pct(handoff, 50)),
            "handoff_p99_ms": r3(pct(handoff, 99)),
            "redis_cmds_raw": raw,
            "redis_cmds_background_est": r3(background),
            "redis_window_s": r3(window),
            "redis_cmds_per_req_raw": r3(raw / ok) if ok else None,
            "redis_cmds_per_req_net": r3((raw - background) / ok) if ok else None,
            "redis_cmds_per_replica": [
                b["redis_commands_total"] - a["redis_commands_total"] for a, b in zip(s0, s1, strict=True)
            ],
            "gateway_cpu_ms_per_req": r3(gw_cpu_s * 1000 / ok) if ok else None,
            "gateway_cpu_ms_per_req_net": r3((gw_cpu_s - idle["gateways_cores"] * window) * 1000 / ok)
            if ok
            else None,
            "completed_per_s": r3(ok / res["wall_s"]) if res["wall_s"] > 0 else None,
            **self.cores(c0, c1),
        }
        out["meets"] = {
            "origin_p50": bool(out["origin_p50_ms"] <= TARGETS["origin_p50_ms"]),
            "origin_p99": bool(out["origin_p99_ms"] <= TARGETS["origin_p99_ms"]),
            "handoff_p50": bool(out["handoff_p50_ms"] <= TARGETS["handoff_p50_ms"]),
            "redis_net": bool(
                out["redis_cmds_per_req_net"] is not None
                and out["redis_cmds_per_req_net"] <= TARGETS["redis_cmds_per_req"]
            ),
        }
        return out

    def e2e(self, seed: int) -> dict[str, Any]:
        p = self.plan
        pre = [(w.info["address"], w.info["epoch"]) for w in self.live_workers("prefill")]
        dec = [(w.info["address"], w.info["epoch"]) for w in self.live_workers("decode")]
        self.stats(True)
        c0 = self.cpu()
        res = self.lg.call(
            "e2e",
            p.e2e_n * 2 * REQUEST_TIMEOUT_S,
            urls=self.urls,
            prefill=pre,
            decode=dec,
            n=p.e2e_n,
            n_tokens=PROMPT_TOKENS,
            max_new=MAX_NEW_TOKENS,
            seed=seed,
        )
        c1 = self.cpu()
        s1 = self.stats(True)
        g, d = res["gateway_ms"], res["direct_ms"]
        origin = self.samples(s1, "origin_overhead_s")
        handoff = self.samples(s1, "handoff_latency_s")
        return {
            "n": p.e2e_n,
            "gateway_p50_ms": r3(pct(g, 50)),
            "gateway_p99_ms": r3(pct(g, 99)),
            "direct_p50_ms": r3(pct(d, 50)),
            "direct_p99_ms": r3(pct(d, 99)),
            "added_p50_ms": r3(pct(g, 50) - pct(d, 50)),
            "added_p99_ms": r3(pct(g, 99) - pct(d, 99)),
            "gateway_errors": errors_of(res["gateway_codes"]),
            "direct_errors": errors_of(res["direct_codes"]),
            "unloaded_origin_p50_ms": r3(pct(origin, 50)),
            "unloaded_handoff_p50_ms": r3(pct(handoff, 50)),
            **self.cores(c0, c1),
        }

    def closed_loop(self, seed: int) -> list[dict[str, Any]]:
        p = self.plan
        rows = []
        for c in p.concurrency:
            settle_s = self.settle(f"closed loop at {c} clients")
            before = len(self.incidents)
            c0 = self.cpu()
            res = self.lg.call(
                "closed_loop",
                p.closed_s + REQUEST_TIMEOUT_S + 60,
                urls=self.urls,
                concurrency=c,
                duration=p.closed_s,
                n_tokens=PROMPT_TOKENS,
                max_new=MAX_NEW_TOKENS,
                seed=seed + c,
            )
            c1 = self.cpu()
            ok = res["codes"].get("ok", 0)
            lat = res["latency_ms"]
            rows.append(
                {
                    "concurrency": c,
                    "duration_s": p.closed_s,
                    "ok": ok,
                    "rps": r3(ok / res["elapsed_s"]) if res["elapsed_s"] > 0 else None,
                    "latency_p50_ms": r3(pct(lat, 50)),
                    "latency_p99_ms": r3(pct(lat, 99)),
                    "errors": errors_of(res["codes"]),
                    "gateway_cpu_ms_per_req": r3((c1["gateways"] - c0["gateways"]) * 1000 / ok)
                    if ok
                    else None,
                    **self.cores(c0, c1),
                    "settle_s": settle_s,
                    "deaths_during": self.check_alive(f"after closed loop at {c} clients") - before,
                }
            )
            console.print(
                f"  {c:>3} clients: {rows[-1]['rps']} req/s, p50 {rows[-1]['latency_p50_ms']} ms, "
                f"p99 {rows[-1]['latency_p99_ms']} ms, errors {rows[-1]['errors'] or 0}"
            )
        self.stats(True)
        return rows


def setup_cluster(
    args: argparse.Namespace, log_dir: Path, redis_url: str, cluster: str, procs: list[Proc], results: dict
) -> tuple[list[Gateway], list[Proc]]:
    """Workers, then two worker-less replicas; workers registered once both replicas are live."""
    console.print("starting 2 prefill + 2 decode workers...")
    workers = start_workers(["prefill", "prefill", "decode", "decode"], log_dir)
    procs.extend(workers)
    worker_ids = [f"{w.info['role']}@{w.info['address']}" for w in workers]
    results["workers"] = {
        wid: {"epoch": w.info["epoch"], "startup_s": w.info.get("startup_s")}
        for wid, w in zip(worker_ids, workers, strict=True)
    }
    ids = pick_replica_ids(worker_ids)
    token = secrets.token_urlsafe(18)
    console.print(f"starting gateway replicas {ids[0]}, {ids[1]}...")
    gws: list[Gateway] = []
    for rid in ids:
        gw = start_gateway(log_dir, redis_url, cluster, rid, token, args.gateway_log_level)
        gws.append(gw)
        procs.append(gw.proc)
    wait_for(
        lambda: all(len(g.get("/admin/leases", admin=True).json()["live_replicas"]) == 2 for g in gws),
        30,
        "both replicas live",
    )
    r = gws[0].post("/admin/workers", {"workers": ",".join(worker_ids)})
    r.raise_for_status()

    def ready() -> bool:
        owned: list[str] = []
        for g in gws:
            resp = g.get("/readyz")
            body = resp.json()
            if resp.status_code != 200 or set(body["workers"]) != set(worker_ids):
                return False
            if any(h != "up" for h in body["workers"].values()):
                return False
            owned += body["owned"]
        return sorted(owned) == sorted(worker_ids)

    wait_for(ready, 60, "both replicas ready, every worker up and owned")
    results["ownership"] = {g.replica_id: g.get("/readyz").json()["owned"] for g in gws}
    if args.schedule == "direct":
        # The cluster-wide runtime config (one transaction; both replicas apply it on their next
        # config refresh, waited for below): one request per batch, and no in-flight cap holding
        # a request back while earlier ones are at the worker.
        patch = {"schedule_mode": "direct", "max_inflight_batches": 64}
        gws[0].put("/admin/config", patch).raise_for_status()

        def applied() -> bool:
            for g in gws:
                eff = g.get("/admin/config", admin=True).json()["effective"]
                if eff["schedule_mode"] != "direct" or eff["max_inflight_batches"] != 64:
                    return False
            return True

        wait_for(applied, 30, "both replicas on the direct schedule")
    return gws, workers


def run(args: argparse.Namespace, results: dict[str, Any], procs: list[Proc], log_dir: Path) -> None:
    plan = make_plan(args)
    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    emb = None
    redis_url = args.redis_url
    bench: Bench | None = None
    try:
        if not redis_url:
            from app.state.embedded_redis import start_embedded_redis

            emb = start_embedded_redis(cluster, idle_s=600)
            redis_url = emb.url
        results["config"]["redis"] = "embedded" if emb else "external"
        gws, workers = setup_cluster(args, log_dir, redis_url, cluster, procs, results)
        console.print(f"ownership: {results['ownership']}")
        with contextlib.suppress(Exception):
            results["runtime_config"] = gws[0].get("/admin/config", admin=True).json().get("config")
        bench = Bench(plan, gws, workers, emb.pid if emb else None)
        warm = bench.lg.call(
            "sequential",
            120,
            urls=bench.urls,
            n=plan.warmup,
            n_tokens=PROMPT_TOKENS,
            max_new=MAX_NEW_TOKENS,
            seed=args.seed,
        )
        results["warmup"] = warm["codes"]
        console.print(f"warm-up: {warm['codes']}; idle window {plan.idle_s:g} s...")
        idle = bench.idle_rate()
        results["idle"] = idle
        console.print(
            f"[bold]1. open loop[/bold] {plan.open_rate:g} req/s x {plan.open_s:g} s "
            f"(idle Redis {idle['total_per_s']} cmd/s)"
        )
        results["open_loop"] = bench.phase("open loop", bench.open_loop, idle, args.seed + 1)
        ol = results["open_loop"]
        console.print(
            f"  ok {ol['ok']}/{ol['sent']}, origin p50 {ol['origin_p50_ms']} ms, "
            f"hand-off p50 {ol['handoff_p50_ms']} ms, redis net {ol['redis_cmds_per_req_net']}/req"
        )
        console.print(f"[bold]2. end-to-end vs direct[/bold] ({plan.e2e_n} sequential each)")
        results["e2e"] = bench.phase("end-to-end", bench.e2e, args.seed + 2)
        console.print(f"[bold]3. closed loop[/bold] {plan.concurrency}, {plan.closed_s:g} s each")
        results["closed_loop"] = bench.phase("closed loop", bench.closed_loop, args.seed + 3)
        with contextlib.suppress(Exception):
            results["gateway_metrics_redis_latency"] = _redis_ping_hist(bench.gws)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping must not be interrupted
        if bench is not None:
            results["incidents"] = bench.incidents
            bench.close()
        exits: dict[str, dict[str, Any]] = {}
        gw_procs = [p for p in procs if p.name.startswith("gateway")]
        others = [p for p in procs if not p.name.startswith("gateway")]
        for group in (gw_procs, others):  # gateways first: they leave the cluster cleanly
            with ThreadPoolExecutor(max(1, len(group))) as ex:
                for p, rc in zip(group, ex.map(lambda w: w.stop(), group), strict=True):
                    exits[f"{p.name} {p.pid}"] = {"rc": rc, "stop_s": p.stop_s, "hung": p.hung}
        results["shutdown"] = exits
        if emb is not None:
            emb.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _redis_ping_hist(gws: list[Gateway]) -> dict[str, float]:
    """Mean Redis health-ping latency per replica from /metrics (a sanity check of Redis itself)."""
    out = {}
    for g in gws:
        text = g.get("/metrics").text
        s = c = 0.0
        for line in text.splitlines():
            if line.startswith("flexlb_redis_latency_seconds_sum"):
                s = float(line.split()[-1])
            elif line.startswith("flexlb_redis_latency_seconds_count"):
                c = float(line.split()[-1])
        out[g.replica_id] = r3(s / c * 1000) if c else float("nan")
    return out


# ---- report -------------------------------------------------------------------------------------
def _yes(b: bool) -> str:
    return "yes" if b else "NO"


def _err(d: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in d.items()) or "0"


def render(results: dict[str, Any]) -> None:
    ol = results.get("open_loop")
    if ol:
        t = Table(title=f"1. open loop {ol['rate']:g} req/s x {ol['duration_s']:g} s, 2 replicas")
        cols = [
            ("sched/sent/ok", f"{ol['scheduled']}/{ol['sent']}/{ol['ok']}"),
            ("errors", _err(ol["errors"])),
            ("lat p50/p99 ms", f"{ol['latency_p50_ms']:.1f}/{ol['latency_p99_ms']:.1f}"),
            ("origin p50 ms (<=1)", f"{ol['origin_p50_ms']:.3f} {_yes(ol['meets']['origin_p50'])}"),
            ("origin p99 ms (<=5)", f"{ol['origin_p99_ms']:.3f} {_yes(ol['meets']['origin_p99'])}"),
            ("hand-off p50 ms (<=2)", f"{ol['handoff_p50_ms']:.3f} {_yes(ol['meets']['handoff_p50'])}"),
            ("hand-off p99 ms", f"{ol['handoff_p99_ms']:.3f}"),
            ("redis/req raw", f"{ol['redis_cmds_per_req_raw']}"),
            ("redis/req net (<=12)", f"{ol['redis_cmds_per_req_net']} {_yes(ol['meets']['redis_net'])}"),
            ("gw CPU ms/req raw/net", f"{ol['gateway_cpu_ms_per_req']}/{ol['gateway_cpu_ms_per_req_net']}"),
            ("cores gw/wk/redis/client", _cores(ol)),
            ("deaths", str(ol.get("deaths_during", 0))),
        ]
        for name, _ in cols:
            t.add_column(name, justify="right")
        t.add_row(*(v for _, v in cols))
        console.print(t)
    e = results.get("e2e")
    if e:
        t = Table(
            title=f"2. end-to-end, {e['n']} sequential requests each "
            f"({PROMPT_TOKENS} tokens in, {MAX_NEW_TOKENS} out)"
        )
        for c in ("path", "p50 ms", "p99 ms", "errors"):
            t.add_column(c, justify="right")
        t.add_row(
            "gateway", f"{e['gateway_p50_ms']:.2f}", f"{e['gateway_p99_ms']:.2f}", _err(e["gateway_errors"])
        )
        t.add_row(
            "direct", f"{e['direct_p50_ms']:.2f}", f"{e['direct_p99_ms']:.2f}", _err(e["direct_errors"])
        )
        t.add_row("added", f"{e['added_p50_ms']:.2f}", f"{e['added_p99_ms']:.2f}", "")
        console.print(t)
    cl = results.get("closed_loop")
    if cl:
        t = Table(title="3. closed loop")
        for c in (
            "clients",
            "req/s",
            "p50 ms",
            "p99 ms",
            "errors",
            "gw CPU ms/req",
            "cores gw/wk/redis/client",
            "deaths",
        ):
            t.add_column(c, justify="right")
        for r in cl:
            t.add_row(
                str(r["concurrency"]),
                f"{r['rps']}",
                f"{r['latency_p50_ms']:.1f}",
                f"{r['latency_p99_ms']:.1f}",
                _err(r["errors"]),
                f"{r['gateway_cpu_ms_per_req']}",
                _cores(r),
                str(r.get("deaths_during", 0)),
            )
        console.print(t)
    for inc in results.get("incidents", []):
        console.print(f"[red]died ({inc['seen']}): {inc['process']} rc={inc['rc']}")
    for k, v in results.get("errors", {}).items():
        console.print(f"[red]{k} failed: {v}")


def _cores(d: dict[str, Any]) -> str:
    return "/".join(
        f"{d.get(k, float('nan')):.2f}"
        for k in ("gateways_cores", "workers_cores", "redis_cores", "client_cores")
    )


def summary_md(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        "# Gateway overhead summary",
        "",
        f"{results['started_at']}, {'quick' if cfg['quick'] else 'full'} run, {cfg['cpus']} CPUs, "
        f"load average before/after {cfg['loadavg_before']} / {results.get('loadavg_after')}, "
        f"{cfg['redis']} Redis, schedule `{cfg.get('schedule', 'batching')}`. "
        f"Workers: `{' '.join(cfg['worker_args'])}`. "
        f"Ownership: {results.get('ownership')}.",
        "",
    ]
    ol = results.get("open_loop")
    if ol:
        m = ol["meets"]
        lines += [
            f"## 1. Open loop, {ol['rate']:g} req/s for {ol['duration_s']:g} s over 2 replicas",
            "",
            "| metric | value | target |",
            "|---|---|---|",
            f"| scheduled / sent / ok | {ol['scheduled']} / {ol['sent']} / {ol['ok']} | |",
            f"| errors | {_err(ol['errors'])} | 0 |",
            f"| client latency p50 / p99 ms | {ol['latency_p50_ms']:.2f} / {ol['latency_p99_ms']:.2f} | |",
            f"| origin overhead p50 ms | {ol['origin_p50_ms']:.3f} | <= 1 ({_yes(m['origin_p50'])}) |",
            f"| origin overhead p99 ms | {ol['origin_p99_ms']:.3f} | <= 5 ({_yes(m['origin_p99'])}) |",
            f"| hand-off latency p50 ms | {ol['handoff_p50_ms']:.3f} | <= 2 ({_yes(m['handoff_p50'])}) |",
            f"| hand-off latency p99 ms | {ol['handoff_p99_ms']:.3f} | |",
            f"| Redis commands / request, raw | {ol['redis_cmds_per_req_raw']} | |",
            f"| Redis commands / request, net of idle | {ol['redis_cmds_per_req_net']} | "
            f"<= 12 ({_yes(m['redis_net'])}) |",
            f"| gateway CPU ms / request, raw / net of idle | {ol['gateway_cpu_ms_per_req']} / "
            f"{ol['gateway_cpu_ms_per_req_net']} | |",
            f"| completions / s (first send to last answer) | {ol['completed_per_s']} | |",
            f"| cores: gateways / workers / redis / client | {_cores(ol)} | |",
            f"| worker deaths during the phase | {ol.get('deaths_during', 0)} | 0 |",
            "",
            f"Idle Redis rate {results['idle']['total_per_s']} commands/s and idle gateway CPU "
            f"{results['idle']['gateways_cores']} cores (both replicas, "
            f"{results['idle']['window_s']} s window), subtracted over the "
            f"{ol['redis_window_s']} s loaded window.",
            "",
        ]
    e = results.get("e2e")
    if e:
        lines += [
            f"## 2. End-to-end, {e['n']} sequential requests per path",
            "",
            "| path | p50 ms | p99 ms | errors |",
            "|---|---|---|---|",
            f"| gateway | {e['gateway_p50_ms']:.2f} | {e['gateway_p99_ms']:.2f} | "
            f"{_err(e['gateway_errors'])} |",
            f"| direct to workers | {e['direct_p50_ms']:.2f} | {e['direct_p99_ms']:.2f} | "
            f"{_err(e['direct_errors'])} |",
            f"| added by the gateway | {e['added_p50_ms']:.2f} | {e['added_p99_ms']:.2f} | |",
            "",
            f"Unloaded origin overhead p50 {e['unloaded_origin_p50_ms']} ms, hand-off p50 "
            f"{e['unloaded_handoff_p50_ms']} ms. Worker deaths during the phase: "
            f"{e.get('deaths_during', 0)}.",
            "",
        ]
    cl = results.get("closed_loop")
    if cl:
        lines += [
            "## 3. Closed loop",
            "",
            "| clients | req/s | p50 ms | p99 ms | errors | gateway CPU ms/req | deaths during |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['concurrency']} | {r['rps']} | {r['latency_p50_ms']:.1f} | {r['latency_p99_ms']:.1f} | "
            f"{_err(r['errors'])} | {r['gateway_cpu_ms_per_req']} | {r.get('deaths_during', 0)} |"
            for r in cl
        ]
        lines.append("")
    for inc in results.get("incidents", []):
        lines.append(f"**died** ({inc['seen']}): {inc['process']} rc={inc['rc']}: `{inc['log_tail'][-300:]}`")
    if results.get("incidents"):
        lines.append("")
    for k, v in results.get("errors", {}).items():
        lines.append(f"**{k} failed:** {v}")
    return "\n".join(lines) + "\n"


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="short phases (5 s open loop, 50 sequential, 3 s closed)"
    )
    p.add_argument(
        "--output", type=Path, default=DEFAULT_OUT, help="directory for results.json and summary.md"
    )
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    p.add_argument("--gateway-log-level", default="INFO", help="gateway --log-level (product default INFO)")
    p.add_argument("--rate", type=float, default=None, help="open-loop rate in req/s (default 100)")
    p.add_argument(
        "--schedule",
        choices=["direct", "batching"],
        default="direct",
        help="direct (default): each request its own batch, dispatched at once, as issue #4 measures "
        "the path; batching: the product's default batcher (fixed window, at most 2 batches in flight "
        "per worker, so a request can wait for a batch to finish: batching policy, not hand-off)",
    )
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir: Path = args.output
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm)
    plan = make_plan(args)
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "quick": args.quick,
            "plan": plan.__dict__,
            "prompt_tokens": PROMPT_TOKENS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "worker_args": WORKER_ARGS + KV_TTL_ARGS,
            "gateway_log_level": args.gateway_log_level,
            "schedule": args.schedule,
            "targets": TARGETS,
            "open_loop_max_inflight": OPEN_LOOP_MAX_INFLIGHT,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        },
    }
    procs: list[Proc] = []
    t0 = time.monotonic()
    try:
        run(args, results, procs, log_dir)
    except (Exception, KeyboardInterrupt) as exc:
        results.setdefault("errors", {})["run"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]bench aborted: {type(exc).__name__}: {exc}")
    results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = round(time.monotonic() - t0, 1)
    results["config"].setdefault("redis", "embedded" if not args.redis_url else "external")
    (out_dir / "results.json").write_text(json.dumps(_json_safe(results), indent=2, allow_nan=False) + "\n")
    (out_dir / "summary.md").write_text(summary_md(results))
    render(results)
    console.print(f"wrote {out_dir / 'results.json'} and summary.md in {results['wall_s']} s")
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
