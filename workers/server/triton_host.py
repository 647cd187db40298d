"""Start and stop one Triton server through PyTriton, with this machine's pitfalls handled.

- PyTriton's Python-backend stub links the *system* libpython; under another interpreter of the
  same minor version (pyenv, venv on a different build) the stub loads a mismatched stdlib and
  model load fails with `'_thread.RLock' object has no attribute '_recursion_count'`. Prepending
  the running interpreter's LIBDIR to LD_LIBRARY_PATH before Triton spawns makes the stub load
  the same libpython as we run.
- PyTriton leaks its workspace unless told where it is: we make a temp root and delete it.
- SIGTERM must call `Triton.stop()`, or tritonserver and its stubs outlive us.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("flexlb.worker.triton")


def fix_libpython_path() -> None:
    libdir = sysconfig.get_config_var("LIBDIR")
    cur = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in cur.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{cur}" if cur else libdir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TritonHost:
    def __init__(
        self, grpc_port: int = 0, http_port: int = 0, metrics_port: int = 0, bind_address: str = "127.0.0.1"
    ) -> None:
        fix_libpython_path()
        from pytriton.triton import Triton, TritonConfig

        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="flexlb-triton-"))
        self._stopped = False
        self._lock = threading.Lock()
        self.triton = Triton(
            config=TritonConfig(
                grpc_address=bind_address,
                grpc_port=self.grpc_port,
                http_address=bind_address,
                http_port=self.http_port,
                metrics_port=self.metrics_port,
                log_file=self.root / "tritonserver.log",
                log_verbose=0,
                allow_gpu_metrics=False,
                exit_timeout_secs=3,
            ),
            workspace=self.root / "workspace",
        )

    def bind(self, name: str, fn: Callable[..., Any], inputs: list[Any], outputs: list[Any]) -> None:
        from pytriton.model_config import ModelConfig

        self.triton.bind(
            model_name=name,
            infer_func=fn,
            inputs=inputs,
            outputs=outputs,
            config=ModelConfig(batching=False, decoupled=True),
            strict=False,  # strict mode chokes on empty BYTES arrays, which events use
        )

    def start(self) -> None:
        self.triton.run()

    def is_alive(self) -> bool:
        return bool(self.triton.is_alive())

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self.triton.stop()
        except Exception:  # stopping must always clean the workspace
            log.exception("triton stop failed")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def install_signal_handlers(self, on_stop: Callable[[], None] | None = None) -> threading.Event:
        """SIGTERM/SIGINT set the returned event; the main thread then stops everything."""
        ev = threading.Event()

        def handler(signum: int, _frame: Any) -> None:
            ev.set()
            if on_stop is not None:
                with contextlib.suppress(Exception):
                    on_stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        return ev
