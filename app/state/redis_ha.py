"""A Redis HA set on loopback: 1 master + 1 replica + 3 sentinels of the machine's `redis-server`
(issue 14 Deliver 4). One implementation for `flexlb up --redis-ha` and for the chaos suite's
failover case (tests/redis_ha.py), so what the test fails over is what an operator runs.

Sentinels judge the master down after `down_after_ms` (1 s by default) with a quorum of 2, so a
failover completes within a few seconds. The servers keep an AOF in `root`; the sentinels rewrite
their config files there too (they record the current master and the epoch).

With `die_with_parent=True` (the supervisor's case) every `redis-server` asks the kernel for
SIGTERM when the process that started it dies, as the supervisor's Python children do
(app/supervise.py): a SIGKILLed `flexlb up` leaves no Redis behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.netports import free_port
from app.state.embedded_redis import find_redis_server

MASTER = "flexlb-ha"
_PR_SET_PDEATHSIG = 1


def _pdeathsig() -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGTERM this redis-server when its starter dies. Only prctl, no allocation or
    lock, so it is safe even though the forking process may have threads."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _plain(port: int, **kw: Any) -> redis.Redis:
    """A client of one local server of the set, without client-side retries: redis-py 8 retries a
    connection error 10 times with back-off by default, so a probe of a server that is down (the
    point of most probes here) would block for seconds instead of answering "no"."""
    return redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0), **kw)


class RedisHAError(RuntimeError):
    pass


class RedisHA:
    """Start the set (returns when the replica is in sync and every sentinel knows the master);
    `url` is the `redis+sentinel://` URL the gateways take (app/state/connect.py)."""

    def __init__(
        self,
        root: Path,
        *,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
        log_dir: Path | None = None,
        die_with_parent: bool = False,
        timeout_s: float = 15.0,
    ) -> None:
        self.binary = find_redis_server()
        self.dir = root
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._preexec = _pdeathsig if die_with_parent and sys.platform.startswith("linux") else None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.ports = {"a": free_port(), "b": free_port()}
        self.sentinels = [free_port() for _ in range(3)]
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinels) + f"/{MASTER}/0"
        try:
            self._server("a", [])
            self._server("b", ["--replicaof", "127.0.0.1", str(self.ports["a"])])
            for i, port in enumerate(self.sentinels):
                conf = self.dir / f"sentinel-{i}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                    f"sentinel monitor {MASTER} 127.0.0.1 {self.ports['a']} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} {down_after_ms}\n"
                    f"sentinel failover-timeout {MASTER} {failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {MASTER} 1\n"
                )
                self._spawn(f"sentinel-{i}", [str(conf), "--sentinel"])
            self._wait(self._up, timeout_s, "HA set up")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> None:
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.log_dir is not None:
            f = open(self.log_dir / f"redis-{name}.log", "ab")  # noqa: SIM115 - closed by stop()
            self._logs.append(f)
            out = f
        # Own process group, like the supervisor's other children: a terminal's Ctrl-C reaches only
        # the supervisor, which stops the gateways first and Redis last (Redis gone first made every
        # gateway's shutdown wait out its Redis timeouts, 15 s, before being SIGKILLed).
        self.procs[name] = subprocess.Popen(
            [self.binary, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=self._preexec,
            start_new_session=True,
        )

    def _server(self, name: str, extra: list[str]) -> None:
        d = self.dir / name
        d.mkdir(exist_ok=True)
        args = ["--port", str(self.ports[name]), "--bind", "127.0.0.1", "--save", ""]
        self._spawn(name, [*args, "--appendonly", "yes", "--dir", str(d), *extra])

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers sees it; None if none answers."""
        for port in self.sentinels:
            s = _plain(port, socket_timeout=0.5)
            try:
                addr = s.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
                if addr:
                    return int(addr[1])
            except redis.RedisError:
                continue
            finally:
                s.close()
        return None

    def _up(self) -> bool:
        return self.master_port() == self.ports["a"] and self._replica_synced() and self._sentinels_agree()

    def _sentinels_agree(self) -> bool:
        """Every sentinel knows the replica and the two other sentinels. Until their hello
        messages (every 2 s) have gone round, a master that dies can reach the quorum but lose the
        leader election, and the retry waits 2 x failover-timeout: the failover test saw no new
        master within 8 s when the master died 2 s after start-up."""
        for port in self.sentinels:
            s = _plain(port, socket_timeout=0.5)
            try:
                others = s.execute_command("SENTINEL", "sentinels", MASTER)
                replicas = s.execute_command("SENTINEL", "replicas", MASTER)
                if len(others) < len(self.sentinels) - 1 or len(replicas) < 1:
                    return False
            except redis.RedisError:
                return False
            finally:
                s.close()
        return True

    def _replica_synced(self) -> bool:
        r = _plain(self.ports["b"], socket_timeout=0.5)
        try:
            return bool(r.info("replication").get("master_link_status") == "up")
        except redis.RedisError:
            return False
        finally:
            r.close()

    def master(self) -> redis.Redis:
        """A plain client of the current master (for checks that read the cluster's keys)."""
        port = self.master_port()
        if port is None:
            raise RedisHAError("no sentinel knows the master")
        return _plain(port)

    def kill_master(self) -> str:
        """SIGKILL the current master's server (a fault for the failover test); its name."""
        port = self.master_port()
        name = next(n for n, p in self.ports.items() if p == port)
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(5)
        return name

    def dead(self) -> str | None:
        """The name of a process of the set that exited, if any (the supervisor watches this)."""
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if (gone := self.dead()) is not None:
                raise RedisHAError(f"redis {gone} exited with code {self.procs[gone].returncode} ({what})")
            if time.monotonic() > end:
                raise RedisHAError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process, then SIGKILL what is still there after `timeout`."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for f in self._logs:
            f.close()
        self._logs.clear()
