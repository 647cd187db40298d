"""The owner's poller for one worker: status + cache on a short deadline, health, snapshot and
cache-diff publication.

Only the lease holder runs one, so a worker is polled once per cluster, not once per replica.
Status is read incrementally (`since_seq`), cache as 64-bit versioned diffs, so a poll costs what
changed, not the worker's whole state (upstream lesson 5).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
import redis.asyncio as aioredis

from app import metrics as M
from app.cluster.health import HealthChange, Miss, WorkerHealth
from app.cluster.loops import LoopHealth
from app.cluster.membership import LuaScript
from app.rpc.worker_client import WorkerClient
from app.scheduling.commit import owed_ms
from app.state.keys import Keys

log = logging.getLogger("flexlb.poller")

# ~200 s of diffs at one per 200 ms poll. A follower that falls further behind sees a gap in the
# diffs' `prev` versions and resyncs from the stored snapshot (app/cache/follower.py), so a longer
# history buys nothing; at 10_000 the streams were the soak's largest Redis growth (bench/soak.py:
# +7,000 entries in 8 min at 40 req/s, still short of the cap).
CACHE_STREAM_MAXLEN = 1_000

# Owner writes of derived facts, fenced by the owner lease (issue 14, docs/state.md "Fencing
# rule"): the lease and the written keys share the worker's slot `{w:<id>}`, so the check and the
# write are one atomic step and a paused stale owner cannot slip a write in after a new holder.
# ARGV[1] is the expected lease value `holder|fence`; '*' skips the check (no lease: tests, tools).

# KEYS[1] owner lease, KEYS[2] snapshot HASH; ARGV expected, k1, v1, ... → 1 written, -1 fenced out.
_FENCED_HSET = LuaScript(
    "if ARGV[1] ~= '*' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end "
    "for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end return 1"
)
# KEYS[1] owner lease, KEYS[2] cache snapshot HASH, KEYS[3] cache diff STREAM;
# ARGV expected, epoch, version, full (0|1), add, rem, prev, maxlen → 1 published, 0 refused as
# not newer, -1 fenced out. Fenced *and* only-newer-wins on the worker's own (epoch, version): the
# worker's version grows with every change within an epoch, so a stale full snapshot can never roll
# the stored one (or a mirror) back, even from a holder the fence let through moments earlier.
_PUBLISH_CACHE = LuaScript(
    """
if ARGV[1] ~= '*' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local e = redis.call('HGET', KEYS[2], 'last_epoch')
local v = tonumber(redis.call('HGET', KEYS[2], 'last_version') or '-1')
local ver = tonumber(ARGV[3])
if e == ARGV[2] and (v > ver or (v == ver and ARGV[4] ~= '1')) then return 0 end
redis.call('HSET', KEYS[2], 'last_epoch', ARGV[2], 'last_version', ARGV[3])
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[2], 'epoch', ARGV[2], 'version', ARGV[3], 'keys', ARGV[5])
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'epoch', ARGV[2], 'version', ARGV[3],
  'full', ARGV[4], 'add', ARGV[5], 'rem', ARGV[6], 'prev', ARGV[7])
