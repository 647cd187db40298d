"""Start a `flexlb worker` subprocess and learn where it listens.

A worker prints one JSON line on stdout once Triton serves its models: `{"event": "worker_ready",
"address": ..., "epoch": ..., ports...}`. Everything that starts workers (the local stack, the
test fixtures, the benchmarks) reads that line the same way: on a thread, because a blocking
`readline()` cannot time out on a worker that hangs before printing, and that thread keeps
draining stdout afterwards, because an undrained pipe blocks the worker once it fills.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

READY_EVENT = "worker_ready"


def worker_argv(role: str, args: Sequence[str] = (), log_level: str = "WARNING") -> list[str]:
    return [sys.executable, "-m", "app.cli", "worker", "--role", role, "--log-level", log_level, *args]


class ReadyLine:
    """Reads a worker's stdout until its ready line; later lines go to `sink` (or are dropped)."""

    def __init__(self, proc: subprocess.Popen[str], sink: Callable[[str], None] | None = None) -> None:
        if proc.stdout is None:
            raise ValueError("start the worker with stdout=subprocess.PIPE")
        self.proc = proc
        self.sink = sink
        self.info: dict[str, Any] | None = None
        self._ready = threading.Event()
        self._eof = threading.Event()
        self.thread = threading.Thread(target=self._pump, name=f"ready-{proc.pid}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if self.info is None:
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        ev = None
                    if isinstance(ev, dict) and ev.get("event") == READY_EVENT:
                        self.info = ev
                        self._ready.set()
                        continue
                if self.sink is not None:
                    self.sink(line)
        except (OSError, ValueError):  # the pipe was closed under us: the worker is gone
            pass
        finally:
            self._eof.set()

    def wait(self, timeout: float) -> dict[str, Any] | None:
        """The ready line's fields, or None if the worker exited or stayed silent for `timeout`."""
        if self._ready.wait(timeout):
            return self.info
        return None if not self._eof.is_set() or self.info is None else self.info
