"""The uvicorn server of one replica, with a graceful drain on the first SIGTERM/SIGINT.

Plain uvicorn stops listening at once on a signal, so a load balancer never sees `/readyz` turn
false, and the owner loops would be cancelled with batches in flight. Here the first signal only
starts `Replica.drain` (readiness false, new requests 503 `draining`, in-flight requests and
batches finish, bounded); uvicorn's own shutdown follows, then the lifespan's `stop()` releases
the leases. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from app.gateway.replica import Replica

log = logging.getLogger("flexlb.gateway")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, replica: Replica, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.replica = replica
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # second signal, or not serving yet: exit now
            return
        self._drain_requested = True
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
