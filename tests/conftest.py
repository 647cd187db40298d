"""Shared, session-scoped fixtures: one pool of real Triton workers for the whole run.

Each worker costs ~6 s to start, so tests never start their own; they reconfigure the pool through
`control.configure` and the autouse `reset` puts it back (faults off, caches empty).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from workers.server.spawn import ReadyLine, worker_argv

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class WorkerProc:
    role: str
    proc: subprocess.Popen[str]
    address: str
    epoch: str
    ready: dict
    log_path: Path
    stdout: list[str] = field(default_factory=list)  # what it printed after its ready line
    reader: ReadyLine | None = None

    def stdout_after_exit(self) -> list[str]:
        """Its stdout lines once it exited and the reader drained the pipe."""
        if self.reader is not None:
            self.reader.thread.join(5)
        return self.stdout

    def kill_hard(self) -> None:
        """SIGKILL the worker and its Triton server together, like a crashed container."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_worker(role: str, tmp: Path, *args: str, timeout: float = 90.0) -> WorkerProc:
    """Start `flexlb worker` and wait (bounded) for its ready line."""
    log_path = tmp / f"{role}-{time.monotonic_ns()}.log"
    out = open(log_path, "w+")  # noqa: SIM115 - lives as long as the process
    # Own session: a hard kill can take the whole process group (worker + tritonserver + stubs).
    proc = subprocess.Popen(
        worker_argv(role, args),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=out,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = ReadyLine(proc, sink=lines.append)
    ev = reader.wait(timeout)
    if ev is not None:
        return WorkerProc(role, proc, ev["address"], ev["epoch"], ev, log_path, lines, reader)
    proc.kill()
    out.seek(0)
    raise RuntimeError(f"worker {role} did not start: {out.read()[-3000:]}")


async def back_on_its_port(
    role: str, tmp: Path, port: int, client: Any, old_epoch: str
) -> tuple[WorkerProc, str]:
    """A worker started again on `port` (a `--formula 1` worker, as the restart tests' own), and
    its new epoch as `client` (a `WorkerClient` to that port) reads it once its channel has
    reconnected (bounded: the channel's reconnect back-off)."""
    from app.rpc.worker_client import WorkerUnavailable

    w = await asyncio.to_thread(
        start_worker, role, tmp, "--profile", "formula", "--formula", "1", "--grpc-port", str(port)
    )
    st = None
    try:
        for _ in range(100):
            try:
                st = await client.status(timeout=1)
                break
            except WorkerUnavailable:
                await asyncio.sleep(0.1)
        assert st is not None and st["epoch"] == w.epoch != old_epoch
    except BaseException:
        w.stop()  # the caller never gets it to stop
        raise
    return w, str(st["epoch"])


@pytest.fixture(scope="session")
def worker_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="session")
def worker_pool(worker_tmp: Path) -> Iterator[dict[str, list[WorkerProc]]]:
    """Two prefill and one decode worker, started in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    roles = ["prefill", "prefill", "decode"]
    with ThreadPoolExecutor(len(roles)) as ex:
        futs = [
            ex.submit(start_worker, r, worker_tmp, "--profile", "formula", "--formula", "1") for r in roles
        ]
    errors = [f.exception() for f in futs if f.exception() is not None]
    procs = [f.result() for f in futs if f.exception() is None]
    if errors:  # never leak the ones that did start
        for p in procs:
            p.stop()
        raise errors[0]  # type: ignore[misc]
    pool = {
        "prefill": [p for p in procs if p.role == "prefill"],
        "decode": [p for p in procs if p.role == "decode"],
    }
    yield pool
    alive = [w for ws in pool.values() for w in ws]  # includes workers restarted after a crash
    with ThreadPoolExecutor(len(alive)) as ex:
        list(ex.map(lambda p: p.stop(), alive))


@pytest.fixture(autouse=True)
def _pool_worker_crash_is_an_error(request: pytest.FixtureRequest) -> Iterator[None]:
    """A pool worker that dies during a test is that test's ERROR, with its exit code and log tail
    (issue 14: a crash must be visible, never silently healed). It is then restarted so the tests
    after it still run on a full pool. A test that kills a worker on purpose uses its own."""
    if "worker_pool" not in request.fixturenames:
        yield
        return
    pool = request.getfixturevalue("worker_pool")
    tmp = request.getfixturevalue("worker_tmp")
    dead_before = _restart_dead(pool, tmp)
    if dead_before:  # died outside any pool test (between tests): still reported, on this one
        pytest.fail(f"pool worker(s) died before this test: {dead_before}")
    yield
    dead = _restart_dead(pool, tmp)
    if dead:
        pytest.fail(f"pool worker(s) died during this test: {dead}")


def _restart_dead(pool: dict[str, list[WorkerProc]], tmp: Path) -> list[str]:
    dead = []
    for role, workers in pool.items():
        for i, w in enumerate(workers):
            if w.proc.poll() is not None:
                tail = w.log_path.read_text(errors="replace")[-1500:] if w.log_path.exists() else ""
                dead.append(f"{role} {w.address} rc={w.proc.returncode}; log tail: {tail}")
                workers[i] = start_worker(role, tmp, "--profile", "formula", "--formula", "1")
    return dead


@pytest.fixture
async def clients(worker_pool: dict[str, list[WorkerProc]]) -> AsyncIterator[dict]:
    """Async clients for the pool; every worker is reset after the test."""
    from app.rpc.worker_client import WorkerClient

    out = {role: [WorkerClient(w.address) for w in ws] for role, ws in worker_pool.items()}
    all_clients = [c for cs in out.values() for c in cs]
    await asyncio.gather(*(c.reset() for c in all_clients))
    yield out
    await asyncio.gather(*(c.reset() for c in all_clients), return_exceptions=True)
    await asyncio.gather(*(c.close() for c in all_clients), return_exceptions=True)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # Every worker the tests start (the pool, their own, `flexlb up`'s) may be given faults.
    os.environ.setdefault("FLEXLB_WORKER_ALLOW_FAULTS", "1")


# ---- skip guard: CI fails when more tests skip than .ci/allowed-skips says ------------------------
_skip_log: list[str] = []  # "nodeid: reason" of every skipped test


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skip_log.append(f"{report.nodeid}: {reason}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With FLEXLB_MAX_SKIPS set (.ci/run sets it from .ci/allowed-skips), more skipped tests than
    that fail the run: a test that silently stops running (a missing package, file or service) is
    caught here instead of passing unnoticed. Lower the number when a skip goes away."""
    limit = os.environ.get("FLEXLB_MAX_SKIPS")
    if limit is None:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if len(_skip_log) > int(limit):
        if tr is not None:
            tr.write_line(f"\nskip guard: {len(_skip_log)} tests skipped, at most {limit} allowed:", red=True)
            for line in _skip_log:
                tr.write_line(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif tr is not None:
        tr.write_line(f"\nskip guard: {len(_skip_log)} skipped (at most {limit} allowed)")


@pytest.fixture(scope="session")
def shared_embedded_redis() -> Iterator[str]:
    """One embedded real Redis (own process, AOF) for the cluster tests; each test isolates itself
    with its own cluster prefix."""
    from app.state.embedded_redis import start_embedded_redis

    # Nothing heartbeats this prefix's membership (each test uses its own cluster prefix), so the
    # idle limit alone would end the server mid-run on a slow box (it did at 600 s, 13 min into
    # a loaded run). The watchdog instead follows this pytest process: gone, so is the server.
    emb = start_embedded_redis(f"t-{uuid.uuid4().hex[:6]}", idle_s=6 * 3600, owner_pid=os.getpid())
    yield emb.url
    emb.stop()


@pytest.fixture(params=["embedded", "env"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """Both Redis flavours: the embedded one and FLEXLB_REDIS_URL (skipped when unset)."""
    if request.param == "env":
        url = os.environ.get("FLEXLB_REDIS_URL")
        if not url:
            pytest.skip("FLEXLB_REDIS_URL not set")
        return url
    return request.getfixturevalue("shared_embedded_redis")  # type: ignore[no-any-return]


async def delete_prefix(r: Any, prefix: str) -> None:
    """Every key under a test's own prefix (it shares a Redis with other tests)."""
    keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=500)]
    if keys:
        await r.delete(*keys)


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Any]:
    """A `StateStore` on both Redis flavours, under a prefix of its own, emptied afterwards."""
    import redis.asyncio as aioredis

    from app.state.keys import Keys
    from app.state.store import StateStore

    r = aioredis.from_url(redis_url)
    prefix = f"flexlb-test-{uuid.uuid4().hex[:12]}"
    try:
        yield StateStore(r, Keys(prefix), lifecycle_ttl_s=120)
    finally:
        await delete_prefix(r, prefix)
        await r.aclose()


