"""Duties on a period: every replica sweeps its own live requests (a request left non-terminal by a
round trip that applied in Redis but lost its answer is ended and its hold released); the master
(the replica holding the master lease) reaps dead replicas and runs the reconciler (DESIGN §6)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from app import metrics as M
from app.cluster.leases import LeaseManager
from app.cluster.loops import LoopHealth
from app.cluster.membership import Membership
from app.cluster.reconciler import Reconciler
from app.config import Settings

__all__ = ["MasterDuties"]

log = logging.getLogger("flexlb.replica")


class MasterDuties:
    def __init__(
        self,
        *,
        replica_id: str,
        settings: Settings,
        membership: Membership,
        leases: LeaseManager,
        reconciler: Reconciler,
        loops: LoopHealth,
        running: Callable[[str], bool],
        cancel_local: Callable[[str], bool],
        prefill_ids: Callable[[], list[str]],
        stopping: Callable[[], bool],
    ) -> None:
        self.replica_id = replica_id
        self.settings = settings
        self.membership = membership
        self.leases = leases
        self.reconciler = reconciler
        self.loops = loops
        self.running = running
        self.cancel_local = cancel_local
        self.prefill_ids = prefill_ids
        self.stopping = stopping

    async def loop(self) -> None:
        next_reconcile = next_sweep = 0.0
        while not self.stopping():
            await asyncio.sleep(self.settings.heartbeat_ms / 1000)
            if time.monotonic() >= next_sweep:  # every replica, for its own requests
                next_sweep = time.monotonic() + self.settings.reconcile_interval_ms / 1000
                try:
                    await self.reconciler.sweep_own(self.replica_id, self.running, self.cancel_local)
                    self.loops.ok("sweep")
                except Exception as exc:  # the next period retries; the sweep is idempotent
                    self.loops.record("sweep", exc)
            if not self.leases.is_master():
                continue
            try:
                live = await self.membership.live_members()
                M.LIVE_REPLICAS.set(len(live))
                for dead in await self.membership.reap():
                    await self.reap_origin(dead)
                    M.REAPED_REPLICAS.inc()
                    log.warning("reaped dead replica %s", dead)
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + self.settings.reconcile_interval_ms / 1000
                    await self.reconciler.run_once()
                self.loops.ok("master")
            except Exception as exc:  # the next period retries; reaping is idempotent
                self.loops.record("master", exc)

    async def reap_origin(self, dead: str) -> int:
        """DESIGN §6 "Dead origin": its clients' connections died with it, so each of its live
        requests ends `owner_lost`, its hold is released and its queued prefill tombstoned (the
        reconciler's step, run at once when the master reaps the replica)."""
        return await self.reconciler.end_origin(dead, {}, self.prefill_ids())
