"""What a router adds, side by side (issue #20's table): FlexLB with 1 and 2 replicas, and (with
`--peers`) sglang-router 0.3.2 and vllm-router 0.1.17, both `cache_aware`, over the same zero-time
engine core, in one invocation.

- FlexLB runs over one prefill + one decode Triton worker (`--profile formula --formula 0
  --time-scale 0.001`), shared by both clusters; each cluster has its own embedded Redis, the
  `direct` schedule and the gateways' default log level (INFO). With 2 replicas one owns the
  prefill and the other the decode worker, so every request crosses replicas (the hand-off).
  Phases and figures are bench/gateway_overhead.py's (`Bench.e2e`, `Bench.closed_loop`).
- The peers run in P/D mode over one prefill + one decode HTTP facade (workers/http_facade) with
  the same engine arguments, both routers over the same two facades, started with
  bench/compare_routers.sh's flags (bench/_ro_peers.py). They need `.venv-peers`
  (`--install-peers` makes it with pip); without `--peers` only FlexLB runs (what CI does).

Per system and run: `--e2e-n` sequential requests through the router interleaved with as many
straight to the workers by that system's own worker path (FlexLB: the gRPC prefill then decode the
gateway makes; a peer: the HTTP calls that router makes to the facades, bench/_ro_loadgen.py);
added = router p50 (p99) minus direct p50 (p99). 1,000-token prompts, 4 new tokens, fresh random
prompts (no cache hits). Router CPU per request from /proc of the router's processes and their
children: sequential net of its idle rate (measured once per system), and in a closed loop at
`--clients` clients (raw); FlexLB's Redis separately. The systems are interleaved in every round
(the order rotated round by round) so the box's drift hits all alike; each figure is the median
over `--runs` runs. The load generator runs in its own process.

    .venv/bin/python bench/router_overhead.py [--peers] [--runs 3] [--quick] [--output DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from _gw_cluster import FULL, KV_TTL_ARGS, WORKER_ARGS, Plan, setup_cluster
from _gw_cluster import start_gateway_workers as start_flexlb_workers
from _gw_loadgen import LoadGen
from _harness import ROOT, Proc, console, json_safe, stop_on_sigterm
from _ro_peers import LABELS, PEERS, PeerBench, install_peers, start_facades, start_router
from gateway_overhead import Bench, stop_procs

FLEXLB = {"flexlb-1": 1, "flexlb-2": 2}  # system -> replicas
FLEX_LABELS = {
    "flexlb-1": "FlexLB, 1 replica, direct schedule",
    "flexlb-2": "FlexLB, 2 replicas (cross-replica hand-off)",
}
QUICK = dict(e2e_n=20, closed_s=2.0, idle_s=1.0, warmup=3)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--peers", action="store_true", help="also sglang-router and vllm-router (needs .venv-peers)"
    )
    p.add_argument(
        "--install-peers", action="store_true", help="pip-install the peers into .venv-peers if missing"
    )
    p.add_argument("--systems", default=None, help="comma-separated subset of flexlb-1,flexlb-2,sglang,vllm")
    p.add_argument("--runs", type=int, default=3, help="rounds; each figure is the median (default 3)")
    p.add_argument("--quick", action="store_true", help="1 run, 20 sequential, 2 s closed loop: a smoke run")
    p.add_argument("--e2e-n", type=int, default=None, help="sequential requests each way (200; --quick 20)")
    p.add_argument("--closed-s", type=float, default=None, help="closed-loop seconds (10; --quick 2)")
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients (default 32)")
    p.add_argument(
        "--workers",
        default=None,
        help="FlexLB over these running workers instead of starting two: prefill@HOST:PORT=PID,"
        "decode@HOST:PORT=PID (the PID for their CPU and liveness; tests/ pass the session pool's); "
        "they are configured to the bench's zero-time engine (formula 0, time scale 0.001, long KV TTL)",
    )
    p.add_argument(
        "--gateway-log-level", default="INFO", help="FlexLB gateways' --log-level (product default)"
    )
    p.add_argument("--output", type=Path, default=None, help="folder for results.json and table.md")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    if a.systems:
        a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
        bad = [s for s in a.systems if s not in (*FLEXLB, *PEERS)]
        if bad:
            p.error(f"unknown systems {bad}")
    else:
        a.systems = [*FLEXLB, *(PEERS if a.peers else ())]
    if a.quick and "--runs" not in (argv if argv is not None else sys.argv[1:]):
        a.runs = 1
    if a.output is None:
        a.output = ROOT / "bench" / "results" / f"router-overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    return a


def make_plan(a: argparse.Namespace) -> Plan:
    plan = replace(FULL, open_s=0.0, concurrency=(a.clients,))
    if a.quick:
        plan = replace(plan, **QUICK)
    if a.e2e_n:
        plan = replace(plan, e2e_n=a.e2e_n)
    return replace(plan, closed_s=a.closed_s) if a.closed_s else plan


def flexlb_cluster_args(a: argparse.Namespace, replicas: int) -> argparse.Namespace:
    """What `setup_cluster` reads from gateway_overhead's command line."""
    return argparse.Namespace(
        prefill=1,
        decode=1,
        replicas=replicas,
        gateway_procs=1,
        schedule="direct",
        gateway_log_level=a.gateway_log_level,
    )


