"""`flexlb up`: the whole local stack in the foreground — an embedded Redis, prefill and decode
sim workers, gateway replicas — with one log folder, parallel start and stop, and a clean exit on
Ctrl-C/SIGTERM/SIGHUP (nothing left running, whatever happened to the terminal or the pipe it
writes to; a second signal hurries every component). A component that fails to start is named with
the tail of its log and everything else is stopped; a worker or gateway that dies later is
restarted on its ports (a few times). If `flexlb up` itself is SIGKILLed, its children get SIGTERM
from the kernel and the embedded Redis's watchdog sees its owner gone (app/supervise.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from app.netports import wait_bindable
from app.supervise import Console, Proc, spawn
from workers.server.leftovers import sweep_after_kill
from workers.server.spawn import ReadyLine

if TYPE_CHECKING:
    from app.state.embedded_redis import EmbeddedRedis
    from app.state.redis_ha import RedisHA


class StartError(RuntimeError):
    pass


#: Restarts of one component (worker or gateway) before a repeated crash stops the stack.
MAX_RESTARTS = 3
#: How long a gateway may drain and a worker stop Triton before it is SIGKILLed.
STOP_TIMEOUT_S = 15.0
#: How long a dead worker's ports may take to be free again (its group SIGKILLed: the kernel's
#: close, well under a second) before it is restarted on them anyway.
PORTS_FREE_S = 10.0


def _restart(p: Proc, log_dir: Path, env: dict[str, str], console: Console) -> Proc:
    """A component died (Triton has been seen to segfault under load; a replica may be SIGKILLed):
    start it again where the cluster knows it. A worker keeps its ports (the registry's address;
    the gateways see a new epoch and settle the old one); a gateway keeps its port and joins as a
    new replica (the dead one's leases expire and are taken over, DESIGN §6). Readiness is awaited
    in the background so the supervisor keeps watching everything else."""
    if p.drainer is not None:
        p.drainer.join(2)  # the dead worker's last lines land before its log is reopened
    with contextlib.suppress(OSError):
        p.log.close()
    if p.is_gateway:
        new = spawn(p.name, p.args, log_dir, env, append=True)
    else:
        names = ("grpc_port", "http_port", "metrics_port")
        p.reap_group()  # its Triton server outlives it for seconds, holding the ports
        taken = wait_bindable([int(str(p.info[k])) for k in names], PORTS_FREE_S)
        if taken:  # the new worker will fail to bind, and the supervisor loop stops the stack
            console.say(f"{p.name}: ports {taken} still taken {PORTS_FREE_S:.0f} s after it died", err=True)
        ports = [f"--{k.replace('_', '-')}={p.info[k]}" for k in names]
        new = spawn(p.name, [*p.args, *ports], log_dir, env, pipe=True, append=True)
        new.args = p.args
    new.info = p.info

    def ready() -> None:
        try:
            if new.is_gateway:
                _wait_http(new, f"{new.info['url']}/readyz", 60, ready=True)
            else:
                _worker_ready(new, 90)
        except StartError as exc:  # if it died again, the supervisor loop sees it and decides
            console.say(f"{new.name} did not come back: {exc}", err=True)
            return
        new.ready = True
        console.say(f"{new.name} is back (pid {new.popen.pid})")

    threading.Thread(target=ready, name=f"ready-{p.name}", daemon=True).start()
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
    p.ready = True


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


def _run_dir(root: Path) -> Path:
    """`root/<UTC timestamp>/`, one per run, and `root/latest` pointing at it: a new run never
    truncates the logs of the last one (or of an orphan still writing them)."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run = root / stamp
    n = 1
    while True:
        try:
            run.mkdir()
            break
        except FileExistsError:
            n += 1
            run = root / f"{stamp}-{n}"
    tmp = root / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run.name)
    tmp.replace(root / "latest")  # atomic: readers see the old run or the new one
    return run


def _all_ready(workers: list[Proc], timeout: float) -> None:
    """Wait for every worker's ready line, in parallel (~6 s each). Daemon threads, not an
    executor: on Ctrl-C the interpreter would join an executor's threads at exit, each blocked up
    to `timeout` on a worker that the clean-up has already stopped."""
    errors: list[BaseException] = []

    def one(w: Proc) -> None:
        try:
            _worker_ready(w, timeout)
        except StartError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(w,), name=f"ready-{w.name}", daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class Interrupted(Exception):
    """A signal arrived while the stack was still starting."""


