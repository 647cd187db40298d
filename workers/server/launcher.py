"""Host one PyTriton-managed Triton Inference Server inside a worker process.

PyTriton works, but on this machine and for long-lived streaming workers a bare `Triton()` leaks
processes, files and time. Every default chosen here answers a failure measured in the PoC kept in
/tmp/pytriton_poc (see the notes on each item):

- the Python-backend stub must load the libpython we run (`fix_libpython_path`);
- the workspace must be ours to delete, and orphaned stubs / shared memory must be swept;
- the shared-memory tensor store is ~10x slower than base64-over-zmq for the small tensors a
  simulated engine sends (1,270-1,550 vs 124-154 events/s with 50 concurrent streams);
- `Triton.stop()` waits for running generators (up to 20 s per model), so infer functions get a
  `stopping` event to end early, keeping SIGTERM-to-exit at about 4-5 s even mid-stream;
- a Triton exit timeout of 1 s orphaned a stub (ignores SIGTERM, holds /dev/shm) in every try,
  so the default is 3 s and `stop()` sweeps leftovers anyway;
- `Triton.run()` polls a dead server for 120 s, and the thread that calls it must outlive the
  server (PR_SET_PDEATHSIG), which `start()` handles.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import TRITON_ACCESS_HEADER, Triton, TritonConfig, TritonSecurityConfig

from app.netports import free_port
from workers.server.leftovers import (
    OWNER_FILE,
    ROOT_PREFIX,
    SHM_DIR,
    SHM_PREFIX,
    our_processes,
    remove_stale_roots,
)
from workers.server.reaper import Reaper

log = logging.getLogger("flexlb.worker.triton")

_LOG_TAIL_CHARS = 4000


def fix_libpython_path() -> None:
    """Make Triton's Python-backend stub load the same libpython as this interpreter.

    PyTriton's stub binary links `libpython3.11.so.1.0` by soname, so the dynamic loader picks the
    *system* copy (/usr/lib/x86_64-linux-gnu), while the stub imports the stdlib of our interpreter
    (pyenv 3.11.7). Mixed builds break at model load with
    `'_thread.RLock' object has no attribute '_recursion_count'` (the C `_thread` module of one
    build, `threading.py` of the other). Prepending our interpreter's LIBDIR to LD_LIBRARY_PATH makes
    the stub resolve our libpython instead.

    Only `os.environ` at `Triton.run()` time matters: PyTriton copies it into tritonserver's
    environment when it spawns the server, and the stubs inherit from there. Importing pytriton
    earlier is harmless (verified both orders). Idempotent: LIBDIR is added once, at the front.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if not libdir or (soname and not (Path(libdir) / soname).exists()):
        return  # static build or no shared libpython next to us: nothing better to offer the stub
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if parts[:1] == [libdir]:
        return
    os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *(p for p in parts if p != libdir)])


def _quiet_pytriton_logs() -> None:
    """PyTriton logs endpoint banners and every handler stop at INFO; keep only warnings."""
    for name in ("pytriton", "sh"):
        logging.getLogger(name).setLevel(logging.WARNING)


# PyTriton starts each model's Python-backend stub with a 4 MiB shared-memory pool that grows 1 MiB
# at a time. Our prefill batches carry hundreds of KiB per call over many concurrent streams, so the
# pool grew constantly, and the backend's pool growth under concurrent use is where its known
# crashes live (the stub segfaulted in libc, the model handler went down, the worker died). A pool
# that starts at 64 MiB and grows by 16 MiB seldom grows at all; /dev/shm pages are only backed
# once touched, so the reservation is cheap.
_SHM_INITIAL_BYTES = 64 << 20
_SHM_GROWTH_BYTES = 16 << 20


def _size_python_backend_shm() -> None:
    """PyTriton reads these module constants when it writes the backend config (at run())."""
    import pytriton.triton as pt

    pt.INITIAL_BACKEND_SHM_SIZE = max(int(pt.INITIAL_BACKEND_SHM_SIZE), _SHM_INITIAL_BYTES)
    pt.GROWTH_BACKEND_SHM_SIZE = max(int(pt.GROWTH_BACKEND_SHM_SIZE), _SHM_GROWTH_BYTES)


