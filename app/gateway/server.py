"""The uvicorn server of one replica, with a graceful drain on the first SIGTERM/SIGINT.

Plain uvicorn stops listening at once on a signal, so a load balancer never sees `/readyz` turn
false, and the owner loops would be cancelled with batches in flight. Here the first signal only
starts `Replica.drain` (readiness false, new requests 503 `draining`, in-flight requests and
batches finish, bounded); uvicorn's own shutdown follows, then the lifespan's `stop()` releases
the leases.

A second signal exits at once (`os._exit`): uvicorn's own "second Ctrl-C" only skips waiting for
connections, and a lifespan shutdown stuck on a Redis that is gone (its loops logging `Connection
refused` for minutes) was seen to ignore both a second SIGTERM and a SIGINT. Exiting without
releasing leases is safe: to the cluster it looks like a crash, which it survives by design
(leases expire, DESIGN §6). For the same reason the whole shutdown has a deadline: the drain's
own bound plus `SHUTDOWN_GRACE_S`, after which the process exits as if signalled twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from types import FrameType

import uvicorn

from app.gateway.procs import ServingProcs
from app.gateway.replica import Replica
from app.logging_setup import flush_logs

log = logging.getLogger("flexlb.gateway")

#: Beyond the drain's bound: how long releasing leases, leaving membership and closing clients
#: may take. Measured ~0.1 s on a healthy Redis; with Redis gone each step times out (2 s).
SHUTDOWN_GRACE_S = 10.0


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        replica: Replica,
        drain_timeout_s: float,
        procs: ServingProcs | None = None,
    ) -> None:
        super().__init__(config)
        self.replica = replica
        self.procs = procs  # --procs: the other serving processes drain on the same signal
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested:
            _exit_now(f"signal {sig} while shutting down: exiting at once")
        if self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # not serving yet: uvicorn's own exit
            return
        self._drain_requested = True
        if self.procs is not None:
            self.procs.signal(sig)
        deadline = self.drain_timeout_s + SHUTDOWN_GRACE_S
        timer = threading.Timer(deadline, _exit_now, args=(f"shutdown not done after {deadline:.0f} s",))
        timer.daemon = True
        timer.start()
        self._captured_signals.append(sig)  # uvicorn re-raises it once shut down
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.replica.drain(self.drain_timeout_s)
        except Exception:
            log.exception("drain failed; shutting down anyway")
        finally:
            self.should_exit = True


def _exit_now(why: str) -> None:
    """Leave without running anything else: no lifespan, no atexit hook can hang us here."""
    log.warning("%s", why, extra={"event": "forced_exit"})
    flush_logs()
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(1)
