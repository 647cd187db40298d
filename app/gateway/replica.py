"""One gateway replica's cluster machinery: Redis, membership, leases, owner pollers, the cache
mirror, the master's reaping and the Redis health watch (`fail_closed`, DESIGN §6).

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
from app.cluster.health import HealthChange
from app.cluster.leases import LeaseManager
from app.cluster.loops import LoopHealth
from app.cluster.membership import Membership
from app.cluster.poller import WorkerPoller
from app.cluster.reconciler import Reconciler
from app.cluster.registry import Registry, WorkerSpec
from app.config import Settings
from app.dispatch.owner import OwnerDispatcher
from app.request.channels import NotifyListener, ReplyRouter
from app.request.pipeline import Pipeline
from app.rpc.worker_client import WorkerClient
from app.scheduling.batcher import BatcherConfig
from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, compile_formula
from app.scheduling.policy import DECODE, PREFILL, Policy, PolicyBook, batching_config
from app.security.apikeys import Limits, parse_tenant_limits
from app.state.connect import redis_client
from app.state.keys import Keys
from app.state.resp import RespConnection
from app.state.retry import TRANSIENT, TerminalWrites
from app.state.store import StateStore
from app.state.text import to_str as _s
from app.tokens.tokenizer import load_tokenizer

log = logging.getLogger("flexlb.replica")


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Replica:
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
            self.redis, self.keys, lifecycle_ttl_s=settings.lifecycle_ttl_s, fast=self.fast_redis
        )
        self.registry = Registry(self.redis, self.keys)
        self.membership = Membership(
            self.control_redis,
            self.keys,
            self.replica_id,
            self.address,
            settings.heartbeat_ms,
            settings.member_ttl_ms,
            loops=self.loops,
        )
        self.leases = LeaseManager(
            self.control_redis,
            self.keys,
            self.replica_id,
            settings.lease_ttl_ms,
            membership=self.membership,
            on_acquire=self._on_acquire,
            on_lose=self._on_lose,
            on_master_acquire=lambda fence: self._lease_metric("master", "acquired"),
            on_master_lose=lambda: self._lease_metric("master", "lost"),
            loops=self.loops,
        )
        self.mirror = CacheMirror(
            settings.speculative_ttl_ms, speculative_max_entries=settings.speculative_max_entries
        )
        self.workers: dict[str, dict[str, str]] = {}  # local copy of the registry
        self.snapshots: dict[str, dict[str, str]] = {}  # latest owner snapshot per worker
        self.follower = MirrorFollower(
            redis_client(redis_url, socket_timeout=5.0),
            self.keys,
            self.mirror,
            lambda: self.prefill_ids(),
            loops=self.loops,
        )
        self.clients: dict[str, WorkerClient] = {}
        self.pollers: dict[str, WorkerPoller] = {}
        self.dispatchers: dict[str, OwnerDispatcher] = {}
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.formula = compile_formula(settings.prefill_time_formula or DEFAULT_PREFILL_FORMULA)
        self.config_version = -1
        self.tenant_limits: dict[str, Limits] = {}  # runtime config `tenant_limits` (app/security)
        self.admission = settings.admission_config()
        self.admission.validate()
        # Built-in policies plus those declared in FLEXLB_POLICIES; the admin API validates names here.
        self.policies = PolicyBook(settings.policies)
        self.prefill_strategy = self._make_prefill(settings.prefill_strategy)
        self.decode_strategy = self.policies.build(DECODE, settings.decode_strategy)
        self.batcher_config = self._batching(BatcherConfig(), {})
        self.queued_overlay: dict[str, tuple[float, float]] = {}  # wid → (queued ms, when) from hand-offs
        self.snapshot_time: dict[str, float] = {}
        self.reconciler = Reconciler(
            self.redis,
            self.keys,
            self.store,
            self.membership.live_members,
            lambda: self.workers,
            forget_after_s=settings.reconcile_forget_s,
        )
        self.replies = ReplyRouter(redis_url, self.keys, self.replica_id, self.loops)
        self.pipeline = Pipeline(self)
        self.notify = NotifyListener(
            redis_url, self.keys, self.replica_id, self.pipeline.cancel_local, self.loops
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

    # ---- views ---------------------------------------------------------------------------
    def prefill_ids(self) -> list[str]:
        return sorted(w for w, i in self.workers.items() if i.get("role") == "prefill")

    def decode_ids(self) -> list[str]:
        return sorted(w for w, i in self.workers.items() if i.get("role") == "decode")

    def worker_up(self, wid: str) -> bool:
        return self.snapshots.get(wid, {}).get("health") == "up"

    def readiness(self) -> tuple[bool, list[str]]:
        reasons = []
        if self.draining or not self.accepting:
            reasons.append("draining")
        if not self.redis_ok:
            reasons.append(f"redis unreachable: {self.redis_reason}")
        if not any(self.worker_up(w) for w in self.prefill_ids()):
            reasons.append("no live prefill worker")
        if not any(self.worker_up(w) for w in self.decode_ids()):
            reasons.append("no live decode worker")
        reasons += self.loops.problems()
        return not reasons, reasons

    def client(self, wid: str) -> WorkerClient:
        c = self.clients.get(wid)
        if c is None:
            addr = self.workers.get(wid, {}).get("address") or wid.split("@", 1)[1]
            c = self.clients[wid] = WorkerClient(addr, secret=self.settings.worker_secret or "")
        return c

    def _make_prefill(self, name: str) -> Policy:
        """Every prefill policy gets the formula, so its choice carries the predicted ms that the
        hand-off adds to the worker's queued time, whatever the policy."""
        return self.policies.build(PREFILL, name, self.formula)

    def _batching(self, bc: BatcherConfig, cfg: dict[str, str]) -> BatcherConfig:
        """The selected prefill policy's batching mode (a declared policy may name one) over the
        runtime config's knobs, unless the runtime config sets the mode or algorithm itself."""
        mode = self.prefill_strategy.batching
        if mode is None or {"schedule_mode", "batch_algorithm"} & cfg.keys():
            return bc
        return batching_config(mode, bc.slo_ttft_ms, bc)

    def wake_owner(self, wid: str) -> None:
        """Origin and owner are the same replica: nothing to do beyond the XADD, which already
        wakes the owner's blocked XREADGROUP on the same Redis."""
        d = self.dispatchers.get(wid)
        if d is not None:
            d.wake.set()

    async def apply_runtime_config(self) -> None:
        """Admin changes are stored in Redis; every replica applies them when the version moves."""
        raw = await self.redis.hgetall(self.keys.config)
        cfg = {_s(k): _s(v) for k, v in raw.items()}
        version = int(cfg.get("version", 0))
        if version == self.config_version:
            return
        self.config_version = version
        if "prefill_time_formula" in cfg:
            self.formula = compile_formula(cfg["prefill_time_formula"])
        self.prefill_strategy = self._make_prefill(
            cfg.get("prefill_strategy", self.settings.prefill_strategy)
        )
        self.decode_strategy = self.policies.build(
            DECODE, cfg.get("decode_strategy", self.settings.decode_strategy)
        )
        self.batcher_config = self._batching(batcher_config_from(cfg), cfg)
        try:
            self.tenant_limits = parse_tenant_limits(cfg.get("tenant_limits"))
        except ValueError as exc:  # validated on write; keep the limits we have
            log.error("runtime config tenant_limits ignored: %s", exc)
        for d in self.dispatchers.values():
            d.wake.set()  # apply the new knobs now, not at the batcher's next timer
        if version:
            log.info("runtime config v%d applied: %s", version, cfg)

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
            ("master", self._master_loop()),
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
        flushed = await asyncio.gather(*(d.drain(left) for d in list(self.dispatchers.values())))
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
        for p in list(self.pollers.values()):
            await _stop_poller(p)
        self.pollers.clear()
        for d in list(self.dispatchers.values()):
            await d.stop()
        self.dispatchers.clear()
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
        for c in self.clients.values():
            with contextlib.suppress(*TRANSIENT):
                await c.close()
        for conn in (self.redis, self.follower.redis, self.control_redis):
            with contextlib.suppress(*TRANSIENT):
                await conn.aclose()
        if self.fast_redis is not None:
            with contextlib.suppress(*TRANSIENT):
                await self.fast_redis.close()

    # ---- owner hooks ---------------------------------------------------------------------
    def _lease_metric(self, kind: str, change: str) -> None:
        M.LEASE_CHANGES.labels(kind, change).inc()
        log.info("lease %s %s", kind, change)

    async def _on_acquire(self, wid: str, fence: int) -> None:
        self._lease_metric("owner", "acquired")
        if wid in self.pollers or self.draining:
            # Stopping: a peer that drained at the same moment released this lease to us; acting
            # on it would start a poller after stop() stopped them. drain() releases it at once.
            return
        if wid not in self.workers:
            await self.refresh_registry()
        lease = self.leases._owned.get(wid)
        poller = WorkerPoller(
            wid,
            self.client(wid),
            self.redis,
            self.keys,
            self.store,
            interval_ms=self.settings.poll_interval_ms,
            deadline_ms=self.settings.poll_deadline_ms,
            down_after=self.settings.down_after_failures,
            # Not while stopping either: a cancel that lands inside a gRPC call comes back as an
            # RPC error (grpc.aio swallows the CancelledError), so the poll loop would carry on
            # and stop() would wait for it forever; this makes the loop end by itself.
            is_valid=(lambda: not self.draining and lease.is_valid())
            if lease is not None
            else (lambda: not self.draining and wid in self.leases.owned()),
            on_health=self._on_health,
            on_status=self._audit,
            loops=self.loops,
            lease_value=(lambda: lease.value) if lease is not None else None,
        )
        self.pollers[wid] = poller
        poller.start()
        if self.workers.get(wid, {}).get("role") == "prefill" and lease is not None:
            d = OwnerDispatcher(
                wid,
                self.replica_id,
                lease,
                self.store,
                self.client(wid),
                self.redis_url,
                epoch=lambda: poller.health.epoch,
                config=lambda: self.batcher_config,
                formula=lambda: self.formula,
                time_scale=lambda: float(self.snapshots.get(wid, {}).get("time_scale", 1.0) or 1.0),
                on_worker_error=lambda w: None,
                loops=self.loops,
                terminal=self.terminal,
            )
            self.dispatchers[wid] = d
            d.start()

    async def _audit(self, wid: str, st: dict[str, Any]) -> None:
        M.observe_worker_prefills(wid, st.get("finished") or [])
        d = self.dispatchers.get(wid)
        if d is not None:
            await d.audit_ledger(st)

    async def _on_lose(self, wid: str) -> None:
        self._lease_metric("owner", "lost")
        p = self.pollers.pop(wid, None)
        if p is not None:
            await _stop_poller(p)
        d = self.dispatchers.pop(wid, None)
        if d is not None:
            await d.stop()

    async def _on_health(self, wid: str, change: HealthChange) -> None:
        M.WORKER_UP.labels(wid).set(1 if change.after == "up" else 0)
        if change.epoch_changed:
            M.WORKER_EPOCH_CHANGES.labels(wid).inc()
            await self.settle_epoch(wid, change.old_epoch)

    async def settle_epoch(self, wid: str, old_epoch: str) -> None:
        """A worker restarted: whatever was committed to it under the old epoch will never
        complete there. The batching work extends this to re-dispatch; here the ledger is cleared
        so owed time does not count work that no longer exists."""
        ledger = await self.store.read_ledger(wid)
        for bid, entry in ledger.items():
            if str(entry.get("epoch", old_epoch)) in (old_epoch, ""):
                await self.store.settle_batch(wid, bid)
        log.info("worker %s restarted (old epoch %s): settled %d batches", wid, old_epoch, len(ledger))

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
        self.workers = await self.registry.list()
        M.retain_workers(self.workers)  # series leave with their worker, whoever removed it
        for wid in list(self.clients):
            if wid not in self.workers:
                with contextlib.suppress(*TRANSIENT):  # a removed worker's channel: just let go
                    await self.clients.pop(wid).close()
                M.remove_worker_series(wid)

    async def refresh_snapshots(self) -> None:
        ids = list(self.workers)
        if not ids:
            self.snapshots = {}
            return
        async with self.redis.pipeline(transaction=False) as p:
            for wid in ids:
                p.hgetall(self.keys.snapshot(wid))  # "_retired" rides along; nobody reads it
            rows = await p.execute()
        self.snapshots = {
            wid: {_s(k): _s(v) for k, v in row.items()} for wid, row in zip(ids, rows, strict=True)
        }
        now = time.time()
        for wid in ids:
            self.snapshot_time[wid] = now
        for wid, snap in self.snapshots.items():
            M.export_worker_snapshot(wid, snap, self.mirror.size(wid))

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
            await asyncio.sleep(interval)

    async def _redis_watch(self) -> None:
        """fail_closed: keep a verdict on Redis for /readyz and the request path, and detect a
        Redis that came back empty (cluster_epoch missing or changed) to rebuild it."""
        while not self.draining:
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(self.redis.ping(), 1.0)
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
            delta = self.store.commands_total - self._commands_exported
            if delta > 0:
                M.REDIS_COMMANDS.inc(delta)
                self._commands_exported += delta
            await asyncio.sleep(0.5)

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
        for p in self.pollers.values():
            p.cache_version = None
            p.since_seq = 0

    async def _master_loop(self) -> None:
        next_reconcile = next_sweep = 0.0
        while not self.draining:
            await asyncio.sleep(self.settings.heartbeat_ms / 1000)
            if time.monotonic() >= next_sweep:  # every replica, for its own requests
                next_sweep = time.monotonic() + self.settings.reconcile_interval_ms / 1000
                try:
                    await self.reconciler.sweep_own(
                        self.replica_id, self._running, self.pipeline.cancel_local
                    )
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

    def _running(self, rid: str) -> bool:
        """A request this replica still runs, or whose terminal write waits for Redis."""
        return rid in self.pipeline.live or self.terminal.pending(f"finish {rid}")

    async def reap_origin(self, dead: str) -> int:
        """DESIGN §6 "Dead origin": its clients' connections died with it, so each of its live
        requests ends `owner_lost`, its hold is released and its queued prefill tombstoned (the
        reconciler's step, run at once when the master reaps the replica)."""
        return await self.reconciler.end_origin(dead, {}, self.prefill_ids())


BATCHER_KEYS = {
    "schedule_mode": ("mode", str),
    "batch_algorithm": ("algorithm", str),
    "batch_max_size": ("max_size", int),
    "batch_wait_ms": ("wait_ms", float),
    "max_inflight_batches": ("max_inflight_batches", int),
    "predict_threshold_ms": ("predict_threshold_ms", float),
    "max_batch_tokens": ("max_batch_tokens", int),
    "slo_ttft_ms": ("slo_ttft_ms", float),
    "priority_starvation_ms": ("starvation_ms", float),
}


def batcher_config_from(cfg: dict[str, str]) -> BatcherConfig:
    """The runtime config's batcher knobs over the defaults (validated; raises ValueError)."""
    kw: dict[str, Any] = {}
    for key, (name, typ) in BATCHER_KEYS.items():
        if key in cfg:
            kw[name] = typ(cfg[key])
    bc = BatcherConfig(**kw)
    bc.validate()
    return bc


async def _stop_poller(p: WorkerPoller) -> None:
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