class _Running:
    """A worker this bench did not start (`--workers`): polled through its pid, never stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if not psutil.pid_exists(self.pid):
            self.returncode = 1
        return self.returncode


def external_workers(spec: str) -> list[Proc]:
    """`Proc`s standing for running workers, with the `worker_ready` fields the bench reads (the
    epoch from the worker's own status)."""
    from app.rpc.worker_client import WorkerClient

    async def call(address: str, op: str, **kw: Any) -> dict[str, Any]:
        c = WorkerClient(address)
        try:
            return await getattr(c, op)(**kw)  # type: ignore[no-any-return]
        finally:
            await c.close()

    out = []
    for item in spec.split(","):
        role, _, rest = item.strip().partition("@")
        address, _, pid = rest.partition("=")
        if role not in ("prefill", "decode") or not address or not pid.isdigit():
            raise ValueError(f"--workers: {item!r} is not ROLE@HOST:PORT=PID")
        st = asyncio.run(call(address, "status"))
        popen: Any = _Running(int(pid))
        info = {"role": role, "address": address, "epoch": st["epoch"]}
        out.append(Proc(f"{role} worker (given)", popen, Path("/dev/null"), info=info, role=role))
    for w in out:  # the engine arguments of the bench's own workers (WORKER_ARGS, KV_TTL_ARGS)
        r = asyncio.run(call(w.address, "configure", formula="0", time_scale=0.001, kv_handle_ttl_ms=1e7))
        if not r.get("ok"):
            raise RuntimeError(f"--workers: {w.address} refused the zero-time configuration: {r}")
    return out


def start(
    a: argparse.Namespace, plan: Plan, procs: list[Proc], log_dir: Path, results: dict[str, Any]
) -> dict[str, Any]:
    """Every system's processes, warmed up and with its idle rate measured; system -> bench."""
    from app.state.embedded_redis import start_embedded_redis

    benches: dict[str, Any] = {}
    flex = [s for s in a.systems if s in FLEXLB]
    if flex:
        if a.workers:
            workers = external_workers(a.workers)
        else:
            console.print("starting 1 prefill + 1 decode Triton worker...")
            workers = start_flexlb_workers(["prefill", "decode"], log_dir)
            procs.extend(workers)

        def cluster(s: str) -> Bench:
            name = f"ro-{uuid.uuid4().hex[:8]}"
            emb = start_embedded_redis(name, idle_s=600)
            results["redis"].append(emb)
            sub: dict[str, Any] = {}
            args = flexlb_cluster_args(a, FLEXLB[s])
            gws, _ = setup_cluster(args, log_dir, emb.url, name, procs, sub, workers)
            results["systems"][s] = {"ownership": sub["ownership"]}
            return Bench(plan, gws, workers, emb.pid)

        with ThreadPoolExecutor(len(flex)) as ex:  # the clusters start in parallel (seconds each)
            futs = {s: ex.submit(cluster, s) for s in flex}
        for s, f in futs.items():
            benches[s] = f.result()
    peers = [s for s in a.systems if s in PEERS]
    if peers:
        if a.install_peers:
            install_peers()
        facades = start_facades(log_dir, procs)
        lg = LoadGen()
        results["loadgens"].append(lg)
        for s in peers:
            router, url = start_router(s, facades, log_dir, procs)
            benches[s] = PeerBench(s, plan, router, url, facades, lg)
            results["systems"][s] = {"url": url}
    for s, b in benches.items():
        urls, api = (b.urls, "flexlb") if isinstance(b, Bench) else ([b.url], "completions")
        results["systems"][s]["warmup"] = b.lg.warm(urls, plan.warmup, a.seed, api)
    for s, b in benches.items():  # after every warm-up: no start-up work left in any window
        results["systems"][s]["idle"] = b.idle_rate()
    return benches


def measure(b: Any, seed: int) -> dict[str, Any]:
    """One system's run: the sequential pairs, then the closed loop."""
    e2e = b.phase("end-to-end", b.e2e, seed) if isinstance(b, Bench) else b.e2e(seed)
    closed = b.closed_loop(seed + 1)[0]
    out = {"e2e": e2e, "closed": closed, "loadavg": round(os.getloadavg()[0], 2)}
    if isinstance(b, Bench):  # the floor under FlexLB's CPU: its two gRPC calls alone, 32 in flight
        out["direct_closed"] = b.direct_closed(seed + 2)
    return out


def by_path(b: Any, ownership: dict[str, str], e2e: dict[str, Any]) -> dict[str, float]:
    """FlexLB with 2 replicas: the added p50 of the requests sent to the prefill worker's owner
    (`local`: the hand-off and reply in process) and of those sent to the other (`cross`)."""
    per_url = e2e.get("added_p50_ms_by_url") or []
    gws = getattr(b, "gws", [])
    if len(per_url) < 2 or len(per_url) != len(gws):
        return {}
    prefill_owners = {o for w, o in ownership.items() if w.startswith("prefill")}
    out: dict[str, float] = {}
    for g, ms in zip(gws, per_url, strict=True):
        out["local" if g.replica_id in prefill_owners else "cross"] = ms
    return out


# ---- the table ----------------------------------------------------------------------------------
FIGURES = {
    "added_p50": "e2e.added_p50_ms",
    "added_p99": "e2e.added_p99_ms",
    "added_p50_ex": "e2e.added_p50_ms_calls_excluded",  # vllm-router: its extra calls as worker time
    "added_p99_ex": "e2e.added_p99_ms_calls_excluded",
    "direct_p50": "e2e.direct_p50_ms",
    "cpu_seq": "e2e.gateway_cpu_ms_per_req_net",
    "redis_seq": "e2e.redis_cpu_ms_per_req_net",
    "cpu_cl": "closed.gateway_cpu_ms_per_req",
    "redis_cl": "closed.redis_cpu_ms_per_req",
    "cores_cl": "closed.gateways_cores",
    "redis_cores_cl": "closed.redis_cores",
    "rps_cl": "closed.rps",
    "dcpu_seq": "e2e.direct_client_cpu_ms",
    "dcpu_cl": "direct_closed.client_cpu_ms_per_req",
    "loadavg": "loadavg",
}


def _get(run: dict[str, Any], path: str) -> float | None:
    cur: Any = run
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return None if cur is None or cur != cur else float(cur)


def medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, path in FIGURES.items():
        vals = [v for r in runs if (v := _get(r, path)) is not None]
        out[name] = statistics.median(vals) if vals else None
    errs = 0
    for r in runs:
        for k in ("gateway_errors", "direct_errors", "direct_with_calls_errors"):
            errs += sum(r["e2e"].get(k, {}).values())
        errs += sum(r["closed"].get("errors", {}).values())
    out["errors"] = errs
    return out


def _f(x: float | None, nd: int = 2) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def table(summary: dict[str, dict[str, Any]], clients: int) -> str:
    lines = [
        f"| system | added p50 | added p99 | router CPU per request (sequential / {clients} clients) | "
        f"cores at {clients} clients | req/s at {clients} clients | direct p50 | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, m in summary.items():
        cpu = f"{_f(m['cpu_seq'])} / {_f(m['cpu_cl'])} ms"
        cores = _f(m["cores_cl"])
        if s in FLEXLB:
            cpu += f" (+ Redis {_f(m['redis_seq'])} / {_f(m['redis_cl'])})"
            cores += f" + Redis {_f(m['redis_cores_cl'])}"
        label = FLEX_LABELS.get(s) or LABELS[s]
        p50, p99 = f"{_f(m['added_p50'])} ms", f"{_f(m['added_p99'])} ms"
        if m.get("added_p50_ex") is not None:  # as issue #20 writes vllm-router's row
            p50 = f"{_f(m['added_p50_ex'])} ms ({_f(m['added_p50'])} with its 4 extra calls)"
            p99 = f"{_f(m['added_p99_ex'])} ms ({_f(m['added_p99'])})"
        lines.append(
            f"| {label} | {p50} | {p99} | {cpu} | {cores} | "
            f"{_f(m['rps_cl'], 0)} | {_f(m['direct_p50'])} ms | {m['errors']} |"
        )
    return "\n".join(lines)


def floor_lines(summary: dict[str, dict[str, Any]], clients: int) -> str:
    """Under the table: what FlexLB's two gRPC calls alone cost a client (the floor of its CPU)."""
    return "\n".join(
        f"{FLEX_LABELS[s]}: its two gRPC calls alone (prefill then decode, the product's "
        f"`WorkerClient` straight to the workers) cost the client {_f(m['dcpu_seq'])} ms CPU "
        f"per request sequential / {_f(m['dcpu_cl'])} ms at {clients} in flight."
        for s, m in summary.items()
        if s in FLEXLB and m.get("dcpu_seq") is not None
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    plan = make_plan(a)
    log_dir = a.output / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()
    doc: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["bench/router_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": {
            "systems": a.systems,
            "runs": a.runs,
            "plan": plan.__dict__,
            "worker_args": WORKER_ARGS + KV_TTL_ARGS,
            "gateway_log_level": a.gateway_log_level,
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        },
        "systems": {},
        "runs": {s: [] for s in a.systems},
    }
    procs: list[Proc] = []
    live: dict[str, Any] = {"systems": doc["systems"], "redis": [], "loadgens": []}
    benches: dict[str, Any] = {}
    rc = 0
    t0 = time.monotonic()
    try:
        benches = start(a, plan, procs, log_dir, live)
        for r in range(a.runs):
            order = a.systems[r % len(a.systems) :] + a.systems[: r % len(a.systems)]
            for s in order:
                run = measure(benches[s], a.seed + 100 * r)
                doc["runs"][s].append(run)
                e, c = run["e2e"], run["closed"]
                console.print(
                    f"run {r + 1}/{a.runs} {s}: added p50 {e['added_p50_ms']} ms, "
                    f"p99 {e['added_p99_ms']} ms; "
                    f"CPU {e['gateway_cpu_ms_per_req_net']} / {c['gateway_cpu_ms_per_req']} ms/req; "
                    f"{c['rps']} req/s at {a.clients} clients (load {run['loadavg']})"
                )
                paths = by_path(benches[s], doc["systems"][s].get("ownership", {}), e)
                if paths:
                    run["e2e"]["added_p50_ms_by_path"] = paths
                    console.print(f"   added p50 by path: {paths}")
    except (Exception, KeyboardInterrupt) as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]bench aborted: {doc['error']}")
        rc = 1
    finally:
        for b in benches.values():
            if isinstance(b, Bench):
                b.close()
        for lg in live["loadgens"]:
            lg.stop()
        doc["shutdown"] = stop_procs(procs)
        for emb in live["redis"]:
            emb.stop()
    doc["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["medians"] = {s: medians(runs) for s, runs in doc["runs"].items() if runs}
    md = table(doc["medians"], a.clients)
    (a.output / "results.json").write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")
    (a.output / "table.md").write_text(md + "\n")
    print(md)
    if floors := floor_lines(doc["medians"], a.clients):
        (a.output / "floor.md").write_text(floors + "\n")
        print(floors)
    console.print(
        f"{a.runs} run(s), load average before/after {doc['config']['loadavg_before']} / "
        f"{doc['loadavg_after']}; "
        f"wrote {a.output / 'results.json'} in {doc['wall_s']} s"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
