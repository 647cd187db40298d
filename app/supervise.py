"""What a supervisor (`flexlb up`) needs to never leave a process behind, whatever happens to it.

Three failure modes this module answers, each seen in practice (issue 19):

- **Its output goes away.** `flexlb up | head` or `flexlb up 2>&1 | tee run.log` followed by
  Ctrl-C: the reader dies first, the next `print` raises `BrokenPipeError` (a lost tty raises
  `EIO`), and a clean-up that starts with a `print` never ran — 15 orphans kept serving.
  `Console` writes every message to `up.log` first and to the terminal only if it still can.
- **It is SIGKILLed** (or the OOM killer picks it). Its children run in their own process groups
  (so a terminal's Ctrl-C reaches only the supervisor, which stops them in order), so nothing
  else tells them. `die_with_parent()` — called first thing by `python -m app.cli` — asks the
  kernel for `PR_SET_PDEATHSIG=SIGTERM`, so each child runs its own graceful shutdown (a worker
  removes its Triton server, stubs, /dev/shm pools and temp root; a gateway releases its leases).
- **A child ignores the first signal for too long.** `Proc.finish` waits, forwards a second
  signal when the user asks again (every component exits at once on its second signal), and
  SIGKILLs the child's whole process group as the last resort.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

log = logging.getLogger("flexlb.supervise")

#: Set by the supervisor in a child's environment: the pid the child must not outlive.
PARENT_ENV = "FLEXLB_DIE_WITH_PARENT"
HURRY_RESEND_S = 0.25  # how often a hurried child gets its exit-now signal again (see Proc.finish)
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """In a child started by a supervisor: have the kernel send `sig` when the supervisor dies.

    Done in the child rather than in a `preexec_fn` (which the subprocess docs call unsafe in a
    process with threads; the supervisor has several). The race between fork and this call is
    closed by comparing `getppid()` with the pid the supervisor wrote: if it already died, act on
    it now. The variable is removed so grandchildren (tritonserver) do not inherit it. Linux only;
    elsewhere this is a no-op and the supervisor's own clean-up is all there is."""
    raw = os.environ.pop(PARENT_ENV, None)
    if not raw or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() != int(raw):
        os.kill(os.getpid(), sig)  # the supervisor died before we asked: same outcome
    return True


class Console:
    """The supervisor's messages: always appended to `path`, and to the terminal while it lasts.

    A write to a closed pipe or a hung-up tty raises; here it detaches that stream instead (fd
    pointed at /dev/null, so the interpreter's exit-time flush cannot raise either) and the run
    goes on — the clean-up after Ctrl-C must not depend on anyone reading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self.detached: set[str] = set()

    def say(self, msg: str, *, err: bool = False) -> None:
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError, ValueError):  # a full disk must not stop the clean-up
                    self._file.write(msg + "\n")
            name = "stderr" if err else "stdout"
            if name in self.detached:
                return
            stream: TextIO = getattr(sys, name)
            try:
                stream.write(msg + "\n")
                stream.flush()
            except (OSError, ValueError):  # EPIPE, EIO, or closed under us
                self._detach(name, stream)

    def _detach(self, name: str, stream: TextIO) -> None:
        self.detached.add(name)
        with contextlib.suppress(OSError, ValueError):
            fd = stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None


@dataclass
class Proc:
    """One supervised child: `python -m app.cli ARGS` in its own session, logging to `log_path`."""

    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    log: IO[str]
    info: dict[str, object] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    drainer: threading.Thread | None = None
    ready: bool = False  # it once served: a later exit is a crash, worth a restart

    @property
    def is_gateway(self) -> bool:
        return self.name.startswith("gateway")

    def reap_group(self) -> None:
        """SIGKILL what is left of this (exited) child's process group. A worker's Triton server
        and its stubs get only SIGTERM when the worker dies (PyTriton's PR_SET_PDEATHSIG) and take
        seconds to stop (Triton's `exit_timeout`), holding the worker's gRPC port meanwhile: a
        restart on the same ports then failed to bind, and `flexlb up` stopped the whole stack.
        Safe while any member lives: Linux does not hand out a pid still used as a group id."""
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group
            os.killpg(self.popen.pid, signal.SIGKILL)

    def tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError, ValueError):
            self.log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def why(self) -> str:
        """The last error its JSON log recorded (e.g. a port already in use), for the one-line
        reason a user reads first; the log's tail follows it."""
        import json

        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if '"level": "error"' in line or '"level": "critical"' in line:
                try:
                    return str(json.loads(line).get("msg", "")).strip()
                except ValueError:
                    return line[:300]
        return ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def finish(self, timeout: float, hurry: threading.Event, hurry_grace_s: float = 3.0) -> str:
        """Wait for the child signalled by `signal()` to exit; returns how it ended.

        If `hurry` is set meanwhile (the user pressed Ctrl-C again), the child gets its second
        signal, after which every component exits at once; whatever is still alive after
        `timeout` (or `hurry_grace_s` after the second signal) is SIGKILLed with its group."""
        deadline = time.monotonic() + timeout
        how = "exited"
        hurried = False
        resend_at = 0.0
        while self.popen.poll() is None:
            if hurry.is_set() and time.monotonic() >= resend_at:
                # Re-sent until it exits: a SIGTERM that arrives before the child's handler for
                # the first one has run merges with it (one pending flag per signal), so the child
                # would do a full clean stop (Triton's takes 2-4 s) instead of exiting at once.
                if not hurried:
                    hurried, how = True, "second signal"
                    deadline = min(deadline, time.monotonic() + hurry_grace_s)
                self.signal()
                resend_at = time.monotonic() + HURRY_RESEND_S
            if time.monotonic() >= deadline:
                how = "killed"
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(5)
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(0.05)
        with contextlib.suppress(OSError):
            self.log.close()
        return how


def spawn(
    name: str,
    args: list[str],
    log_dir: Path,
    env: dict[str, str],
    *,
    pipe: bool = False,
    append: bool = False,
) -> Proc:
    """Start `python -m app.cli ARGS` in its own session (a terminal's Ctrl-C reaches only the
    supervisor, which stops children in order) that dies with this process (see module doc)."""
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "a" if append else "w")  # noqa: SIM115 - closed by Proc.finish
    popen = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if pipe else log_file,
        stderr=log_file,
        text=True,
        env={**env, PARENT_ENV: str(os.getpid())},
        start_new_session=True,
    )
    return Proc(name, popen, log_path, log_file, args=list(args))
