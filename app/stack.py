"""`flexlb up`: the local stack in the foreground. For now one prefill and one decode worker;
the operations work grows it into the full cluster (Redis, gateways)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO


def _start(role: str, args: list[str], log_dir: Path) -> tuple[subprocess.Popen[str], IO[str]]:
    log = open(log_dir / f"{role}.log", "w")  # noqa: SIM115 - closed in run_stack
    cmd = [sys.executable, "-m", "app.cli", "worker", "--role", role, "--log-level", "WARNING", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True), log


def _ready(proc: subprocess.Popen[str], timeout: float) -> dict | None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            return None
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "worker_ready":
            return ev
    return None


def run_stack(worker_args: list[str], log_dir: Path) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    started = [_start(role, worker_args, log_dir) for role in ("prefill", "decode")]
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rc = 0
    try:
        for (proc, _), role in zip(started, ("prefill", "decode"), strict=True):
            ev = _ready(proc, 60)
            if ev is None:
                print(f"{role} worker failed to start; see {log_dir / (role + '.log')}", file=sys.stderr)
                return 1
            print(f"{role:8s} worker ready at {ev['address']} (epoch {ev['epoch']}, {ev['startup_s']} s)")
        print(f"logs in {log_dir}; Ctrl-C stops everything")
        while not stop.wait(0.5):
            for proc, _ in started:
                if proc.poll() is not None:
                    print("a worker exited; stopping", file=sys.stderr)
                    return 1
        return rc
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, log in started:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        print("stopped")
