"""The gateway-overhead benchmark's cluster: its workers, gateway processes and Redis (see
bench/gateway_overhead.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from _harness import (
    DEFAULT_OUT,
    ROOT,
    Proc,
    console,
    r3,
    start_workers,
    wait_until,
)

from app.netports import free_port

PROMPT_TOKENS = 1000
MAX_NEW_TOKENS = 4
TARGETS = {
    "origin_p50_ms": 1.0,
    "origin_p99_ms": 5.0,
    "handoff_p50_ms": 2.0,
    "redis_cmds_per_req": 12.0,
}
WORKER_ARGS = ["--profile", "formula", "--formula", "0", "--time-scale", "0.001"]
# The KV handle TTL is in *modelled* ms: at time scale 0.001 the default 30,000 ms would be 30 wall
# ms, and any queueing under load would expire the KV before decode fetches it (a re-prefill, i.e.
# noise). 10,000,000 modelled ms = 10 wall s; decode fetches (and frees) it long before that.
KV_TTL_ARGS = ["--kv-handle-ttl-ms", "10000000"]


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
    if args.concurrency:
        plan = replace(plan, concurrency=tuple(int(c) for c in args.concurrency.split(",")))
    if args.e2e_n:
        plan = replace(plan, e2e_n=args.e2e_n)
    if args.no_open_loop:
        plan = replace(plan, open_s=0.0)
    return replace(plan, open_rate=args.rate) if args.rate else plan


def parse_args(argv: Sequence[str] | None, doc: str | None) -> argparse.Namespace:
    """The bench's command line (bench/gateway_overhead.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="short phases (5 s open loop, 50 sequential, 3 s closed)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUT,
        help="directory for results.json and summary.md",
    )
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    p.add_argument(
        "--gateway-log-level",
        default="INFO",
        help="gateway --log-level (product default INFO)",
    )
    p.add_argument("--rate", type=float, default=None, help="open-loop rate in req/s (default 100)")
    p.add_argument(
        "--schedule",
        choices=["direct", "batching"],
        default="direct",
        help="direct (default): each request its own batch, dispatched at once, as issue #4 measures "
        "the path; batching: the product's default batcher (fixed window, at most 2 batches in flight "
        "per worker, so a request can wait for a batch to finish: batching policy, not hand-off)",
    )
    p.add_argument("--replicas", type=int, default=2, help="gateway replicas (default 2)")
    p.add_argument("--prefill", type=int, default=2, help="zero-time prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=2, help="zero-time decode workers (default 2)")
    p.add_argument(
        "--gateway-procs",
        type=int,
        default=1,
        help="processes per replica (SO_REUSEPORT, default 1)",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="closed-loop clients, comma-separated (1,32,128)",
    )
    p.add_argument(
        "--e2e-n",
        type=int,
        default=None,
        help="sequential requests each way (200; --quick 50)",
    )
    p.add_argument("--no-open-loop", action="store_true", help="skip the open-loop phase")
    p.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="record each gateway process with py-spy (collapsed stacks) during the sequential and "
        "closed-loop phases into this folder",
    )
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def wait_for(cond: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    """`wait_until`, an HTTP error or unparsable answer counting as "not yet"."""
    return wait_until(cond, timeout, what, interval, ok=(httpx.HTTPError, ValueError))


def start_gateway_workers(roles: Sequence[str], log_dir: Path) -> list[Proc]:
    """Workers at zero modelled time (formula 0, time scale 0.001), so the figures are the gateway's."""
    return start_workers([(r, [*WORKER_ARGS, *KV_TTL_ARGS]) for r in roles], log_dir)


@dataclass
class Gateway:
    proc: Proc
    port: int
    replica_id: str
    token: str
    procs: int = 1  # serving processes (`--gateway-procs`), each a replica `<id>.<k>`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The replica's process and, with `--gateway-procs`, the serving processes it started."""
        import psutil

        kids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        return [self.proc.pid, *kids]

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
        """The replica's samples and Redis count; with `--gateway-procs`, every process's, summed
        (each call is a new connection, which the kernel gives to any process of the port)."""
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(20 * self.procs):
            if reset:  # state changes are POSTs
                r = self.post("/admin/stats/reset", {}, timeout=10.0)
            else:
                r = self.get("/admin/stats", admin=True, timeout=10.0)
            r.raise_for_status()
            body = r.json()
            seen.setdefault(body["replica"], body)
            if len(seen) >= self.procs:
                break
        if len(seen) < self.procs:
            raise RuntimeError(f"stats of {len(seen)} of {self.procs} processes of {self.replica_id}")
        out: dict[str, Any] = {"replica": self.replica_id, "redis_commands_total": 0, "samples": {}}
        for body in seen.values():
            out["redis_commands_total"] += body["redis_commands_total"]
            for name, vals in body["samples"].items():
                out["samples"].setdefault(name, []).extend(vals)
        return out


def start_gateway(
    log_dir: Path,
    redis_url: str,
    cluster: str,
    replica_id: str,
    token: str,
    log_level: str,
    procs: int = 1,
) -> Gateway:
    """`flexlb gateway` with no workers; returns once /healthz answers (bounded)."""
    port = free_port()
    log_path = log_dir / f"{replica_id}.log"
    env = {
        **{k: v for k, v in os.environ.items() if k != "FLEXLB_REDIS_URL"},
        "FLEXLB_CLUSTER": cluster,
        "FLEXLB_ADMIN_TOKEN": token,
        "FLEXLB_REPLICA_ID": replica_id,
        # SLO admission scales the cluster's TTFT SLO by the worker's time scale (0.001 here), so
        # the deadline is ~2 wall ms, below the gateway's 20 ms floor: every request would be
        # refused 429 slo_unattainable. This bench measures the path, not admission.
        "FLEXLB_ADMISSION": "off",
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
        *(["--procs", str(procs)] if procs > 1 else []),
    ]
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    gw = Gateway(Proc(f"gateway {replica_id}", popen, log_path), port, replica_id, token, procs)
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


def members(ids: Sequence[str], procs: int) -> list[str]:
    """The cluster members of these replicas: with `--gateway-procs`, `<id>.<k>` for k >= 1."""
    return [m for rid in ids for m in [rid, *(f"{rid}.{k}" for k in range(1, procs))]]


def pick_replica_ids(worker_ids: Sequence[str], n: int = 2, procs: int = 1) -> tuple[str, ...]:
    """`n` replica ids for which rendezvous hashing spreads the workers: with two replicas and a
    worker of each role per replica, each gets one prefill and one decode worker; otherwise every
    replica owns at least one worker where there are enough (with one prefill and one decode
    worker and two replicas, one owns the prefill and the other the decode worker, so every
    request crosses replicas). Leases are sticky, so this is also what they end up holding."""
    from app.cluster.rendezvous import assign

    if n == 1 and procs == 1:
        return (f"gwb-{uuid.uuid4().hex[:6]}",)
    pre = [w for w in worker_ids if w.startswith("prefill@")]
    dec = [w for w in worker_ids if w.startswith("decode@")]
    for _ in range(10_000):
        ids = tuple(f"gwb-{uuid.uuid4().hex[:6]}" for _ in range(n))
        every = members(ids, procs)
        owner = assign(worker_ids, every)
        m = len(every)
        if len(pre) >= m and len(dec) >= m:
            if {owner[w] for w in pre} == set(every) and {owner[w] for w in dec} == set(every):
                return ids
        elif len({owner[w] for w in worker_ids}) == min(m, len(worker_ids)):
            return ids
    raise RuntimeError("no replica ids split the workers")  # pragma: no cover (p = 0.75^10000)


def setup_cluster(
    args: argparse.Namespace,
    log_dir: Path,
    redis_url: str,
    cluster: str,
    procs: list[Proc],
    results: dict,
    workers: list[Proc] | None = None,
) -> tuple[list[Gateway], list[Proc]]:
    """Workers (unless given: bench/router_overhead.py runs two clusters over one pair), then
    `--replicas` worker-less replicas; workers registered once all are live."""
    if workers is None:
        console.print(f"starting {args.prefill} prefill + {args.decode} decode workers...")
        workers = start_gateway_workers(["prefill"] * args.prefill + ["decode"] * args.decode, log_dir)
        procs.extend(workers)
    worker_ids = [f"{w.info['role']}@{w.info['address']}" for w in workers]
    results["workers"] = {
        wid: {"epoch": w.info["epoch"], "startup_s": w.info.get("startup_s")}
        for wid, w in zip(worker_ids, workers, strict=True)
    }
    ids = pick_replica_ids(worker_ids, args.replicas, args.gateway_procs)
    every = members(ids, args.gateway_procs)
    token = secrets.token_urlsafe(18)
    console.print(f"starting gateway replicas {', '.join(ids)}...")
    gws: list[Gateway] = []
    with ThreadPoolExecutor(len(ids)) as ex:  # each takes seconds to import and start: in parallel
        futs = [
            ex.submit(
                start_gateway,
                log_dir,
                redis_url,
                cluster,
                rid,
                token,
                args.gateway_log_level,
                args.gateway_procs,
            )
            for rid in ids
        ]
        for f in futs:  # every started one is kept, so the caller stops it whatever failed
            if f.exception() is None:
                gws.append(f.result())
                procs.append(gws[-1].proc)
    for f in futs:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    wait_for(
        lambda: all(
            len(g.get("/admin/leases", admin=True).json()["live_replicas"]) >= len(every) for g in gws
        ),
        60,
        "every replica live",
    )
    r = gws[0].post("/admin/workers", {"workers": ",".join(worker_ids)})
    r.raise_for_status()

    def ready() -> bool:
        for g in gws:
            resp = g.get("/readyz")
            body = resp.json()
            if resp.status_code != 200 or set(body["workers"]) != set(worker_ids):
                return False
            if any(h != "up" for h in body["workers"].values()):
                return False
        return set(owners(gws[0])) == set(worker_ids)

    wait_for(ready, 60, "every replica ready, every worker up and owned")
    results["ownership"] = owners(gws[0])
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


def owners(gw: Gateway) -> dict[str, str]:
    """Worker -> the member holding its owner lease (cluster-wide, whichever process answers)."""
    body = gw.get("/admin/leases", admin=True).json()
    return {w: o["holder"] for w, o in body["owners"].items() if o}


def redis_ping_hist(gws: list[Gateway]) -> dict[str, float]:
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
