"""Shared, session-scoped fixtures: one pool of real Triton workers for the whole run.

Each worker costs ~6 s to start, so tests never start their own; they reconfigure the pool through
`control.configure` and the autouse `reset` puts it back (faults off, caches empty).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class WorkerProc:
    role: str
    proc: subprocess.Popen[str]
    address: str
    epoch: str
    ready: dict
    log_path: Path

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_worker(role: str, tmp: Path, *args: str, timeout: float = 60.0) -> WorkerProc:
    """Start `flexlb worker` and wait (bounded) for its ready line."""
    log_path = tmp / f"{role}-{time.monotonic_ns()}.log"
    out = open(log_path, "w+")  # noqa: SIM115 - lives as long as the process
    cmd = [sys.executable, "-m", "app.cli", "worker", "--role", role, "--log-level", "WARNING", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "worker_ready":
            return WorkerProc(role, proc, ev["address"], ev["epoch"], ev, log_path)
    proc.kill()
    out.seek(0)
    raise RuntimeError(f"worker {role} did not start: {out.read()[-3000:]}")


@pytest.fixture(scope="session")
def worker_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="session")
def worker_pool(worker_tmp: Path) -> Iterator[dict[str, list[WorkerProc]]]:
    """Two prefill and one decode worker, started in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    roles = ["prefill", "prefill", "decode"]
    with ThreadPoolExecutor(len(roles)) as ex:
        procs = list(
            ex.map(lambda r: start_worker(r, worker_tmp, "--profile", "formula", "--formula", "1"), roles)
        )
    pool = {
        "prefill": [p for p in procs if p.role == "prefill"],
        "decode": [p for p in procs if p.role == "decode"],
    }
    yield pool
    with ThreadPoolExecutor(len(procs)) as ex:
        list(ex.map(lambda p: p.stop(), procs))


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
