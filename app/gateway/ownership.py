"""The owner duties a replica hosts for the workers whose leases it holds (DESIGN §5-§7): a poller
per owned worker (snapshot, health, cache diffs) and, for a prefill worker, the owner's dispatcher
(hand-off queue → batches → worker). Started and stopped by the lease hooks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app import metrics as M
from app.cluster.health import HealthChange
from app.cluster.leases import LeaseManager
from app.cluster.loops import LoopHealth
from app.cluster.poller import WorkerPoller
from app.cluster.registry import Registry
from app.config import Settings
from app.dispatch.ledger import settle_old_epochs
from app.dispatch.owner import OwnerDispatcher
from app.gateway.runtime import RuntimeConfig
from app.gateway.views import WorkerViews
from app.state.keys import Keys
from app.state.retry import TerminalWrites
from app.state.store import StateStore

__all__ = ["Ownership", "lease_metric"]

log = logging.getLogger("flexlb.replica")


def lease_metric(kind: str, change: str) -> None:
    M.LEASE_CHANGES.labels(kind, change).inc()
    log.info("lease %s %s", kind, change)


class Ownership:
    def __init__(
        self,
        *,
        replica_id: str,
        redis_url: str,
        settings: Settings,
        keys: Keys,
        redis: aioredis.Redis,
        store: StateStore,
        views: WorkerViews,
        runtime: RuntimeConfig,
        loops: LoopHealth,
        terminal: TerminalWrites,
        refresh_registry: Callable[[], Awaitable[None]],
        stopping: Callable[[], bool],
    ) -> None:
        self.replica_id = replica_id
        self.redis_url = redis_url
        self.settings = settings
        self.keys = keys
        self.redis = redis  # the pollers' snapshot and cache writes
        self.store = store
        self.views = views
        self.runtime = runtime
        self.loops = loops
        self.terminal = terminal
        self.refresh_registry = refresh_registry
        self.stopping = stopping
        self.leases: LeaseManager | None = None  # set by the replica once the lease manager exists
        # Set by the replica: its reply inbox, which our owners answer in process (issue 20).
        self.local_reply: Callable[[dict[str, str]], None] | None = None
        self.pollers: dict[str, WorkerPoller] = {}
        self.dispatchers: dict[str, OwnerDispatcher] = {}

    def wake(self, wid: str) -> None:
        """Origin and owner are the same replica: nothing to do beyond the XADD, which already
        wakes the owner's blocked XREADGROUP on the same Redis."""
        d = self.dispatchers.get(wid)
        if d is not None:
            d.wake.set()

    def wake_all(self) -> None:
        for d in self.dispatchers.values():
            d.wake.set()  # apply new knobs now, not at the batcher's next timer

    async def on_acquire(self, wid: str, fence: int) -> None:
        lease_metric("owner", "acquired")
        leases = self.leases
        if wid in self.pollers or self.stopping() or leases is None:
            # Stopping: a peer that drained at the same moment released this lease to us; acting
            # on it would start a poller after stop() stopped them. drain() releases it at once.
            return
        if wid not in self.views.workers:
            await self.refresh_registry()
        lease = leases.lease(wid)
        views = self.views
        poller = WorkerPoller(
            wid,
            views.client(wid),
            self.redis,
            self.keys,
            self.store,
            interval_ms=self.settings.poll_interval_ms,
            deadline_ms=self.settings.poll_deadline_ms,
            down_after=self.settings.down_after_failures,
            slow_down_after=self.settings.down_after_slow_polls,
            # Not while stopping either: a cancel that lands inside a gRPC call comes back as an
            # RPC error (grpc.aio swallows the CancelledError), so the poll loop would carry on
            # and stop() would wait for it forever; this makes the loop end by itself.
            is_valid=(lambda: not self.stopping() and lease.is_valid())
            if lease is not None
            else (lambda: not self.stopping() and wid in leases.owned()),
            on_health=self.on_health,
            on_status=self.audit,
            loops=self.loops,
            lease_value=(lambda: lease.value) if lease is not None else None,
        )
        self.pollers[wid] = poller
        poller.start()
        if views.workers.get(wid, {}).get("role") == "prefill" and lease is not None:
            runtime = self.runtime
            d = OwnerDispatcher(
                wid,
                self.replica_id,
                lease,
                self.store,
                views.client(wid),
                self.redis_url,
                epoch=lambda: poller.health.epoch,
                config=lambda: runtime.batcher_config,
                formula=lambda: runtime.formula,
                time_scale=lambda: float(views.snapshots.get(wid, {}).get("time_scale", 1.0) or 1.0),
                on_worker_error=lambda w: None,
                loops=self.loops,
                terminal=self.terminal,
                share_speculative=self.settings.shared_speculative,
                local_reply=self.local_reply,
            )
            self.dispatchers[wid] = d
            d.start()

    async def audit(self, wid: str, st: dict[str, Any]) -> None:
        M.observe_worker_prefills(wid, st.get("finished") or [])
        d = self.dispatchers.get(wid)
        if d is not None:
            await d.audit_ledger(st)

    async def on_lose(self, wid: str) -> None:
        lease_metric("owner", "lost")
        p = self.pollers.pop(wid, None)
        if p is not None:
            await stop_poller(p)
        d = self.dispatchers.pop(wid, None)
        if d is not None:
            await d.stop()
        if p is not None:
            await self._forget_if_removed(wid)

    async def _forget_if_removed(self, wid: str) -> None:
        """Deregistered (not a lease lost to a Redis blip): our poller may have published once
        more after the removal deleted the worker's views; with it stopped, delete them again.
        Leases are mostly lost because Redis is away, when this cannot run: the removal itself
        deleted them, so only a poll that raced a removal during an outage is left (logged)."""
        try:
            if not await self.redis.sismember(self.keys.workers, wid):
                await Registry(self.redis, self.keys).forget_views(wid)
        except RedisError as exc:
            log.info("views of %s not re-checked after losing its lease: %r", wid, exc)

    async def on_health(self, wid: str, change: HealthChange) -> None:
        M.WORKER_UP.labels(wid).set(1 if change.after == "up" else 0)
        if change.epoch_changed:
            M.WORKER_EPOCH_CHANGES.labels(wid).inc()
            p = self.pollers.get(wid)
            await self.settle_epoch(wid, change.old_epoch, p.health.epoch if p is not None else "")

    async def settle_epoch(self, wid: str, old_epoch: str, epoch: str = "") -> None:
        """A worker restarted: whatever was committed to it under an earlier epoch will never
        complete there, so the ledger is cleared of it and owed time does not count work that no
        longer exists. Every epoch but the current one (`epoch`, the poller's) — not only
        `old_epoch`, the one the poller saw last: a worker that restarted twice between our polls,
        or a sweep that failed, leaves older batches (`settle_old_epochs`)."""
        settled = await settle_old_epochs(self.store, wid, epoch, old_epoch)
        log.info("worker %s restarted (old epoch %s): settled %d batches", wid, old_epoch, settled)

    def resync(self) -> None:
        """Redis came back empty: every poller republishes a full snapshot and cache."""
        for p in self.pollers.values():
            p.cache_version = None
            p.since_seq = 0

    async def drain(self, deadline_s: float) -> list[bool]:
        """Flush every batcher and let its batches finish (bounded); True per owner that left nothing."""
        return await asyncio.gather(*(d.drain(deadline_s) for d in list(self.dispatchers.values())))

    async def stop(self) -> None:
        for p in list(self.pollers.values()):
            await stop_poller(p)
        self.pollers.clear()
        for d in list(self.dispatchers.values()):
            await d.stop()
        self.dispatchers.clear()


async def stop_poller(p: WorkerPoller) -> None:
    """`WorkerPoller.stop()` cancels its loop once, and grpc.aio loses a cancel that lands inside a
    call (it surfaces as an RPC error, which the poll counts as one more failure): the loop would
    carry on and this await, in stop() or in a lease hook, would never return. Cancel again every
    half second until the loop has ended."""
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(p.stop()), 0.5)
            return
        except TimeoutError:
            continue
