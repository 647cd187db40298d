"""What every benchmark here shares: starting and stopping processes (workers, with bounded waits
and no orphans), CPU meters, percentiles, JSON-safe results, the rich console and SIGTERM handling.

Imported as ``_harness`` (bench/ is sys.path[0] when a benchmark runs as a script).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from workers.server.spawn import ReadyLine

__all__ = [
    "DEFAULT_OUT",
    "ROOT",
    "CpuMeter",
    "Proc",
    "console",
    "json_safe",
    "pct",
    "r2",
    "r3",
    "start_worker",
    "start_workers",
    "stop_on_sigterm",
    "table",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "out"
console = Console(width=None if sys.stdout.isatty() else 160)


# ---- processes ----------------------------------------------------------------------------------
@dataclass
class Proc:
    """A subprocess started here in its own session; `stop()` is the only way it is ended."""

    name: str
    popen: subprocess.Popen[Any]
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)  # a worker's `worker_ready` line
    role: str = ""
    stop_s: float | None = None
    hung: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def epoch(self) -> str:
        return str(self.info["epoch"])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process, wait (a worker tears down Triton and its stubs itself, ~4 s);
        SIGKILL its whole process group only if it ignores that (after saving its Python stacks
        with py-spy, when installed, to show where it hung), so no tritonserver is orphaned."""
        t0 = time.monotonic()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                console.print(
                    f"[red]{self.name} ({self.pid}) ignored SIGTERM for {timeout:g} s; killing its group"
                )
                self.hung = True
                _dump_stacks(self.pid, self.log_path.with_suffix(".hang.txt"))
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(10)
        self.stop_s = round(time.monotonic() - t0, 2)
        return self.popen.returncode

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _dump_stacks(pid: int, path: Path) -> None:
    """Best effort: `py-spy dump` of a process that does not stop (py-spy is optional)."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [str(spy), "dump", "-p", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=20
        )
        path.write_text(out.stdout + out.stderr)
        console.print(f"[red]  its stacks: {path}")


def start_worker(
    role: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, timeout: float = 120.0
) -> Proc:
    """`flexlb worker` on 127.0.0.1 with ``args``; waits (bounded) for its `worker_ready` JSON line."""
    log_path = log_dir / f"{role}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:6]}.log"
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--role",
        role,
        "--host",
        "127.0.0.1",
        "--bind",
        "127.0.0.1",
        "--log-level",
        "WARNING",
        *args,
    ]
    with open(log_path, "w") as err:  # the child keeps its own descriptor
        popen = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    w = Proc(f"{role} worker", popen, log_path, role=role)
    info = ReadyLine(popen).wait(timeout)
    if info is not None:
        w.info = info
        return w
    w.stop()
    raise RuntimeError(f"{role} worker not ready (rc={popen.returncode}); log tail:\n{w.log_tail()}")


def start_workers(
    specs: Sequence[tuple[str, Sequence[str]]],
    log_dir: Path,
    env: dict[str, str] | None = None,
    attempts: int = 1,
) -> list[Proc]:
    """Start (role, args) workers in parallel (each takes seconds). A start can fail spuriously when
    another process races for a port or the box is busy: each is tried ``attempts`` times. If one
    still fails, the started ones are stopped and its error is raised."""

    def one(spec: tuple[str, Sequence[str]]) -> Proc:
        last: Exception | None = None
        for _ in range(attempts):
            try:
                return start_worker(spec[0], spec[1], log_dir, env)
            except RuntimeError as exc:
                last = exc
                console.print(f"[yellow]{spec[0]} worker failed to start: {str(exc)[:200]}")
        assert last is not None
        raise last

    with ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(one, s) for s in specs]
        started: list[Proc] = []
        errors: list[BaseException] = []
        for f in futs:
            try:
                started.append(f.result())
            except BaseException as exc:
                errors.append(exc)
    if errors:
        for w in started:
            w.stop()
        raise errors[0]
    return started


def wait_until(cond: Any, timeout: float, what: str, interval: float = 0.1, ok: tuple[type, ...] = ()) -> Any:
    """Poll ``cond()`` until it returns something truthy (returned) or ``timeout`` passes (a
    RuntimeError naming ``what`` and the last answer). Exceptions in ``ok`` count as "not yet"."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except ok as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last:
                return last
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}; last={last!r}")


class CpuMeter:
    """CPU seconds (user + system) of processes and, optionally, their live children."""

    def __init__(self, pids: Sequence[int], tree: bool = False) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.tree = tree
        self._last: dict[int, float] = {}

    def seconds(self) -> float:
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):  # a dead process counts what it had, no more
                t = p.cpu_times()
                self._last[p.pid] = t.user + t.system
            total += self._last.get(p.pid, 0.0)
            if self.tree:
                with contextlib.suppress(psutil.Error):
                    for q in p.children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            t = q.cpu_times()
                            total += t.user + t.system
        return total


# ---- numbers and results ------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (numpy's linear interpolation); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def r2(x: float) -> float:
    return round(float(x), 2)


def r3(x: float) -> float:
    return round(float(x), 3)


def json_safe(x: Any) -> Any:
    """NaN (an empty percentile) is not JSON; write null instead."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def table(title: str, columns: Sequence[str]) -> Table:
    """A rich table of right-aligned (numeric) columns, the shape of every benchmark's report."""
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    return t


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so the `finally` that stops the processes still runs."""
    signal.signal(signal.SIGTERM, _sigterm)
