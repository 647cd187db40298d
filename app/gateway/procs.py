"""Several serving processes for one gateway port (`flexlb gateway --procs N`,
`FLEXLB_GATEWAY_PROCS`): a replica's event loop is one core, so one machine's gateway scales with
its cores only as several processes.

Every process binds the same host:port with `SO_REUSEPORT`, and the kernel spreads new connections
over them. Each is a full cluster member with its own replica id (`<id>.<k>` when an id is
configured), its own leases, owner loops, reply stream and Redis connections: the cluster needs
nothing new, a request may be owned by any process of any machine as before (DESIGN §6).

The first process (the one started) serves too and supervises the others: they get SIGTERM from
the kernel if it dies (`PR_SET_PDEATHSIG`), the signal that starts its own drain is forwarded to
them, and it waits for them (bounded) before it exits. One that dies while serving is started
again (a few times; its leases expire and are taken over meanwhile, as for any crashed replica).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("flexlb.gateway")

#: Restarts of one serving process before the supervisor gives up on it.
MAX_RESTARTS = 3
_PR_SET_PDEATHSIG = 1


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other processes may bind too (the kernel balances connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


#: libc, loaded before any fork: the child between fork and exec only calls into it (no import,
#: no dlopen there, where a lock held by another thread of the parent could never be released).
_LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServingProcs:
    """The other N-1 serving processes of this gateway, started and watched from the first."""

    def __init__(self, n: int, argv: list[str], replica_id: str | None, redis_url: str) -> None:
        self.n = n
        self.argv = argv  # `flexlb gateway` arguments, without --procs
        self.replica_id = replica_id
        self.redis_url = redis_url
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: dict[int, int] = {}
        self.stopping = threading.Event()
        # Held while the watcher decides on and makes a restart, and while a stop begins: a
        # restart is either finished before the stop (so the stop signals and waits for it) or
        # not made at all. Without it a process that exited as the stop began (the signal reached
        # the whole group) could be started again after the stop had gone over `procs`, and
        # outlive the gateway (CI: one left 20 s after `flexlb up` had stopped).
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None

    def _spawn(self, k: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "FLEXLB_GATEWAY_PROCS": "1", "FLEXLB_REDIS_URL": self.redis_url}
        if self.replica_id:
            env["FLEXLB_REPLICA_ID"] = f"{self.replica_id}.{k}"
        else:
            env.pop("FLEXLB_REPLICA_ID", None)  # each process makes its own
        env["FLEXLB_GATEWAY_REUSEPORT"] = "1"
        cmd = [sys.executable, "-m", "app.cli", "gateway", *self.argv]
        return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)

    def start(self) -> None:
        for k in range(1, self.n):
            self.procs[k] = self._spawn(k)
        log.info("gateway: %d serving processes on one port", self.n, extra={"event": "procs_started"})
        self._watch = threading.Thread(target=self._watch_loop, name="gateway-procs", daemon=True)
        self._watch.start()

    def _watch_loop(self) -> None:
        while not self.stopping.wait(0.5):
            for k, p in list(self.procs.items()):
                with self._lock:
                    rc = p.poll()
                    if rc is None or self.stopping.is_set():
                        continue
                    n = self.restarts.get(k, 0)
                    if n >= MAX_RESTARTS:
                        log.error("serving process %d exited rc=%s; not restarted again", k, rc)
                        del self.procs[k]
                        continue
                    self.restarts[k] = n + 1
                    log.warning("serving process %d exited rc=%s; restarting it", k, rc)
                    self.procs[k] = self._spawn(k)

    def signal(self, sig: int) -> None:
        """Forward a shutdown signal: each process drains like a replica of its own."""
        with self._lock:
            self.stopping.set()
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self, timeout_s: float) -> None:
        """After this process's own shutdown: the others' (bounded, then SIGKILL)."""
        with self._lock:
            self.stopping.set()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
