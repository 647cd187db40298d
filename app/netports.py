"""Free loopback ports that no other FlexLB process on this host was just handed.

Asking the kernel for port 0 and closing the socket is racy: the port is free again at once, and
processes started side by side (four workers, each needing gRPC, HTTP and metrics ports, plus
gateways and Redis) can be handed the same one before anybody binds it. Triton then fails with
"address already in use", or, worse, a worker's readiness check talks to another worker's server
and never sees its own models (a benchmark hung on that for minutes). Every port handed out here
is written to a host-wide registry under a file lock and not handed out again for
`HOLD_S` seconds, by which time its owner has bound it or failed. Standard library only: the
embedded Redis watchdog imports this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

HOLD_S = 120.0
REGISTRY = Path(tempfile.gettempdir()) / "flexlb-ports.json"
_LOCK = Path(tempfile.gettempdir()) / "flexlb-ports.lock"


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed to another FlexLB process in the last `HOLD_S` seconds."""
    try:
        fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # an unwritable temp dir: fall back to the plain (racy) kernel choice
        return _kernel_port(host)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        now = time.time()
        held: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            stored = json.loads(REGISTRY.read_text())
            held = {k: float(v) for k, v in stored.items() if now - float(v) < HOLD_S}
        port = _kernel_port(host)
        for _ in range(64):
            if str(port) not in held:
                break
            port = _kernel_port(host)
        held[str(port)] = now
        tmp = REGISTRY.with_name(f"{REGISTRY.name}.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(held))
            os.replace(tmp, REGISTRY)
        return port
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def wait_bindable(ports: list[int], timeout_s: float, host: str = "127.0.0.1") -> list[int]:
    """Poll (every 50 ms, at most `timeout_s`) until each port can be bound on `host` again, as a
    server restarted on it will need; returns the ports still taken at the end (empty: all free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        taken = []
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is fine
                try:
                    s.bind((host, port))
                except OSError:
                    taken.append(port)
        if not taken or time.monotonic() >= deadline:
            return taken
        time.sleep(0.05)
