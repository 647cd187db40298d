"""Replica membership: who is alive, by heartbeat into Redis.

Each replica writes, every `heartbeat_ms`:
- `member(rid)`: HASH address / started_ms / version with a PX TTL, so its details vanish by themselves;
- `members`: ZSET rid → heartbeat expiry (ms since epoch), so "who is live" is one range read.

Expiry scores come from the Redis server's clock (`TIME` inside a one-key script), never the
replica's: replicas on different hosts compare against one clock, so clock skew between gateway hosts
can neither resurrect a dead replica nor bury a live one. Every script touches one key, so the layout
still fits Redis Cluster (the ZSET and the per-replica hash live in different slots and are written
by one non-transactional pipeline).

Detection bound: a replica that stops heartbeating drops out of `live_members()` at most `ttl_ms`
after its last successful heartbeat (its score is that heartbeat's server time + ttl).
Reaping (removing expired entries) is the master's job; `leave()` is the graceful path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis

from app.cluster.loops import LoopHealth
from app.state.keys import Keys
from app.state.scripting import LuaScript, is_noscript
from app.state.text import to_str_or_none as as_str

log = logging.getLogger(__name__)


# Server time in ms, as a string Redis accepts as a score (Lua 5.1 would print big numbers as 1.7e+12).
_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "

# KEYS[1] members ZSET; ARGV rid, ttl_ms → {1 if newly added (we had been reaped or are new), now_ms}
_HEARTBEAT = LuaScript(
    _NOW
    + "local added = redis.call('ZADD', KEYS[1], string.format('%.0f', now + tonumber(ARGV[2])), ARGV[1]) "
    "return {added, string.format('%.0f', now)}"
)
# KEYS[1] members ZSET; ARGV[1] 'live' | 'dead' → member ids (score is the expiry: live iff expiry > now)
_RANGE = LuaScript(
    _NOW + "local n = string.format('%.0f', now) "
    "if ARGV[1] == 'live' then return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. n, '+inf') end "
    "return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', n)"
)
# KEYS[1] members ZSET; ARGV[1] rid → 1 if removed. Removes only a still-expired entry, so a replica
# that heartbeat again between the master's read and its reap is not buried.
_REAP = LuaScript(
    _NOW + "local s = redis.call('ZSCORE', KEYS[1], ARGV[1]) "
    "if s and tonumber(s) <= now then return redis.call('ZREM', KEYS[1], ARGV[1]) end return 0"
)


async def read_members(redis: Redis, keys: Keys, which: str = "live") -> list[str]:
    """Live (or dead: expired, not yet reaped) replica ids, sorted, judged by the server's clock."""
    raw = await _RANGE(redis, [keys.members], [which])
    return sorted(s for s in (as_str(v) for v in raw or []) if s is not None)


class Membership:
    """This replica's heartbeat plus the cluster's member list.

    `run()` (or `start()`) heartbeats every `heartbeat_ms`; `stop()` just stops (the entry lapses
    within `ttl_ms`, as after a crash); `leave()` stops and removes this replica at once so its
    workers move without waiting for the TTL.
    """

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        replica_id: str,
        address: str,
        heartbeat_ms: int = 1000,
        ttl_ms: int = 3000,
        *,
        version: str = "",
        loops: LoopHealth | None = None,
    ) -> None:
        if heartbeat_ms <= 0 or ttl_ms <= heartbeat_ms:
            raise ValueError("membership needs 0 < heartbeat_ms < ttl_ms (a live replica must beat its TTL)")
        self.redis = redis
        self.keys = keys
        self.replica_id = replica_id
        self.address = address
        self.heartbeat_ms = heartbeat_ms
        self.ttl_ms = ttl_ms
        self.version = version
        self.loops = loops or LoopHealth()
        self.started_ms = int(time.time() * 1000)
        self.last_ok: float | None = None  # monotonic time of the last successful heartbeat
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def heartbeat_once(self) -> bool:
        """Write one heartbeat (one round trip). True when the ZSET entry was new: first beat, or
        we had been reaped as dead and are back (the caller may want to log or resync)."""
        sent = time.monotonic()
        rid, member = self.replica_id, self.keys.member(self.replica_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(
            member, mapping={"address": self.address, "started_ms": self.started_ms, "version": self.version}
        )
        pipe.pexpire(member, self.ttl_ms)
        _HEARTBEAT.queue(pipe, [self.keys.members], [rid, self.ttl_ms])
        res = await pipe.execute(raise_on_error=False)
        for r in res[:2]:
            if isinstance(r, Exception):
                raise r
        beat = res[2]
        if is_noscript(beat):
            beat = await _HEARTBEAT(self.redis, [self.keys.members], [rid, self.ttl_ms])
        elif isinstance(beat, Exception):
            raise beat
        self.last_ok = sent
        return int(beat[0]) == 1

    async def live_members(self) -> list[str]:
        """Replica ids whose heartbeat has not expired, sorted."""
        return await read_members(self.redis, self.keys, "live")

    async def dead_members(self) -> list[str]:
        """Replica ids whose heartbeat expired but are not yet reaped, sorted."""
        return await read_members(self.redis, self.keys, "dead")

    async def remove(self, replica_id: str) -> None:
        """Remove a replica unconditionally (graceful leave, or an operator's decision)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.members, replica_id)
        pipe.delete(self.keys.member(replica_id))
        await pipe.execute()

    async def reap(self) -> list[str]:
        """Remove every expired member (the master's job); returns who was reaped.

        Each removal re-checks the expiry atomically, so a replica that beat again meanwhile stays.
        Its details hash normally expired already (same TTL); deleting it is only tidying.
        """
        dead = await self.dead_members()
        if not dead:
            return []
        results = await _REAP.run_many(self.redis, [([self.keys.members], [rid]) for rid in dead])
        reaped = [rid for rid, r in zip(dead, results, strict=True) if not isinstance(r, Exception) and r]
        if reaped:
            await self.redis.delete(*(self.keys.member(rid) for rid in reaped))
        return reaped

    # ---- background loop -------------------------------------------------------------------
    async def run(self) -> None:
        """Heartbeat every `heartbeat_ms` until `stop()`; Redis errors are logged, never fatal.

        Each beat is bounded by `heartbeat_ms`, so a hung connection cannot stall the schedule; the
        lease layer, not this loop, decides when a silent replica must stop acting.
        """
        self._stop.clear()
        if self._task is None:  # started by the caller directly: remember it so stop() can wait for it
            self._task = asyncio.current_task()
        period = self.heartbeat_ms / 1000
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                async with asyncio.timeout(period):
                    await self.heartbeat_once()
                self.loops.ok("membership")
            except Exception as e:  # TimeoutError included; counted, retried on the next beat
                # No extra backoff here: a heartbeat that waits longer than its period is a missed
                # heartbeat, and the period already spaces the retries.
                self.loops.record("membership", e)
            next_at += period
            now = time.monotonic()
            if next_at < now:  # fell behind (slow Redis): beat again now, do not burst to catch up
                next_at = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), next_at - now)

    def start(self) -> asyncio.Task[None]:
        """Run the loop as a background task (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"membership-{self.replica_id}")
        return self._task

    async def stop(self) -> None:
        """Stop heartbeating without removing the entry: to the cluster this looks like a crash."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def leave(self) -> None:
        """Graceful exit: stop heartbeating, then remove ourselves so others react at once."""
        await self.stop()
        await self.remove(self.replica_id)