class TritonHost:
    """One Triton server with PyTriton models, owned by the current process.

    Use: construct, `bind()` every model, `start()`, then serve until `wait()` returns or a signal
    arrives (see `install_signal_handlers`), and `stop()` (also done by `with` and at signals).
    Infer functions should poll `host.stopping` in their loops: PyTriton's stop waits for running
    infer tasks, so a generator that ignores it delays shutdown by its full length.
    """

    def __init__(
        self,
        *,
        grpc_port: int = 0,
        http_port: int = 0,
        metrics_port: int = 0,
        address: str = "127.0.0.1",
        exit_timeout_s: int = 3,
        tensorstore: bool = False,
        restrict_endpoints: bool = False,
        access_token: str | None = None,
        log_path: Path | None = None,
        log_verbose: int = 0,
        quiet: bool = True,
    ) -> None:
        """Prepare (not start) the server.

        Ports given as 0 are picked with `free_port()`. `address` is where gRPC/HTTP/metrics
        listen; use "0.0.0.0" only when other hosts must reach the worker. `tensorstore=False`
        selects PyTriton's base64-over-zmq transport (PYTRITON_NO_TENSORSTORE, read at `bind()` and
        by the stubs), far faster for small tensors. With `restrict_endpoints` Triton's
        statistics/model-repository/shared-memory/trace/logging APIs require the
        `access_token` (generated if None) in `auth_headers`; off by default because the
        simulated workers run on a trusted loopback and the gateway reads statistics. Triton logs go
        to `log_path`, or to a file inside the temp root (deleted at stop; its tail is attached to
        start errors).
        """
        fix_libpython_path()
        if quiet:
            _quiet_pytriton_logs()
        if tensorstore:
            os.environ.pop("PYTRITON_NO_TENSORSTORE", None)
        else:
            os.environ["PYTRITON_NO_TENSORSTORE"] = "1"

        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.address = address
        remove_stale_roots()
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        (self.root / OWNER_FILE).write_text(str(os.getpid()))
        self.log_path = log_path or self.root / "tritonserver.log"
        # Set first thing in stop(): long-running infer functions must end when it is set.
        self.stopping = threading.Event()

        self._lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._models: list[str] = []
        self._start_thread: threading.Thread | None = None
        self._run_returned = threading.Event()
        self._released = threading.Event()
        self._reaper = Reaper()

        _size_python_backend_shm()
        security = TritonSecurityConfig(
            access_token=access_token, restricted_endpoints=None if restrict_endpoints else []
        )
        self.access_token: str | None = security.access_token
        try:
            self._triton = Triton(
                config=TritonConfig(
                    grpc_address=address,
                    grpc_port=self.grpc_port,
                    http_address=address,
                    http_port=self.http_port,
                    metrics_address=address,
                    metrics_port=self.metrics_port,
                    log_file=self.log_path,
                    log_verbose=log_verbose,
                    allow_gpu_metrics=False,
                    exit_timeout_secs=exit_timeout_s,
                ),
                # PyTriton's Workspace insists on creating this directory itself.
                workspace=self.root / "workspace",
                security_config=security,
            )
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ configuration
    @property
    def grpc_url(self) -> str:
        """`host:port` as tritonclient.grpc expects it (no scheme)."""
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address
        return f"{host}:{self.grpc_port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """gRPC headers that unlock restricted endpoints (empty when nothing is restricted)."""
        if not self.access_token:
            return {}
        return {f"triton-grpc-protocol-{TRITON_ACCESS_HEADER}": self.access_token}

    def bind(
        self,
        model_name: str,
        infer_func: Callable[..., Any],
        inputs: Sequence[Tensor],
        outputs: Sequence[Tensor],
        decoupled: bool,
        *,
        strict: bool = True,
        instances: int = 1,
    ) -> None:
        """Register a model; must precede `start()`.

        Models are unbatched (max_batch_size 0): tensors arrive with exactly the declared shape,
        and the infer function receives `list[Request]` (normally one). Decoupled models must use
        an `async def` generator; a unary (non-decoupled) model runs one request at a time per
        instance even when its function is async, so raise `instances` (one stub process each) or
        make it decoupled when calls may overlap. `strict` checks output dtypes/shapes against the
        declaration on every response, which turns silent client-side garbage into an error.
        """
        if self._started:
            raise RuntimeError("bind() every model before start()")
        funcs: Callable[..., Any] | list[Callable[..., Any]] = (
            infer_func if instances == 1 else [infer_func] * instances
        )
        self._triton.bind(
            model_name=model_name,
            infer_func=funcs,
            inputs=list(inputs),
            outputs=list(outputs),
            config=ModelConfig(batching=False, decoupled=decoupled),
            strict=strict,
        )
        self._models.append(model_name)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 120.0) -> float:
        """Spawn tritonserver, load all bound models and block until they are ready.

        Returns the seconds it took. PyTriton's `run()` keeps polling for readiness for 120 s even
        after tritonserver has died (port in use, stub import error), so it runs in a helper thread
        while this one watches the server process and gives up as soon as it is gone. On failure
        everything is torn down and the tail of the Triton log, where the cause is written, is
        attached to the error.
        """
        if not self._models:
            raise RuntimeError("bind() at least one model before start()")
        with self._lock:
            if self._stopped:
                raise RuntimeError("TritonHost was stopped; create a new one")
            if self._started:
                raise RuntimeError("start() called twice")
            self._started = True
        fix_libpython_path()  # in case someone rewrote LD_LIBRARY_PATH since __init__
        # Before tritonserver exists: should this process die, the server dies with it (reaper.py).
        self._reaper.start(f"{self.root}/")
        t0 = time.perf_counter()
        done = self._run_returned
        errors: list[BaseException] = []

        def _run() -> None:
            try:
                self._triton.run()
            except BaseException as e:
                errors.append(e)
                return
            finally:
                done.set()
            # PyTriton spawns tritonserver with PR_SET_PDEATHSIG=SIGTERM, which Linux ties to the
            # spawning *thread*: if this thread ended here, Triton would unload every model at
            # once. It stays parked until stop() is done with the server.
            self._released.wait()

        self._start_thread = threading.Thread(target=_run, name="triton-start", daemon=True)
        self._start_thread.start()
        server_bin = str(self.root / "workspace" / "tritonserver" / "bin" / "tritonserver")
        seen_server = False
        failure = ""
        while not done.wait(0.2):
            running = bool(our_processes(server_bin))
            seen_server = seen_server or running
            if self.stopping.is_set():
                failure = "stopped while starting"
            elif seen_server and not running:
                failure = "tritonserver exited"
            elif time.perf_counter() - t0 > timeout_s:
                failure = f"not ready after {timeout_s:.0f}s"
            else:
                continue
            break
        if errors and not failure:
            failure = f"{type(errors[0]).__name__}: {errors[0]}"
        if failure:
            tail = self._log_tail()
            self.stop()
            raise RuntimeError(f"Triton failed to start ({failure}); log tail:\n{tail}") from (
                errors[0] if errors else None
            )
        took = time.perf_counter() - t0
        log.info("triton ready in %.1fs: grpc=%s models=%s", took, self.grpc_url, ",".join(self._models))
        return took

    def is_alive(self) -> bool:
        """False once tritonserver or a model's handler died (e.g. PyTritonUnrecoverableError)."""
        return self._started and not self._stopped and bool(self._triton.is_alive())

    def wait(self, poll_s: float = 0.5) -> None:
        """Block until `stop()` begins or Triton dies; for a worker's main thread."""
        while not self.stopping.wait(poll_s):
            if not self._triton.is_alive():
                # stop() removes the workspace, log included: keep its tail in the worker's log,
                # and what the process wrote to stdout/stderr (an abort's message lands there).
                log.error("triton died; its log ends:\n%s", self._log_tail()[-1500:])
                log.error("triton died; exit and console output: %s", self._console_tail())
                return

    def stop(self) -> None:
        """Stop Triton and remove every trace of it; safe to call twice and from any thread.

        Order matters: `stopping` first so generators end, then PyTriton's stop (SIGINT to
        tritonserver, waits for it and the handlers), then a sweep for stubs that outlived it and
        their /dev/shm regions, then the temp root.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self.stopping.set()
        t0 = time.perf_counter()
        try:
            if self._start_finished(grace_s=1.0):
                self._triton.stop()
            else:
                # PyTriton's run() holds the lock its stop() needs until readiness or its own
                # 120 s timeout; stopping through it would hang, and at exit its atexit hook would
                # hang again. The sweep below SIGKILLs tritonserver and the stubs instead.
                atexit.unregister(self._triton.stop)
                log.warning("start still in progress; killing tritonserver instead of stopping it")
        except Exception:
            log.exception("PyTriton stop failed; sweeping leftovers anyway")
        finally:
            self._reaper.stop()  # first: the sweep would take it for a leftover (its argv names the root)
            self._sweep_leftovers()
            shutil.rmtree(self.root, ignore_errors=True)
            self._released.set()
        log.info("triton stopped in %.1fs", time.perf_counter() - t0)

    def _start_finished(self, grace_s: float = 30.0) -> bool:
        """Whether PyTriton's run() has returned, waiting up to `grace_s` while the server lives.

        A live server normally finishes loading within seconds, after which a clean stop is
        possible; a dead one never lets run() return before PyTriton's 120 s timeout. `stop()`
        waits only 1 s: a Ctrl-C during start-up waited up to 30 s here (loading takes 5-20 s on
        a loaded 2-core box) and `flexlb up` SIGKILLed the worker first; the sweep that follows
        removes a half-started server as thoroughly.
        """
        if self._start_thread is None:
            return True
        server_bin = str(self.root / "workspace" / "tritonserver" / "bin" / "tritonserver")
        deadline = time.perf_counter() + grace_s
        while not self._run_returned.wait(0.2):
            if time.perf_counter() > deadline or not our_processes(server_bin):
                return False
        return True

    def install_signal_handlers(self, exit_code: int = 0) -> None:
        """On SIGTERM/SIGINT: stop(), then leave via SystemExit(exit_code).

        Must be called from the main thread (Python only delivers signals there). The handler runs
        `stop()` inline, which is safe because `stop()` takes no lock that the interrupted main
        thread could hold across a blocking call. A second signal while stopping exits at once
        (someone pressed Ctrl-C twice), but not before the sweep that `stop()` ends with: SIGKILL
        tritonserver and its stubs, unlink their /dev/shm pools, remove the temp root (< 0.1 s).
        """

        def _handler(signum: int, _frame: FrameType | None) -> None:
            if self.stopping.is_set():
                log.warning("signal %d while stopping; exiting at once", signum)
                self._sweep_leftovers()
                shutil.rmtree(self.root, ignore_errors=True)
                logging.shutdown()
                os._exit(exit_code or 1)
            log.info("signal %d: stopping triton", signum)
            self.stop()
            sys.exit(exit_code)

        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _sweep_leftovers(self) -> None:
        """Kill stubs that outlived tritonserver and drop our shared-memory regions.

        The stub ignores SIGTERM, so SIGKILL it; then its /dev/shm regions are garbage.
        """
        for pid in our_processes(str(self.root)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                log.warning("killed leftover triton process %d", pid)
        for shm in SHM_DIR.glob(f"{self._shm_prefix()}*"):
            with contextlib.suppress(OSError):
                shm.unlink()
                log.warning("removed leftover shared memory %s", shm)

    def _shm_prefix(self) -> str:
        """This server's shm name prefix; PyTriton keeps it privately, so fall back to our pid."""
        with contextlib.suppress(AttributeError, KeyError, TypeError):  # PyTriton's private layout
            prefix = self._triton._python_backend_config["shm-region-prefix-name"]
            if isinstance(prefix, str) and prefix.startswith(SHM_PREFIX):
                return prefix
        return f"{SHM_PREFIX}{os.getpid()}-"

    def _console_tail(self) -> str:
        """Exit status and the last console lines PyTriton captured from tritonserver (private
        attributes, read defensively: this only serves a post-mortem)."""
        try:
            server = self._triton._triton_server
            cmd = server._tritonserver_running_cmd
            code = getattr(getattr(cmd, "process", None), "exit_code", None) if cmd is not None else None
            return f"exit_code={code!r}; output tail:\n{server.logs()[-_LOG_TAIL_CHARS:]}"
        except Exception as exc:
            return f"<unavailable: {exc!r}>"

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "<no triton log>"
