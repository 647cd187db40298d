"""A Redis HA set on loopback for tests: 1 master + 1 replica + 3 sentinels of the machine's
`redis-server` (issue 14 Deliver 4). Sentinels judge the master down after 1 s and fail over
within a few seconds, so a failover test fits in the suite's budget."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from app.netports import free_port
from app.state.embedded_redis import find_redis_server

MASTER = "flexlb-ha"


class RedisHA:
    def __init__(self, tmp: Path) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server binary")
        self.binary = str(binary)
        self.dir = tmp / f"ha-{free_port()}"
        self.dir.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports = {"a": free_port(), "b": free_port()}
        self._server("a", [])
        self._server("b", ["--replicaof", "127.0.0.1", str(self.ports["a"])])
        self.sentinels = [free_port() for _ in range(3)]
        for i, port in enumerate(self.sentinels):
            conf = self.dir / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.ports['a']} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 4000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            self.procs[f"s{i}"] = subprocess.Popen(
                [self.binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinels) + f"/{MASTER}/0"
        self._wait(lambda: self.master_port() == self.ports["a"] and self._replica_synced(), 15, "HA set up")

    def _server(self, name: str, extra: list[str]) -> None:
        d = self.dir / name
        d.mkdir(exist_ok=True)
        args = [self.binary, "--port", str(self.ports[name]), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--dir", str(d), *extra]
        self.procs[name] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def master_port(self) -> int | None:
        for port in self.sentinels:
            try:
                s = redis.Redis(port=port, socket_timeout=0.5)
                addr = s.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
                s.close()
                if addr:
                    return int(addr[1])
            except redis.RedisError:
                continue
        return None

    def _replica_synced(self) -> bool:
        try:
            r = redis.Redis(port=self.ports["b"], socket_timeout=0.5)
            ok = r.info("replication").get("master_link_status") == "up"
            r.close()
            return ok
        except redis.RedisError:
            return False

    def master(self) -> redis.Redis:
        port = self.master_port()
        assert port is not None
        return redis.Redis(port=port)

    def kill_master(self) -> str:
        port = self.master_port()
        name = next(n for n, p in self.ports.items() if p == port)
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(5)
        return name

    @staticmethod
    def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
