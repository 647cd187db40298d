"""A facade stops on SIGTERM within its grace even while a decode facade's KV long-poll is open.

The poll waits up to `KV_WAIT_S` (600 s) for a room's prefill; uvicorn's default graceful shutdown
waited for it, so bench/compare_routers.sh (which waits for its facades after SIGTERM) hung.
"""

import contextlib
import json
import subprocess
import sys
import threading
import time

import httpx
import psutil

from workers.http_facade.server import STOP_GRACE_S


def test_sigterm_ends_a_facade_with_an_open_kv_poll_within_its_grace() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.http_facade", "--role", "prefill", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "facade_ready"
        # --port 0 binds an ephemeral port, which the ready line names (the process listens on a
        # second port, its engine core's: picking "the" listening socket hit that one half the time).
        port = int(ready["port"])
        polled = threading.Event()

        def poll() -> None:
            polled.set()
            with contextlib.suppress(httpx.HTTPError):  # the facade closing the poll is the point
                httpx.get(f"http://127.0.0.1:{port}/_facade/kv", params={"room": "never"}, timeout=60)

        threading.Thread(target=poll, daemon=True).start()
        assert polled.wait(5)
        end = time.monotonic() + 10
        while not _connections(proc.pid, psutil.CONN_ESTABLISHED) and time.monotonic() < end:
            time.sleep(0.05)  # bounded: until the poll's connection is open on the facade
        assert _connections(proc.pid, psutil.CONN_ESTABLISHED)
        # The facade's loop has read the poll's request once a later request on it is answered.
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        t0 = time.monotonic()
        proc.terminate()
        proc.wait(STOP_GRACE_S + 10)
    finally:  # whatever failed, the facade we started does not outlive the test
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert time.monotonic() - t0 < STOP_GRACE_S + 10


def _connections(pid: int, status: str) -> list[int]:
    return [int(c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == status]