@pytest.fixture
def cluster() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def worker_call(address: str, op: str, **kw: object) -> dict:
    """One `WorkerClient` call (status, configure, reset, cancel, ...) from sync test code."""
    from app.rpc.worker_client import WorkerClient

    async def call() -> dict:
        c = WorkerClient(address)
        try:
            return await getattr(c, op)(**kw)  # type: ignore[no-any-return]
        finally:
            await c.close()

    return asyncio.run(call())


def running_on(address: str, rid: str) -> bool:
    """Whether request `rid` is in a batch the engine at `address` is running now (its status)."""
    return any(
        rid in b["request_ids"] and b["phase"] == "running" for b in worker_call(address, "status")["live"]
    )


def record_mark(address: str) -> int:
    """A prefill worker's newest finished-record number: `finished_records(address, mark)` then
    returns only what finished after it. A pool worker keeps every earlier test's records (reset
    keeps the history), and some tests send one request id on purpose to two clusters
    (test_openai_fidelity): a check of "nothing ran twice" must see only its own test's records,
    whatever ran before it on the pool (pytest-xdist changes that order)."""
    return int(worker_call(address, "status", since_seq=10**12)["seq"])


def finished_records(address: str, since_seq: int = 0) -> list[dict]:
    """Every finished record a prefill worker still keeps after `since_seq`, oldest first. Paged: a
    pool worker keeps earlier tests' records, and one status answer holds only the oldest page."""
    out: list[dict] = []
    since = since_seq
    for _ in range(1000):  # bounded: the engine's history is
        st = worker_call(address, "status", since_seq=since)
        out.extend(st["finished"])
        if not st.get("more") or not st["finished"]:
            break
        since = int(st["finished"][-1]["seq"])
    return out


