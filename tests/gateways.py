"""Start real gateway replicas (subprocesses on free ports) for the cluster tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.cluster.rendezvous import assign
from app.netports import free_port

ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "test-admin-token"
# Bounds on a hang, not latency checks: a replica's start-up is mostly imports (~1 s of CPU) and a
# helper call is one local round trip, but at a load average of ~20 on 2 cores both took over
# 30 s / 5 s of wall clock in CI runs. Nothing asserts on these; they only end a hung test.
START_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 30.0


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    replica_id: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, admin: bool = False, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if admin else {}
        return httpx.get(self.url + path, headers=headers, timeout=HTTP_TIMEOUT_S, **kw)

    def post(self, path: str, admin: bool = False, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if admin else {}
        return httpx.post(self.url + path, headers=headers, timeout=HTTP_TIMEOUT_S, **kw)

    def delete(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.delete(self.url + path, timeout=HTTP_TIMEOUT_S, **kw)

    def readyz(self) -> dict[str, Any]:
        return self.get("/readyz").json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_gateway(
    tmp: Path,
    redis_url: str | None,
    cluster: str,
    workers: str | None = None,
    timeout: float = START_TIMEOUT_S,
    **env: str,
) -> Gateway:
    """`redis_url=None` starts the replica without one: it runs its own embedded Redis."""
    port = free_port()
    rid = f"gw-{uuid.uuid4().hex[:6]}"
    log_path = tmp / f"{rid}.log"
    full_env = {
        **{k: v for k, v in os.environ.items() if k != "FLEXLB_REDIS_URL"},
        "FLEXLB_CLUSTER": cluster,
        "FLEXLB_ADMIN_TOKEN": ADMIN_TOKEN,
        "FLEXLB_REPLICA_ID": rid,
        **env,
    }
    rid = full_env["FLEXLB_REPLICA_ID"]
    cmd = [sys.executable, "-m", "app.cli", "gateway", "--port", str(port)]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    if workers:
        cmd += ["--workers", workers]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    gw = Gateway(proc, port, rid, log_path, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {gw.log()[-3000:]}")
        try:
            if httpx.get(gw.url + "/healthz", timeout=5).status_code == 200:
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    gw.kill()
    raise RuntimeError(f"gateway did not start: {gw.log()[-3000:]}")


def wait_for(cond: Any, timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Bounded poll on a condition; returns its first truthy value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def specs(pool: dict[str, list[Any]]) -> str:
    """The ``--workers`` argument naming every worker of the session pool (``role@address``)."""
    return ",".join(f"{w.role}@{w.address}" for ws in pool.values() for w in ws)


def lease_owner(gw: Gateway, wid: str) -> str | None:
    """The replica holding `wid`'s owner lease, as `gw` reports it."""
    leases = gw.get("/admin/leases", admin=True).json()
    return (leases["owners"].get(wid) or {}).get("holder")


def log_messages(gw: Gateway) -> list[str]:
    """The replica's log messages (its log is JSON lines)."""
    return [str(json.loads(ln).get("msg", "")) for ln in gw.log().splitlines() if ln.startswith("{")]


def metric_value(gw: Gateway, name: str, **labels: str) -> float:
    """The sum of `name`'s series on `gw`'s /metrics whose labels include `labels`."""
    total = 0.0
    for line in gw.get("/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def ids_owning(workers: list[str], wid: str, prefix: str = "gw-") -> tuple[str, str]:
    """Replica ids (a, b) for which rendezvous hashing gives `wid` to a, so whether leases are
    taken first-come or rebalanced, a owns it while both live."""
    for i in range(1000):
        a, b = f"{prefix}a{i}", f"{prefix}b{i}"
        if assign(workers, [a, b])[wid] == a:
            return a, b
    raise AssertionError("no split found")
