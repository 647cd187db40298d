"""`flexlb up`: the whole local stack in the foreground — an embedded Redis, prefill and decode
sim workers, gateway replicas — with one log folder, parallel start and stop, and a clean exit on
Ctrl-C/SIGTERM (nothing left running). A component that fails to start is named with the tail of
its log and everything else is stopped; a worker that dies later is restarted on its ports (a few
times), anything else that dies stops the stack."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from workers.server.spawn import ReadyLine


class StartError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    log: IO[str]
    info: dict[str, object] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    drainer: threading.Thread | None = None

    def tail(self, n: int = 15) -> str:
        self.log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def why(self) -> str:
        """The last error its JSON log recorded (e.g. a port already in use), for the one-line
        reason a user reads first; the log's tail follows it."""
        self.log.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if '"level": "error"' in line or '"level": "critical"' in line:
                try:
                    return str(json.loads(line).get("msg", "")).strip()
                except ValueError:
                    return line[:300]
        return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self.log.close()


def _spawn(
    name: str, args: list[str], log_dir: Path, env: dict[str, str], pipe: bool = False, append: bool = False
) -> Proc:
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "a" if append else "w")  # noqa: SIM115 - closed by Proc.stop
    popen = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        stdout=subprocess.PIPE if pipe else log,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,  # our Ctrl-C handler stops them in order, not the terminal
    )
    return Proc(name, popen, log_path, log, args=args)


MAX_WORKER_RESTARTS = 3


def _restart_worker(p: Proc, log_dir: Path, env: dict[str, str]) -> Proc:
    """A worker died (Triton has been seen to segfault under load): start it again on the same
    ports, which is how the registry knows it; the gateways see a new epoch and settle the old one.
    Readiness is awaited in the background so the supervisor keeps watching everything else."""
    if p.drainer is not None:
        p.drainer.join(2)  # the dead worker's last lines land before its log is reopened
    p.log.close()
    ports = [f"--{k.replace('_', '-')}={p.info[k]}" for k in ("grpc_port", "http_port", "metrics_port")]
    new = _spawn(p.name, [*p.args, *ports], log_dir, env, pipe=True, append=True)
    new.args, new.info = p.args, p.info

    def ready() -> None:
        with contextlib.suppress(StartError):  # if it dies again, the supervisor loop sees it
            _worker_ready(new, 90)

    threading.Thread(target=ready, daemon=True).start()
    return new


def _worker_ready(p: Proc, timeout: float) -> None:
    reader = ReadyLine(p.popen, sink=p.log.write)  # later stdout lines go to the worker's log
    p.drainer = reader.thread
    info = reader.wait(timeout)
    if info is None:
        if p.popen.poll() is not None:
            raise StartError(f"{p.name} exited with code {p.popen.returncode}: {p.why()}\n{p.tail()}")
        raise StartError(f"{p.name} not ready after {timeout:.0f} s:\n{p.tail()}")
    p.info = info


def _wait_http(p: Proc, url: str, timeout: float, ready: bool = False) -> dict:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if p.popen.poll() is not None:
            raise StartError(f"{p.name} exited with code {p.popen.returncode}: {p.why()}\n{p.tail()}")
        try:
            r = httpx.get(url, timeout=1)
            if r.status_code == 200 or (not ready and r.status_code == 503):
                return r.json()  # type: ignore[no-any-return]
            last = r.text
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise StartError(f"{p.name} not ready after {timeout:.0f} s ({last[:200]}):\n{p.tail()}")


