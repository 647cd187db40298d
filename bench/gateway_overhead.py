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
import contextlib
import json
import os
import platform
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _gw_cluster import (
    KV_TTL_ARGS,
    MAX_NEW_TOKENS,
    PROMPT_TOKENS,
    TARGETS,
    WORKER_ARGS,
    Gateway,
    Plan,
    make_plan,
    owners,
    parse_args,
    redis_ping_hist,
    setup_cluster,
    wait_for,
)
from _gw_loadgen import OPEN_LOOP_MAX_INFLIGHT, REQUEST_TIMEOUT_S, LoadGen
from _gw_report import e2e_latency, errors_of, render, summary_md
from _harness import (
    CpuMeter,
    Proc,
    console,
    json_safe,
    pct,
    r3,
    stop_on_sigterm,
)
from gw_profile import Profiler


# ---- the run ------------------------------------------------------------------------------------
class Bench:
    def __init__(
        self,
        plan: Plan,
        gateways: list[Gateway],
        workers: list[Proc],
        redis_pid: int | None,
        py_spy: Path | None = None,
    ):
        self.plan = plan
        self.gws = gateways
        self.workers = workers
        self.urls = [g.url for g in gateways]
        self.gw_cpu = CpuMeter([g.proc.pid for g in gateways], tree=True)  # --gateway-procs children
        self.prof = Profiler(py_spy, [pid for g in gateways for pid in g.pids()])
        self.worker_cpu = CpuMeter([w.pid for w in workers], tree=True)
        self.redis_cpu = CpuMeter([redis_pid]) if redis_pid else None
        self.lg = LoadGen()
        self.lg_cpu = CpuMeter([self.lg.pid])
        self.worker_ids = [f"{w.info['role']}@{w.info['address']}" for w in workers]
        self.incidents: list[dict[str, Any]] = []
        self._dead: set[int] = set()
        self.idle_gw_cores = 0.0  # the gateways' background loops, from `idle_rate`
        self.idle_redis_cores = 0.0  # Redis serving them (heartbeats, polls, blocking reads)

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
            for g in self.gws:
                resp = g.get("/readyz")
                body = resp.json()
                if resp.status_code != 200 or any(body["workers"].get(w) != "up" for w in ids):
                    return False
            return ids <= set(owners(self.gws[0]))

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
                    {
                        "seen": when,
                        "process": f"{p.name} {p.pid}",
                        "rc": p.popen.returncode,
                        "log_tail": tail,
                    }
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
        self.idle_gw_cores = (c1["gateways"] - c0["gateways"]) / (t1 - t0)
        if self.redis_cpu is not None:
            self.idle_redis_cores = (c1["redis"] - c0["redis"]) / (t1 - t0)
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
        with self.prof.phase("sequential"):
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
        g = res["gateway_ms"]

        def per_req(what: str, idle_cores: float = 0.0) -> float | None:  # net of the idle loops
            cpu_s = c1[what] - c0[what] - idle_cores * (c1["t"] - c0["t"])
            return r3(cpu_s * 1000 / len(g)) if g else None

        origin = self.samples(s1, "origin_overhead_s")
        handoff = self.samples(s1, "handoff_latency_s")
        return {
            "n": p.e2e_n,
            **e2e_latency(res),
            "unloaded_origin_p50_ms": r3(pct(origin, 50)),
            "unloaded_handoff_p50_ms": r3(pct(handoff, 50)),
            # the gateways are idle while the direct requests run: all their CPU is the n requests'
            "gateway_cpu_ms_per_req": per_req("gateways"),
            "redis_cpu_ms_per_req": per_req("redis"),
            "redis_cpu_ms_per_req_net": per_req("redis", self.idle_redis_cores),
            "gateway_cpu_ms_per_req_net": per_req("gateways", self.idle_gw_cores),
            **self.cores(c0, c1),
        }

    def direct_closed(self, seed: int) -> dict[str, Any]:
        """The gateway's two gRPC calls straight to the workers at the closed loop's first
        concurrency (the load generator's own CPU per request: the floor of the gRPC share)."""
        p = self.plan
        pre = [(w.info["address"], w.info["epoch"]) for w in self.live_workers("prefill")]
        dec = [(w.info["address"], w.info["epoch"]) for w in self.live_workers("decode")]
        return self.lg.call(
            "direct_closed",
            p.closed_s + REQUEST_TIMEOUT_S + 60,
            prefill=pre,
            decode=dec,
            concurrency=p.concurrency[0],
            duration=p.closed_s,
            n_tokens=PROMPT_TOKENS,
            max_new=MAX_NEW_TOKENS,
            seed=seed,
        )

    def closed_loop(self, seed: int) -> list[dict[str, Any]]:
        p = self.plan
        rows = []
        for c in p.concurrency:
            settle_s = self.settle(f"closed loop at {c} clients")
            before = len(self.incidents)
            c0 = self.cpu()
            with self.prof.phase(f"closed{c}"):
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
                    "redis_cpu_ms_per_req": r3((c1["redis"] - c0["redis"]) * 1000 / ok) if ok else None,
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


def stop_procs(procs: list[Proc]) -> dict[str, dict[str, Any]]:
    """Stop every process started here, gateways first (they leave the cluster cleanly), each
    group in parallel; returns each one's exit code, stop time and whether it hung."""
    exits: dict[str, dict[str, Any]] = {}
    gw_procs = [p for p in procs if p.name.startswith("gateway")]
    others = [p for p in procs if not p.name.startswith("gateway")]
    for group in (gw_procs, others):
        with ThreadPoolExecutor(max(1, len(group))) as ex:
            for p, rc in zip(group, ex.map(lambda w: w.stop(), group), strict=True):
                exits[f"{p.name} {p.pid}"] = {"rc": rc, "stop_s": p.stop_s, "hung": p.hung}
    return exits


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
        bench = Bench(plan, gws, workers, emb.pid if emb else None, args.py_spy)
        results["warmup"] = bench.lg.warm(bench.urls, plan.warmup, args.seed)
        console.print(f"warm-up: {results['warmup']}; idle window {plan.idle_s:g} s...")
        idle = bench.idle_rate()
        results["idle"] = idle
        console.print(
            f"[bold]1. open loop[/bold] {plan.open_rate:g} req/s x {plan.open_s:g} s "
            f"(idle Redis {idle['total_per_s']} cmd/s)"
        )
        if plan.open_s > 0:
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
            results["gateway_metrics_redis_latency"] = redis_ping_hist(bench.gws)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping must not be interrupted
        if bench is not None:
            results["incidents"] = bench.incidents
            bench.close()
        results["shutdown"] = stop_procs(procs)
        if emb is not None:
            emb.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- main ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    out_dir: Path = args.output
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()
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
            "replicas": args.replicas,
            "prefill_workers": args.prefill,
            "decode_workers": args.decode,
            "gateway_procs": args.gateway_procs,
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
    (out_dir / "results.json").write_text(json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    (out_dir / "summary.md").write_text(summary_md(results))
    render(results)
    console.print(f"wrote {out_dir / 'results.json'} and summary.md in {results['wall_s']} s")
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
