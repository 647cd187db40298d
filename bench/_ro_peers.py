"""The peer routers of bench/router_overhead.py: sglang-router and vllm-router in P/D mode over
HTTP facades (workers/http_facade) of the same zero-time engine core FlexLB's Triton workers run,
started the way bench/compare_routers.sh starts them (same flags), and their measured phases.

The routers come from `.venv-peers` (`sglang-router==0.3.2`, `vllm-router==0.1.17`, installed by
compare_routers.sh or `--install-peers`); every process started here is a `Proc` the caller stops.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _gw_cluster import KV_TTL_ARGS, MAX_NEW_TOKENS, PROMPT_TOKENS, WORKER_ARGS, Plan, wait_for
from _gw_loadgen import REQUEST_TIMEOUT_S, LoadGen
from _gw_report import e2e_latency, errors_of
from _harness import ROOT, CpuMeter, Proc, console, pct, r3

from app.netports import free_port

PEERS_VENV = ROOT / ".venv-peers"
PEER_PKGS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
PEERS = ("sglang", "vllm")
LABELS = {"sglang": "sglang-router 0.3.2 cache_aware", "vllm": "vllm-router 0.1.17 cache_aware"}
COMMON = ["--policy", "cache_aware", "--max-concurrent-requests", "4096", "--queue-size", "4096"]
COMMON += ["--request-timeout-secs", "600", "--prometheus-host", "127.0.0.1"]
# Each router's Prometheus exporter gets a free port: both default to 29000, and the second
# router on the box panics at start ("Address already in use").


def install_peers() -> None:
    """`.venv-peers` as compare_routers.sh makes it (pip from PyPI), when a router is missing."""
    if all((PEERS_VENV / "bin" / b).exists() for b in ("sglang-router", "vllm-router")):
        return
    console.print(f"installing {' '.join(PEER_PKGS)} into {PEERS_VENV}")
    subprocess.run(["python3", "-m", "venv", str(PEERS_VENV)], check=True)
    subprocess.run([str(PEERS_VENV / "bin" / "pip"), "install", "-q", *PEER_PKGS], check=True)


def _spawn(name: str, cmd: Sequence[str], log_path: Path) -> Proc:
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ),
        )
    return Proc(name, popen, log_path)


def _wait_log(p: Proc, needle: str, timeout: float) -> None:
    def seen() -> bool:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{p.name} exited rc={p.popen.returncode}: {p.log_tail()}")
        return needle in p.log_tail(100_000)

    wait_for(seen, timeout, f"{p.name}: {needle}")


@dataclass
class Facades:
    """One prefill + one decode facade (zero-time, the Triton workers' engine arguments)."""

    prefill: Proc
    decode: Proc
    p_url: str
    p_bootstrap: int
    d_url: str


def start_facades(log_dir: Path, procs: list[Proc]) -> Facades:
    args = ["-m", "workers.http_facade", *WORKER_ARGS, *KV_TTL_ARGS]
    pp, bp, dp = free_port(), free_port(), free_port()
    pre = _spawn(
        "facade prefill",
        [sys.executable, *args, "--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp)],
        log_dir / "facade-prefill.log",
    )
    procs.append(pre)
    dec = _spawn(
        "facade decode",
        [sys.executable, *args, "--role", "decode", "--port", str(dp)],
        log_dir / "facade-decode.log",
    )
    procs.append(dec)
    for p in (pre, dec):
        _wait_log(p, "facade_ready", 60)
    return Facades(pre, dec, f"http://127.0.0.1:{pp}", bp, f"http://127.0.0.1:{dp}")


def start_router(kind: str, f: Facades, log_dir: Path, procs: list[Proc]) -> tuple[Proc, str]:
    """The router in P/D mode over the facades; returns once it answers (bounded)."""
    port = free_port()
    bin_dir = PEERS_VENV / "bin"
    if kind == "sglang":
        cmd = [str(bin_dir / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--pd-disaggregation", "--prefill", f.p_url, str(f.p_bootstrap), "--decode", f.d_url]
        cmd += [*COMMON, "--prometheus-port", str(free_port()), "--log-level", "warn"]
    else:
        cmd = [str(bin_dir / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--vllm-pd-disaggregation", "--prefill", f.p_url, "--decode", f.d_url]
        cmd += [*COMMON, "--prometheus-port", str(free_port()), "--log-level", "warning"]
    p = _spawn(f"{kind}-router", cmd, log_dir / f"{kind}-router.log")
    procs.append(p)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{kind}-router exited rc={p.popen.returncode}: {p.log_tail()}")
        return any(httpx.get(url + path, timeout=2).status_code == 200 for path in ("/v1/models", "/health"))

    wait_for(up, 90, f"{kind}-router answering")
    return p, url


class PeerBench:
    """One peer router's phases, in the shape of gateway_overhead's `Bench` rows (so one table
    reads both): the sequential pairs (router vs straight to the facades) and the closed loop."""

    def __init__(self, kind: str, plan: Plan, router: Proc, url: str, f: Facades, lg: LoadGen) -> None:
        self.kind = kind
        self.plan = plan
        self.url = url
        self.f = f
        self.lg = lg
        self.router = router
        self.cpu_meter = CpuMeter([router.pid], tree=True)
        self.facade_cpu = CpuMeter([f.prefill.pid, f.decode.pid], tree=True)
        self.idle_cores = 0.0

    def cpu(self) -> dict[str, float]:
        return {
            "t": time.monotonic(),
            "router": self.cpu_meter.seconds(),
            "workers": self.facade_cpu.seconds(),
        }

    def alive(self) -> None:
        for p in (self.router, self.f.prefill, self.f.decode):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited rc={p.popen.returncode}: {p.log_tail(600)}")

    def idle_rate(self) -> dict[str, float]:
        c0 = self.cpu()
        time.sleep(self.plan.idle_s)
        c1 = self.cpu()
        self.idle_cores = (c1["router"] - c0["router"]) / (c1["t"] - c0["t"])
        return {"router_cores": r3(self.idle_cores), "window_s": r3(c1["t"] - c0["t"])}

    def e2e(self, seed: int) -> dict[str, Any]:
        p = self.plan
        self.alive()
        c0 = self.cpu()
        res = self.lg.call(
            "peer_e2e",
            p.e2e_n * 2 * REQUEST_TIMEOUT_S,
            urls=[self.url],
            style=self.kind,
            prefill=[(self.f.p_url, self.f.p_bootstrap)],
            decode=[self.f.d_url],
            n=p.e2e_n,
            n_tokens=PROMPT_TOKENS,
            max_new=MAX_NEW_TOKENS,
            seed=seed,
            also="vllm_calls" if self.kind == "vllm" else None,
        )
        c1 = self.cpu()
        g, also = res["gateway_ms"], res["also_ms"]
        cpu_s = c1["router"] - c0["router"]
        extra = {}
        if also:  # the router's own cost with its extra calls' answers taken as the workers'
            extra = {
                "direct_with_calls_p50_ms": r3(pct(also, 50)),
                "added_p50_ms_calls_excluded": r3(pct(g, 50) - pct(also, 50)),
                "added_p99_ms_calls_excluded": r3(pct(g, 99) - pct(also, 99)),
                "direct_with_calls_errors": errors_of(res["also_codes"]),
            }
        return extra | {
            "n": p.e2e_n,
            **e2e_latency(res),
            "gateway_cpu_ms_per_req": r3(cpu_s * 1000 / len(g)) if g else None,
            "gateway_cpu_ms_per_req_net": r3((cpu_s - self.idle_cores * (c1["t"] - c0["t"])) * 1000 / len(g))
            if g
            else None,
        }

    def closed_loop(self, seed: int) -> list[dict[str, Any]]:
        rows = []
        for c in self.plan.concurrency:
            self.alive()
            c0 = self.cpu()
            res = self.lg.call(
                "closed_loop",
                self.plan.closed_s + REQUEST_TIMEOUT_S + 60,
                urls=[self.url],
                concurrency=c,
                duration=self.plan.closed_s,
                n_tokens=PROMPT_TOKENS,
                max_new=MAX_NEW_TOKENS,
                seed=seed + c,
                api="completions",
            )
            c1 = self.cpu()
            ok = res["codes"].get("ok", 0)
            dt = c1["t"] - c0["t"]
            rows.append(
                {
                    "concurrency": c,
                    "ok": ok,
                    "rps": r3(ok / res["elapsed_s"]) if res["elapsed_s"] > 0 else None,
                    "latency_p50_ms": r3(pct(res["latency_ms"], 50)),
                    "latency_p99_ms": r3(pct(res["latency_ms"], 99)),
                    "errors": errors_of(res["codes"]),
                    "gateway_cpu_ms_per_req": r3((c1["router"] - c0["router"]) * 1000 / ok) if ok else None,
                    "gateways_cores": r3((c1["router"] - c0["router"]) / dt),
                    "workers_cores": r3((c1["workers"] - c0["workers"]) / dt),
                }
            )
        return rows