def run_stack(
    *,
    prefill: int = 2,
    decode: int = 2,
    gateways: int = 2,
    port: int = 8000,
    profile: str = "llama3.1-8b-h100",
    time_scale: float = 1.0,
    log_dir: Path = Path("logs"),
    redis_url: str | None = None,
    worker_args: list[str] | None = None,
) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t0 = time.monotonic()
    token = os.environ.get("FLEXLB_ADMIN_TOKEN") or secrets.token_urlsafe(12)
    cluster = os.environ.get("FLEXLB_CLUSTER", "flexlb")
    env = {**os.environ, "FLEXLB_ADMIN_TOKEN": token, "FLEXLB_CLUSTER": cluster, "PYTHONUNBUFFERED": "1"}
    procs: list[Proc] = []
    emb = None
    rc = 0
    try:
        if not redis_url:
            from app.state.embedded_redis import start_embedded_redis

            emb = start_embedded_redis(cluster, idle_s=60)
            redis_url = emb.url
        env["FLEXLB_REDIS_URL"] = redis_url
        wargs = ["--profile", profile, "--time-scale", str(time_scale), "--log-level", "WARNING"]
        wargs += worker_args or []  # e.g. --engine hf --model DIR
        workers = [
            _spawn(f"{role}-{i}", ["worker", "--role", role, *wargs], log_dir, env, pipe=True)
            for role, n in (("prefill", prefill), ("decode", decode))
            for i in range(n)
        ]
        procs += workers
        gws = [
            _spawn(f"gateway-{i}", ["gateway", "--port", str(port + i)], log_dir, env)
            for i in range(gateways)
        ]
        procs += gws
        with ThreadPoolExecutor(max(1, len(workers))) as ex:  # workers start in parallel (~6 s each)
            for f in [ex.submit(_worker_ready, w, 90) for w in workers]:
                f.result()
        phases = {"workers_s": time.monotonic() - t0}
        for i, g in enumerate(gws):
            _wait_http(g, f"http://127.0.0.1:{port + i}/healthz", 30)
        spec = ",".join(f"{w.name.split('-')[0]}@{w.info['address']}" for w in workers)
        # Register the workers once every replica is up: leases are sticky, so this spreads owners.
        httpx.post(
            f"http://127.0.0.1:{port}/admin/workers",
            json={"workers": spec},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).raise_for_status()
        for i, g in enumerate(gws):
            _wait_http(g, f"http://127.0.0.1:{port + i}/readyz", 30, ready=True)
        phases["ready_s"] = time.monotonic() - t0
        _write_manifest(log_dir / "stack.json", port, gws, workers, redis_url, phases)
        _banner(port, gateways, token, redis_url, workers, log_dir, time.monotonic() - t0)
        restarts = 0
        while not stop.wait(0.5):
            for i, p in enumerate(procs):
                if p.popen.poll() is None:
                    continue
                worker = not p.name.startswith("gateway")
                if worker and restarts < MAX_WORKER_RESTARTS and "grpc_port" in p.info:
                    restarts += 1
                    print(
                        f"\n{p.name} exited with code {p.popen.returncode}; restarting it on the same ports"
                        f" ({restarts}/{MAX_WORKER_RESTARTS}):\n{p.tail()}",
                        file=sys.stderr,
                        flush=True,
                    )
                    procs[i] = _restart_worker(p, log_dir, env)
                    continue
                print(
                    f"\n{p.name} exited with code {p.popen.returncode}; stopping:\n{p.tail()}",
                    file=sys.stderr,
                )
                rc = 1
                stop.set()
                break
    except StartError as exc:
        print(f"start failed: {exc}", file=sys.stderr)
        rc = 1
    finally:
        t1 = time.monotonic()
        print("stopping...", flush=True)
        gw_procs = [p for p in procs if p.name.startswith("gateway")]
        others = [p for p in procs if not p.name.startswith("gateway")]
        for group in (gw_procs, others):  # gateways drain first, then the workers, in parallel
            with ThreadPoolExecutor(max(1, len(group))) as ex:
                list(ex.map(lambda p: p.stop(), group))
        if emb is not None:
            emb.stop()
        print(f"stopped in {time.monotonic() - t1:.1f} s; logs in {log_dir}/", flush=True)
    return rc


def _write_manifest(
    path: Path, port: int, gws: list[Proc], workers: list[Proc], redis_url: str, phases: dict[str, float]
) -> None:
    """Every endpoint the stack serves (the workers' ports are picked at start), for tools that
    attach to it: a Prometheus scrape config, the smoke test, a script. No secret goes in it."""
    doc = {
        "redis_url": redis_url,
        "gateways": [
            {"name": g.name, "url": f"http://127.0.0.1:{port + i}", "pid": g.popen.pid}
            for i, g in enumerate(gws)
        ],
        "workers": [
            {
                "name": w.name,
                "role": w.info.get("role"),
                "address": w.info.get("address"),
                "grpc_port": w.info.get("grpc_port"),
                "http_port": w.info.get("http_port"),
                "metrics_port": w.info.get("metrics_port"),
                "pid": w.popen.pid,
            }
            for w in workers
        ],
        "startup": {k: round(v, 2) for k, v in phases.items()},
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _banner(
    port: int, n: int, token: str, redis_url: str, workers: list[Proc], log_dir: Path, secs: float
) -> None:
    urls = ", ".join(f"http://127.0.0.1:{port + i}" for i in range(n))
    ws = "\n".join(f"  {w.name:10s} {w.info['address']}" for w in workers)
    print(
        f"""
FlexLB is up in {secs:.1f} s
  gateways     {urls}
  redis        {redis_url}
  admin token  {token}
  logs         {log_dir}/ (every port, Triton metrics included: {log_dir}/stack.json)
workers:
{ws}

try it:
  curl -s http://127.0.0.1:{port}/v1/generate -H 'content-type: application/json' \\
       -d '{{"prompt": "Hello", "max_new_tokens": 16}}'
  curl -sN http://127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "flexlb-sim", "messages": [{{"role": "user", "content": "hi"}}], "stream": true}}'
  python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="-"); \\
print(c.completions.create(model="flexlb-sim", prompt="Hello", max_tokens=8).choices[0].text)'
  curl -s -H 'Authorization: Bearer {token}' http://127.0.0.1:{port}/admin/leases

Ctrl-C stops everything.""",
        flush=True,
    )
