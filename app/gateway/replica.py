"""One gateway replica: the services it hosts, wired together, and its lifecycle.

Services, each with its own state and narrow interface: `WorkerViews` (registry copy, owner
snapshots, overlays, worker clients; app/gateway/views.py), `RuntimeConfig` (policies, formula,
batcher knobs from the config hash; runtime.py), `Membership` and `LeaseManager` (app/cluster/, on
the control connection pool), `Ownership` (pollers and owner dispatchers for the leases held;
ownership.py), `MasterDuties` (sweep, reaping, reconciler; master.py), the cache mirror and its
follower (app/cache/), the request `Pipeline` (app/request/). The replica keeps the Redis health
watch (`fail_closed`, DESIGN §6), the rebuild of a Redis that came back empty, start/drain/stop;
what the request path, the admin API and /readyz read of those services is `ReplicaFacade`
(facade.py).

The replica holds no state another replica needs: everything shared is in Redis; what is kept
here (worker snapshots, the cache mirror) is a local copy that any replica rebuilds from Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from app import metrics as M
from app.cache.follower import MirrorFollower
from app.cache.mirror import CacheMirror
from app.cluster.leases import LeaseManager
from app.cluster.loops import LoopHealth
from app.cluster.membership import Membership
from app.cluster.reconciler import Reconciler
from app.cluster.registry import Registry, WorkerSpec
from app.config import Settings
from app.gateway.facade import ReplicaFacade
from app.gateway.master import MasterDuties
from app.gateway.ownership import Ownership, lease_metric
from app.gateway.runtime import BATCHER_KEYS, RuntimeConfig, batcher_config_from
from app.gateway.views import WorkerViews
from app.request.channels import NotifyListener, ReplyRouter
from app.request.pipeline import Pipeline
from app.state.connect import ping, redis_client
from app.state.keys import Keys
from app.state.resp import RespConnection
from app.state.retry import TRANSIENT, TerminalWrites
from app.state.store import StateStore
from app.tokens.tokenizer import load_tokenizer

__all__ = ["BATCHER_KEYS", "Replica", "batcher_config_from", "default_replica_id"]

log = logging.getLogger("flexlb.replica")
# The refresh loop's cadence while a registered worker has no snapshot yet, where the poll interval
# is longer: /readyz turns ready once the owners' first polls are read, not one whole interval later
# (30 s with FLEXLB_POLL_INTERVAL_MS=30000; tests/test_fresh_pick.py waited that long). Never more
# often than the default 200 ms interval refreshes anyway, and only while a snapshot is missing
# (start-up, a worker just added, or one nobody owns).
FIRST_SNAPSHOT_REFRESH_S = 0.2


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Replica(ReplicaFacade):
    def __init__(
        self, settings: Settings, redis_url: str, seed_workers: list[WorkerSpec] | None = None
    ) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.seed_workers = seed_workers or []
        self.replica_id = settings.replica_id or default_replica_id()
        self.address = settings.advertise_address or f"{settings.host}:{settings.port}"
        self.keys = Keys(settings.cluster)
        # Every background loop reports here (errors counted, backoff, /readyz names a loop that
        # cannot run); terminal writes that Redis refused wait in `terminal` (issue 14).
        self.loops = LoopHealth()
        self.terminal = TerminalWrites(self.loops)
        self.redis = redis_client(
            redis_url, socket_timeout=2.0, socket_connect_timeout=2.0, max_connections=512
        )
        # Heartbeats and lease renewals get their own small pool: a burst of requests exhausting the
        # request path's connections must never make this replica lose its leases.
        self.control_redis = redis_client(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        # The origin's one serial round trip (record + reserve + hand-off) runs on a lean pipelined
        # connection (see app/state/resp.py for the measured why); None for URLs it cannot speak
        # (TLS, sentinels), which then take redis-py's pipeline.
        self.fast_redis = RespConnection.from_url(redis_url)
        self.store = StateStore(
            self.redis,
            self.keys,
            lifecycle_ttl_s=settings.lifecycle_ttl_s,
            settled_batch_ttl_ms=settings.settled_batch_ttl_s * 1000,
            fast=self.fast_redis,
        )
        self.registry = Registry(self.redis, self.keys)
        self.mirror = CacheMirror(
            settings.speculative_ttl_ms, speculative_max_entries=settings.speculative_max_entries
        )
        self.views = WorkerViews(
            self.redis,
            self.keys,
            self.registry,
            self.mirror,
            worker_secret=settings.worker_secret or "",
            grpc_mux=settings.grpc_mux,
            grpc_mux_decode=settings.grpc_mux_decode,
        )
        self.runtime = RuntimeConfig(settings, self.redis, self.keys)
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.membership = Membership(
            self.control_redis,
            self.keys,
            self.replica_id,
            self.address,
            settings.heartbeat_ms,
            settings.member_ttl_ms,
            loops=self.loops,
        )
        self.ownership = Ownership(
            replica_id=self.replica_id,
            redis_url=redis_url,
            settings=settings,
            keys=self.keys,
            redis=self.redis,
            store=self.store,
            views=self.views,
            runtime=self.runtime,
            loops=self.loops,
            terminal=self.terminal,
            refresh_registry=self.refresh_registry,
            stopping=lambda: self.draining,
        )
        self.leases = LeaseManager(
            self.control_redis,
            self.keys,
            self.replica_id,
            settings.lease_ttl_ms,
            membership=self.membership,
            on_acquire=self.ownership.on_acquire,
            on_lose=self.ownership.on_lose,
            on_master_acquire=lambda fence: lease_metric("master", "acquired"),
            on_master_lose=lambda: lease_metric("master", "lost"),
            loops=self.loops,
        )
        self.ownership.leases = self.leases
        self.follower = MirrorFollower(
            redis_client(redis_url, socket_timeout=5.0),
            self.keys,
            self.mirror,
            self.views.prefill_ids,
            loops=self.loops,
            replica_id=self.replica_id,
            share_speculative=settings.shared_speculative,
        )
        self.reconciler = Reconciler(
            self.redis,
            self.keys,
            self.store,
            self.membership.live_members,
            lambda: self.views.workers,
            forget_after_s=settings.reconcile_forget_s,
            cancel_on=lambda wid, rid: self.views.client(wid).cancel(rid, timeout=2.0),
        )
        self.replies = ReplyRouter(redis_url, self.keys, self.replica_id, self.loops)
        self.ownership.local_reply = self.replies.deliver
        self.pipeline = Pipeline(
            replica_id=self.replica_id,
            settings=settings,
            keys=self.keys,
            store=self.store,
            redis=self.redis,
            fleet=self.views,
            runtime=self.runtime,
            mirror=self.mirror,
            replies=self.replies,
            terminal=self.terminal,
            tokenizer=self.tokenizer,
            wake_owner=self.ownership.wake,
            local_owner=self.ownership.dispatchers.get,
            health=lambda: (self.redis_ok, self.redis_reason),
            accepting=lambda: self.accepting,
        )
        self.notify = NotifyListener(
            redis_url, self.keys, self.replica_id, self.pipeline.cancel_local, self.loops
        )
        self.master = MasterDuties(
            replica_id=self.replica_id,
            settings=settings,
            membership=self.membership,
            leases=self.leases,
            reconciler=self.reconciler,
            loops=self.loops,
            running=self._running,
            cancel_local=self.pipeline.cancel_local,
            prefill_ids=self.views.prefill_ids,
            stopping=lambda: self.draining,
        )
        self.redis_ok = False
        self.redis_reason = "not connected yet"
        self.cluster_epoch: str | None = None
        self.rebuilds = 0
        self.draining = False
        # False once a SIGTERM started the drain: /readyz says so and new requests get 503 `draining`.
        self.accepting = True
        self._tasks: list[asyncio.Task[Any]] = []
        self._commands_exported = 0
        self._epoch_lock = asyncio.Lock()

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        await self._connect()
        await self.replies.start()
        await self.notify.start()
        if self.seed_workers:
            await self.registry.add(self.seed_workers)
        await self.refresh_registry()
        await self.membership.heartbeat_once()
        # Known to the reconciler from now on: if this replica dies, its leftovers are found here.
        await self.redis.sadd(self.keys.replicas_seen, self.replica_id)
        self.membership.start()
        self.leases.start()
        self.follower.start()
        for name, coro in (
            ("redis_watch", self._redis_watch()),
            ("refresh", self._refresh_loop()),
            ("master", self.master.loop()),
        ):
            task = asyncio.create_task(coro, name=name)
            self.loops.watch(task, name)
            self._tasks.append(task)

    async def _connect(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                await self.store.load_scripts()
                self.cluster_epoch, _ = await self.store.ensure_cluster_epoch()
                self.redis_ok, self.redis_reason = True, ""
                return
            except Exception as exc:
                self.redis_reason = str(exc)
                if time.monotonic() > deadline:
                    log.error("redis unreachable at start: %s", exc)
                    return  # run not-ready; the watch loop keeps trying
                await asyncio.sleep(0.2)

    async def drain(self, deadline_s: float) -> dict[str, int]:
        """SIGTERM, step one (stop() is step two): refuse new requests, let this replica's own
        requests finish while its batchers keep serving everyone, then flush the batchers and let
        their batches finish — all within `deadline_s`. stop() then releases the leases; whatever
        is still pending in a queue stream is claimed by the next owner, so nothing is lost."""
        if not self.accepting:
            return {}
        self.accepting = False
        t0 = time.monotonic()
        end = t0 + deadline_s
        log.info("draining: %d requests in flight", len(self.pipeline.live), extra={"event": "drain_started"})
        while self.pipeline.live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        unfinished = len(self.pipeline.live)
        left = max(1.0, end - time.monotonic())
        flushed = await self.ownership.drain(left)
        out = {
            "requests_unfinished": unfinished,
            "batchers_left_pending": sum(1 for ok in flushed if not ok),
            "ms": round((time.monotonic() - t0) * 1000),
        }
        log.info("drained %s", json.dumps(out), extra={"event": "drained"})
        return out

    async def stop(self, drain: bool = True) -> None:
        # Every loop of this replica also ends on `draining`: a cancel that lands inside a gRPC call
        # comes back as an RPC error (grpc.aio swallows the CancelledError), which the loops count
        # as one more failure and carry on, so stop() would wait for them forever.
        self.draining = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)  # never raises; a loop that died was reported by watch
        await self.ownership.stop()
        await self.replies.stop()
        await self.notify.stop()
        await self.follower.stop()
        await self.terminal.stop()
        # Leaving: a lease or membership entry Redis did not take back expires by its TTL, and
        # connections that fail to close are gone with the process. Named errors only.
        try:
            if drain:
                await self.leases.drain()
            await self.leases.stop()
        except TRANSIENT as exc:
            log.warning("releasing leases on stop failed (they expire by TTL): %r", exc)
        try:
            if drain:
                await self.membership.leave()
            else:
                await self.membership.stop()
        except TRANSIENT as exc:
            log.warning("leaving membership on stop failed (it expires by TTL): %r", exc)
        await self.views.close()
        for conn in (self.redis, self.follower.redis, self.control_redis):
            with contextlib.suppress(*TRANSIENT):
                await conn.aclose()
        if self.fast_redis is not None:
            with contextlib.suppress(*TRANSIENT):
                await self.fast_redis.close()

    # ---- loops ---------------------------------------------------------------------------
    async def check_cluster_epoch(self) -> None:
        """Detect a Redis that came back empty before trusting anything read from it: an empty
        registry there must not replace what this replica knows."""
        async with self._epoch_lock:
            epoch, created = await self.store.ensure_cluster_epoch()
            if self.cluster_epoch is not None and (created or epoch != self.cluster_epoch):
                await self._rebuild(epoch)
            self.cluster_epoch = epoch

    async def refresh_registry(self) -> None:
        await self.check_cluster_epoch()
        await self.views.load_registry()

    async def refresh_snapshots(self) -> None:
        await self.views.load_snapshots()

    async def _refresh_loop(self) -> None:
        interval = self.settings.poll_interval_ms / 1000
        while not self.draining:  # see stop(): a swallowed cancel must not keep a loop alive
            try:
                await self.refresh_registry()
                await self.refresh_snapshots()
                await self.apply_runtime_config()
                M.OWNED_WORKERS.set(len(self.leases.owned()))
                M.IS_MASTER.set(1 if self.leases.is_master() else 0)
                self.loops.ok("refresh")
            except Exception as exc:  # keep the last views; count, back off, retry
                await self.loops.failed("refresh", exc)
                continue
            missing = self.views.awaiting_first_snapshot()
            await asyncio.sleep(min(interval, FIRST_SNAPSHOT_REFRESH_S) if missing else interval)

    async def _redis_watch(self) -> None:
        """fail_closed: keep a verdict on Redis for /readyz and the request path, and detect a
        Redis that came back empty (cluster_epoch missing or changed) to rebuild it."""
        while not self.draining:
            t0 = time.perf_counter()
            try:
                await ping(self.redis, 1.0)
                M.REDIS_LATENCY.observe(time.perf_counter() - t0)
                await self.check_cluster_epoch()
                if not self.redis_ok:
                    log.info("redis reachable again")
                self.redis_ok, self.redis_reason = True, ""
                M.REDIS_UP.set(1)
                self.loops.ok("redis_watch")
            except Exception as exc:
                # Counted, not backed off: this loop *is* the probe that says when Redis is back.
                self.loops.record("redis_watch", exc)
                if self.redis_ok:
                    log.error("redis unreachable: %s", exc)
                self.redis_ok, self.redis_reason = False, str(exc) or type(exc).__name__
                M.REDIS_UP.set(0)
            delta = self.redis_commands_total - self._commands_exported
            if delta > 0:
                M.REDIS_COMMANDS.inc(delta)
                self._commands_exported += delta
            await asyncio.sleep(0.5)

    @property
    def redis_commands_total(self) -> int:
        """Every command this replica issued: the store's and the reply inbox's blocking reads."""
        return self.store.commands_total + self.replies.commands_total

    async def _rebuild(self, new_epoch: str) -> None:
        """Redis lost everything: put back what this replica knows (registry) and make owners
        republish full snapshots; leases and membership come back by themselves."""
        self.rebuilds += 1
        log.warning(
            "redis came back empty (cluster epoch %s -> %s): rebuilding", self.cluster_epoch, new_epoch
        )
        specs = []
        for wid, info in self.workers.items():
            role, _, addr = wid.partition("@")
            host, _, port = addr.rpartition(":")
            if info.get("state", "active") != "removed" and port.isdigit():
                specs.append(WorkerSpec(role, host, int(port)))
        await self.store.load_scripts()
        await self.registry.add(specs)
        await self.membership.heartbeat_once()
        await self.redis.sadd(self.keys.replicas_seen, self.replica_id)
        self.ownership.resync()

    def _running(self, rid: str) -> bool:
        """A request this replica still runs, or whose terminal write waits for Redis."""
        return rid in self.pipeline.live or self.terminal.pending(f"finish {rid}")