return 1
"""
)


class SnapshotWriter(Protocol):
    async def write_snapshot(self, wid: str, epoch: str, seq: int, fields: dict[str, Any]) -> bool: ...


def pack_keys(keys: list[int]) -> bytes:
    return np.asarray(keys, dtype="<u8").tobytes()


def unpack_keys(raw: bytes | None) -> list[int]:
    if not raw:
        return []
    return np.frombuffer(raw, dtype="<u8").tolist()


class WorkerPoller:
    def __init__(
        self,
        wid: str,
        client: WorkerClient,
        redis: aioredis.Redis,
        keys: Keys,
        store: SnapshotWriter,
        *,
        interval_ms: int = 200,
        deadline_ms: int = 500,
        down_after: int = 1,
        slow_down_after: int = 5,
        is_valid: Callable[[], bool] = lambda: True,
        on_health: Callable[[str, HealthChange], Awaitable[None]] | None = None,
        on_status: Callable[[str, dict[str, Any]], Awaitable[Any]] | None = None,
        loops: LoopHealth | None = None,
        lease_value: Callable[[], str] | None = None,
    ) -> None:
        self.wid = wid
        self.client = client
        self.redis = redis
        self.keys = keys
        self.store = store
        self.interval_s = interval_ms / 1000
        self.deadline_s = deadline_ms / 1000
        self.health = WorkerHealth(down_after=down_after, slow_down_after=slow_down_after)
        self.is_valid = is_valid
        self.on_health = on_health
        self.on_status = on_status  # every successful poll while the lease is valid (ledger audit)
        self.loops = loops or LoopHealth()
        self.lease_value = lease_value or (lambda: "*")
        self.fenced_out = 0  # owner writes refused because the lease moved on (a stale owner)
        self.loop_name = f"poller:{wid}"
        self.since_seq = 0
        self.cache_version: int | None = None
        self.last_status: dict[str, Any] = {}
        self.polls = 0
        self.full_every = 50  # refresh the stored snapshot now and then so late mirrors start close
        self._task: asyncio.Task[None] | None = None
        # Set by stop(): grpc.aio can swallow a cancel that lands inside a call, so the loop also
        # ends on this flag instead of relying on CancelledError alone.
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"poll:{self.wid}")
        self.loops.watch(self._task, self.loop_name)

    async def stop(self) -> None:
        self._stopping = True
        self.loops.forget(self.loop_name)
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # never raises: the loop's own errors are counted

    async def run(self) -> None:
        while not self._stopping:
            # Lease not valid locally: stop acting (someone else may take over) but do not exit; a
            # late renew can make it valid again, and on_lose stops this loop when it is really gone.
            if self.is_valid():
                try:
                    await self.poll_once()
                    self.loops.ok(self.loop_name)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis (snapshot, cache diff) failed: the worker's
                    # gRPC failures never get here (poll_once counts them as health). Back off and
                    # poll again; the lease stays held, so nobody else would publish for it.
                    await self.loops.failed(self.loop_name, exc)
                    continue
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        try:
            self.polls += 1
            since = None if self.polls % self.full_every == 0 else self.cache_version
            st, cache = await asyncio.wait_for(
                self.client.poll(self.since_seq, since, self.health.epoch or "", timeout=self.deadline_s),
                self.deadline_s,
            )
            epoch = st["epoch"]
            if st.get("resync") or (self.health.epoch and epoch != self.health.epoch):
                self.since_seq = 0
        except Exception as exc:  # timeout (slow), refused or broken stream (failed): one miss
            miss = Miss.SLOW if _timed_out(exc) else Miss.FAILED
            (M.WORKER_POLLS_SLOW if miss is Miss.SLOW else M.WORKER_POLLS_FAILED).labels(self.wid).inc()
            await self._changed(self.health.failure(miss))
            log.debug("poll %s missed (%s): %s", self.wid, miss, exc)
            if not self.health.routable and self.is_valid():
                # Health is the owner's own verdict, not the worker's: written directly (the worker's
                # seq did not move, so the only-newer-wins snapshot script would refuse it).
                await self._fenced_hset({"health": str(self.health.state)})
            return
        change = self.health.poll_ok(epoch)
        if change is not None and change.epoch_changed:
            self.cache_version = None
        await self._changed(change)
        if st.get("finished"):
            self.since_seq = st["finished"][-1]["seq"]
        self.last_status = st
        if not self.is_valid():
            return
        if self.on_status is not None:
            try:
                await self.on_status(self.wid, st)
            except Exception as exc:  # an audit failure is not a worker failure
                log.warning("status hook for %s failed: %s", self.wid, exc)
        # When the loads were read (before the read: a hand-off that raced it counts as newer,
        # which over-counts one request rather than under-counts it): the replicas' views date
        # the snapshot by this, not by when they read it (app/gateway/views.py).
        loads_ms = time.time() * 1000
        owed, queued, reserved, batches = await self._load(float(st.get("time_scale", 1.0)))
        fields = {
            "loads_ms": round(loads_ms, 1),
            "owed_ms": round(owed, 3),
            "queued_ms": round(queued, 3),
            "reserved_tokens": reserved,
            "inflight_batches": batches,
            "running": st.get("running", 0),
            "health": str(self.health.state),
            "role": st.get("role", ""),
            "kv_total_tokens": st.get("kv_total_tokens", 0),
            "kv_free_tokens": st.get("kv_free_tokens", 0),
            "kv_evictable_tokens": st.get("kv_evictable_tokens", 0),
            "kv_pinned_tokens": st.get("kv_pinned_tokens", 0),
            "queue_len": st.get("queue_len", 0),
            "queued_predicted_ms": st.get("queued_predicted_ms", 0.0),
            "time_scale": st.get("time_scale", 1.0),
            "block_size": st.get("block_size", 64),
            "now_ms": st.get("now_ms", 0.0),
            "lag_ms": st.get("lag_ms", 0.0),
            "max_lag_ms": st.get("max_lag_ms", 0.0),
        }
        # Ordered by the worker's status_seq (it grows with every answer), not by its result seq,
        # which only moves when a request finishes while KV and queue change all the time.
        await self.store.write_snapshot(self.wid, epoch, int(st.get("status_seq", 0)), fields)
        await self._publish_cache(epoch, cache)

    async def _load(self, time_scale: float) -> tuple[float, float, int, int]:
        """What the gateway itself has put on the worker: owed ms of committed batches (aged in
        modelled time: wall elapsed ÷ time_scale), queued ms of the hand-off queue, decode KV
        reserved, committed batches. Published in the snapshot so every replica's `cost` sees it
        without a query."""
        async with self.redis.pipeline(transaction=False) as p:
            p.get(self.keys.queued_ms(self.wid))
            p.hget(self.keys.reservations(self.wid), "_total")
            p.hgetall(self.keys.ledger(self.wid))
            queued, reserved, ledger = await p.execute()
        now = time.time() * 1000
        entries = [json.loads(raw) for raw in ledger.values()]
        owed = owed_ms(
            ((float(b.get("predicted_ms", 0.0)), float(b.get("start_ms", now))) for b in entries),
            now,
            time_scale,
        )
        return owed, float(queued or 0.0), int(reserved or 0), len(ledger)

    async def _fenced_hset(self, fields: dict[str, str]) -> None:
        """The owner's own verdicts (health) carry no worker seq, so only the lease orders them."""
        flat = [x for kv in fields.items() for x in kv]
        keys = [self.keys.owner_lease(self.wid), self.keys.snapshot(self.wid)]
        if int(await _FENCED_HSET(self.redis, keys, [self.lease_value(), *flat])) == -1:
            self.fenced_out += 1
            log.warning("poller %s: health write fenced out (the lease moved on)", self.wid)

    async def _publish_cache(self, epoch: str, cache: dict[str, Any]) -> None:
        version = int(cache["version"])
        if not cache["full"] and version == self.cache_version:
            return
        # The version this diff follows: a follower whose mirror is elsewhere lost a diff and
        # resyncs (app/cache/follower.py).
        prev = -1 if self.cache_version is None else self.cache_version
        keys = [
            self.keys.owner_lease(self.wid),
            self.keys.cache_snapshot(self.wid),
            self.keys.cache_stream(self.wid),
        ]
        args = [
            self.lease_value(),
            epoch,
            version,
            int(bool(cache["full"])),
            pack_keys(cache["added"]),
            pack_keys(cache["removed"]),
            prev,
            CACHE_STREAM_MAXLEN,
        ]
        res = int(await _PUBLISH_CACHE(self.redis, keys, args))
        if res == -1:
            self.fenced_out += 1
            log.warning("poller %s: cache publish fenced out (the lease moved on)", self.wid)
            return
        self.cache_version = version

    async def _changed(self, change: HealthChange | None) -> None:
        if change is None:
            return
        log.info(
            "worker %s health %s -> %s%s%s",
            self.wid,
            change.before,
            change.after,
            " (new epoch)" if change.epoch_changed else "",
            f" after {change.misses} missed poll{'s' * (change.misses != 1)}" if change.misses else "",
        )
        if self.on_health is not None:
            await self.on_health(self.wid, change)


def _timed_out(exc: BaseException) -> bool:
    """The poll ran past its deadline (our `wait_for`, or gRPC's own deadline): the worker may only
    be slow. Anything else (refused, reset, an error answer) says it is not there."""
    return isinstance(exc, TimeoutError) or bool(getattr(exc, "timed_out", False))