@pytest.fixture
def workers_reset(worker_pool: dict[str, list[WorkerProc]]) -> Iterator[dict[str, list[WorkerProc]]]:
    """For sync tests (the async `clients` does the same): reset every pool worker before and after
    the test, so formulas, time scales, faults and caches never leak into the next test."""

    def reset_all() -> None:
        for ws in worker_pool.values():
            for w in ws:
                worker_call(w.address, "reset")

    reset_all()
    yield worker_pool
    reset_all()


async def handoff_rig(redis_url: str, prefix: str, address: str) -> tuple[Any, str, Any, Any, Any]:
    """A hand-off queue for the prefill worker at ``address`` under a fresh cluster prefix: the
    owner tests' common start on a real Redis, as (keys, worker id, client, store, handoff); the
    caller closes the client."""
    import redis.asyncio as aioredis

    from app.state.handoff import Handoff
    from app.state.keys import Keys
    from app.state.store import StateStore

    keys = Keys(f"{prefix}-{uuid.uuid4().hex[:6]}")
    wid = f"prefill@{address}"
    r = aioredis.from_url(redis_url)
    store = StateStore(r, keys)
    await store.load_scripts()
    handoff = Handoff(store)
    await handoff.ensure_group(wid)
    return keys, wid, r, store, handoff
