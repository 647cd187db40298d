"""Ports handed to processes started side by side never collide (a worker then failed with
"address already in use", or waited on another worker's server until its start timed out)."""

from __future__ import annotations

import subprocess
import sys

from app.netports import free_port

_SNIPPET = "from app.netports import free_port; print(' '.join(str(free_port()) for _ in range(60)))"


def test_concurrent_processes_get_distinct_ports() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _SNIPPET], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    ports = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        ports += [int(x) for x in out.split()]
    ports.append(free_port())
    assert len(ports) == 241
    assert len(set(ports)) == len(ports), "a port was handed out twice within the hold time"
