"""Takes a worker's Triton server down with the worker when the worker process dies.

PyTriton spawns tritonserver with PR_SET_PDEATHSIG=SIGTERM, so a worker killed alone (SIGKILL of
its pid: an OOM kill, a supervisor that signals only the pid it started, bench/soak_faults.py's
`killw`) leaves a Triton server that starts its graceful stop: it keeps every gRPC stream open
while it waits for the in-flight requests, which the dead worker's infer functions never answer
(~50 s measured on the 2-core box). A decode in flight then waited for its whole deadline instead
of failing at once (the soak's one `504`, docs/benchmarks.md "Soak with faults";
tests/test_worker_death_inflight.py), and the port stayed held.

So `TritonHost.start()` runs this small process beside the server: it blocks on a pipe whose
write end only the worker holds (non-inheritable, so no Triton process keeps it open). The worker's
death closes the pipe, and this process SIGKILLs every process whose command line names the
worker's workspace (tritonserver and its Python-backend stubs): their connections close, and every
call on them fails with `WorkerUnavailable` at once. A clean stop writes one byte first, and this
process exits without killing anything (the stop has swept already). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from workers.server.leftovers import our_processes

_QUIT = b"q"


class Reaper:
    """The worker's side: `start(marker)` spawns the process, `stop()` ends it without a kill."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1

    def start(self, marker: str) -> None:
        r, w = os.pipe()  # both non-inheritable: only the read end is passed, to this child
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "workers.server.reaper", str(r), marker],
                pass_fds=(r,),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._fd = w

    def stop(self, timeout_s: float = 2.0) -> None:
        """Tell the process the worker stopped cleanly (it exits without killing) and reap it."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):  # it is already gone
                os.write(self._fd, _QUIT)
            os.close(self._fd)
            self._fd = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout_s)
            self._proc = None


def main(argv: list[str]) -> int:
    fd, marker = int(argv[1]), argv[2]
    # A terminal's Ctrl-C reaches the whole foreground group: the worker's own stop decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            got = os.read(fd, 1)
            break
        except InterruptedError:
            continue
    if got == _QUIT:
        return 0
    for pid in our_processes(marker):  # EOF: the worker died without stopping its server
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
