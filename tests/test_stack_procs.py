"""`flexlb up --gateway-procs 2`: one gateway port served by two processes, each a replica of
its own (app/gateway/procs.py), and Ctrl-C still leaves nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from .gateways import wait_for
from .test_stack_cleanup import Run, _generate, _start, runs  # noqa: F401  (shared fixture)


def test_two_serving_processes_answer_on_one_port_and_stop_together(tmp_path: Path, runs: list[Run]) -> None:  # noqa: F811
    run = _start(tmp_path, "--gateway-procs 2")
    runs.append(run)
    url = run.manifest()["gateways"][0]["url"]
    seen: set[str] = set()

    def both() -> bool:  # each httpx.get is a new connection: the kernel picks a process for it
        for _ in range(8):
            seen.add(httpx.get(url + "/healthz", timeout=5).json()["replica"])
        return len(seen) == 2

    wait_for(both, 60, 0.2, what="two replicas answering on one port")
    for _ in range(4):
        r = _generate(url)
        assert r.status_code == 200, r.text
    run.take_inventory()
    os.killpg(run.proc.pid, signal.SIGINT)
    run.proc.wait(30)
    run.assert_nothing_left(20)