class _Signals:
    """SIGINT/SIGTERM/SIGHUP: the first asks for a clean stop, a second one hurries it (each child
    gets its own second signal, which makes it exit at once, see `Proc.finish`). While the stack
    is still starting, the first one also interrupts the start (which may wait up to 90 s on a
    worker) by raising `Interrupted` in the main thread."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.hurry = threading.Event()
        self.starting = True
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on)

    def _on(self, signum: int, _frame: object) -> None:
        if self.stop.is_set():
            self.hurry.set()
        self.stop.set()
        if self.starting:
            self.starting = False  # raise once; the clean-up that follows must run uninterrupted
            raise Interrupted(f"signal {signum}")


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
    redis_ha: bool = False,
    gateway_procs: int = 1,
) -> int:
    log_dir = _run_dir(log_dir)
    console = Console(log_dir / "up.log")
    sigs = _Signals()
    t0 = time.monotonic()
    token = os.environ.get("FLEXLB_ADMIN_TOKEN") or secrets.token_urlsafe(12)
    cluster = os.environ.get("FLEXLB_CLUSTER", "flexlb")
    env = {**os.environ, "FLEXLB_ADMIN_TOKEN": token, "FLEXLB_CLUSTER": cluster, "PYTHONUNBUFFERED": "1"}
    procs: list[Proc] = []
    emb: EmbeddedRedis | RedisHA | None = None
    rc = 0
    try:
        if redis_ha:
            from app.state.redis_ha import RedisHA, RedisHAError

            # Started before any thread of ours, its servers get SIGTERM if we are SIGKILLed.
            try:
                emb = RedisHA(log_dir / "redis-ha", log_dir=log_dir, die_with_parent=True)
            except RedisHAError as exc:
                raise StartError(f"redis HA set: {exc}") from exc
            redis_url = emb.url
            console.say(f"redis HA: master :{emb.ports['a']}, replica :{emb.ports['b']}, sentinels {emb.url}")
        elif not redis_url:
            from app.state.embedded_redis import start_embedded_redis

            # owner_pid: the embedded Redis goes when this process goes, even by SIGKILL.
            emb = start_embedded_redis(cluster, idle_s=60, owner_pid=os.getpid())
            redis_url = emb.url
        env["FLEXLB_REDIS_URL"] = redis_url
        wargs = ["--profile", profile, "--time-scale", str(time_scale), "--log-level", "WARNING"]
        wargs += worker_args or []  # e.g. --engine hf --model DIR
        workers = [
            spawn(f"{role}-{i}", ["worker", "--role", role, *wargs], log_dir, env, pipe=True)
            for role, n in (("prefill", prefill), ("decode", decode))
            for i in range(n)
        ]
        procs += workers
        # --gateway-procs: each replica serves its port from that many processes (app/gateway/procs.py)
        gargs = ["--procs", str(gateway_procs)] if gateway_procs > 1 else []
        gws = [
            spawn(f"gateway-{i}", ["gateway", "--port", str(port + i), *gargs], log_dir, env)
            for i in range(gateways)
        ]
        procs += gws
        _all_ready(workers, 90)
        phases = {"workers_s": time.monotonic() - t0}
        for i, g in enumerate(gws):
            g.info = {"url": f"http://127.0.0.1:{port + i}"}
            _wait_http(g, f"{g.info['url']}/healthz", 30)
        spec = ",".join(f"{w.name.split('-')[0]}@{w.info['address']}" for w in workers)
        # Register the workers once every replica is up: leases are sticky, so this spreads owners.
        httpx.post(
            f"http://127.0.0.1:{port}/admin/workers",
            json={"workers": spec},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).raise_for_status()
        for g in gws:
            _wait_http(g, f"{g.info['url']}/readyz", 30, ready=True)
            g.ready = True
        phases["ready_s"] = time.monotonic() - t0
        manifest = log_dir / "stack.json"
        _write_token(log_dir / "admin_token", token)
        _write_manifest(manifest, procs, redis_url, phases)
        console.say(_banner(port, gateways, token, redis_url, workers, log_dir, time.monotonic() - t0))
        url = redis_url
        sigs.starting = False
        rc = _watch(procs, sigs, log_dir, env, console, lambda: _write_manifest(manifest, procs, url, phases))
    except Interrupted as exc:
        console.say(f"interrupted while starting ({exc})", err=True)
        rc = 130
    except StartError as exc:
        console.say(f"start failed: {exc}", err=True)
        rc = 1
    except Exception:
        # Our own bug: say so, and still stop everything below.
        import traceback

        console.say(f"flexlb up crashed; stopping everything:\n{traceback.format_exc()}", err=True)
        rc = 1
    finally:
        _stop_all(procs, emb, sigs, console, log_dir)
    return rc


def _watch(
    procs: list[Proc],
    sigs: _Signals,
    log_dir: Path,
    env: dict[str, str],
    console: Console,
    rewrite_manifest: Callable[[], None],
) -> int:
    """Until a signal: restart a component that died after it had served (a few times each);
    one that keeps dying, or dies before it was ever ready, stops the stack (exit code 1)."""
    restarts: dict[str, int] = {}
    while not sigs.stop.wait(0.5):
        for i, p in enumerate(procs):
            if p.popen.poll() is None:
                continue
            n = restarts.get(p.name, 0)
            if p.ready and n < MAX_RESTARTS:
                restarts[p.name] = n + 1
                console.say(
                    f"\n{p.name} exited with code {p.popen.returncode}; restarting it on the same ports"
                    f" ({n + 1}/{MAX_RESTARTS}):\n{p.tail()}",
                    err=True,
                )
                procs[i] = _restart(p, log_dir, env, console)
                rewrite_manifest()
                continue
            console.say(f"\n{p.name} exited with code {p.popen.returncode}; stopping:\n{p.tail()}", err=True)
            return 1
    return 0


def _stop_all(
    procs: list[Proc], emb: EmbeddedRedis | RedisHA | None, sigs: _Signals, console: Console, log_dir: Path
) -> None:
    """Gateways drain first, then the workers stop, each group in parallel, then Redis. Every step
    is guarded on its own: a failure in one must not leave the others running."""
    t1 = time.monotonic()
    sigs.starting = False
    sigs.stop.set()
    console.say("stopping...")
    gw_procs = [p for p in procs if p.is_gateway]
    others = [p for p in procs if not p.is_gateway]
    killed: list[int] = []
    for group in (gw_procs, others):
        for p in group:
            p.signal()
        if group:
            with ThreadPoolExecutor(len(group)) as ex:
                ends = ex.map(lambda p: p.finish(STOP_TIMEOUT_S, sigs.hurry), group)
                for p, how in zip(group, ends, strict=True):
                    if how != "exited":
                        console.say(f"{p.name}: {how}", err=True)
                    if how == "killed" and not p.is_gateway:
                        killed.append(p.popen.pid)
    if killed:
        # A SIGKILLed worker could not remove its Triton workspace (~22 MB in /tmp) or its
        # /dev/shm pools; nothing else on this machine would until a worker starts again.
        try:
            sweep_after_kill(killed)
        except OSError as exc:
            console.say(f"sweeping killed workers' workspaces failed: {exc!r}", err=True)
    if emb is not None:
        try:
            emb.stop()
        except Exception as exc:  # the watchdog (or PDEATHSIG) still removes it once we are gone
            console.say(f"redis stop failed: {exc!r}", err=True)
    console.say(f"stopped in {time.monotonic() - t1:.1f} s; logs in {log_dir}/")
    console.close()


def _write_token(path: Path, token: str) -> None:
    """For `flexlb status` on this machine: the generated token, readable by this user only (it is
    not in stack.json, which tools may copy around)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def _write_manifest(path: Path, procs: list[Proc], redis_url: str, phases: dict[str, float]) -> None:
    """Every endpoint the stack serves (the workers' ports are picked at start), for tools that
    attach to it: a Prometheus scrape config, `flexlb status`, the smoke test, a script. Rewritten
    when a component is restarted (new pid). No secret goes in it."""
    doc = {
        "redis_url": redis_url,
        "gateways": [
            {"name": g.name, "url": g.info.get("url"), "pid": g.popen.pid} for g in procs if g.is_gateway
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
            for w in procs
            if not w.is_gateway
        ],
        "startup": {k: round(v, 2) for k, v in phases.items()},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)  # readers never see half a file


def _banner(
    port: int, n: int, token: str, redis_url: str, workers: list[Proc], log_dir: Path, secs: float
) -> str:
    urls = ", ".join(f"http://127.0.0.1:{port + i}" for i in range(n))
    ws = "\n".join(f"  {w.name:10s} {w.info['address']}" for w in workers)
    return f"""
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
  .venv/bin/python -c 'import openai; \\
c = openai.OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="-"); \\
print(c.completions.create(model="flexlb-sim", prompt="Hello", max_tokens=8).choices[0].text)'
  curl -s -H 'Authorization: Bearer {token}' http://127.0.0.1:{port}/admin/leases

Ctrl-C stops everything."""
