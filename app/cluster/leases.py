"""`LeaseManager`: which leases this replica holds, kept one `tick()` at a time.

The lease itself, its fencing and why a stale holder can never act under it, are in
`app/cluster/fenced_lease.py` (re-exported here: most callers import `Lease` from this module).
This module decides *which* leases to hold: the master lease, and the owner leases that rendezvous
hashing over live members assigns to this replica, renewed in one round trip per tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis

from app.cluster.fenced_lease import (
    RELEASE,
    RENEW,
    Lease,
    acquire_leases,
    lease_value,
    parse_lease,
    release_leases,
    renew_leases,
)
from app.cluster.loops import LoopHealth
from app.cluster.membership import Membership, as_str, is_noscript, read_members
from app.cluster.rendezvous import ranked_owners
from app.state.keys import Keys

__all__ = [
    "Lease",
    "LeaseManager",
    "acquire_leases",
    "lease_value",
    "parse_lease",
    "release_leases",
    "renew_leases",
]

log = logging.getLogger(__name__)

Hook = Callable[..., Awaitable[None] | None]


class LeaseManager:
    """Keeps this replica's master lease and owner leases, one `tick()` at a time.

    Each tick (three round trips when nothing changes):
    1. reads live members, registered workers and the master lease;
    2. renews every lease it holds and reads the owner leases of the other workers;
    3. acquires what it should: the master lease if nobody holds it; each *unowned* worker that
       rendezvous hashing over live members assigns to it. Sticky: it never takes a held lease, so a
       lease moves only when its holder dies (the key expires) or drains (releases it).

    A worker left unowned while its preferred member is live but not taking it (starting up, wedged,
    or draining without leaving membership) is taken by the member ranked r-th after `r ×
    orphan_grace_ms` of being seen unowned, so no worker stays orphaned for long.

    Hooks (sync or async; errors are logged): `on_acquire(wid, fence)`, `on_lose(wid)`,
    `on_master_acquire(fence)`, `on_master_lose()`. They start and stop per-worker machinery; they
    run after the Redis step of a tick, so that machinery must itself check `lease.is_valid()` before
    acting rather than rely on `on_lose` arriving in time.
    """

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        replica_id: str,
        ttl_ms: int = 3000,
        *,
        membership: Membership | None = None,
        live_members: Callable[[], Awaitable[Sequence[str]]] | None = None,
        tick_ms: int | None = None,
        margin_ms: int | None = None,
        orphan_grace_ms: int | None = None,
        on_acquire: Hook | None = None,
        on_lose: Hook | None = None,
        on_master_acquire: Hook | None = None,
        on_master_lose: Hook | None = None,
        loops: LoopHealth | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.replica_id = replica_id
        self.ttl_ms = ttl_ms
        self.margin_ms = ttl_ms // 3 if margin_ms is None else margin_ms
        self.tick_ms = ttl_ms // 3 if tick_ms is None else tick_ms
        if not 0 < self.tick_ms < ttl_ms - self.margin_ms:
            raise ValueError(
                "leases need 0 < tick_ms < ttl_ms - margin_ms, or a live holder lapses between renews"
            )
        self.orphan_grace_ms = 2 * ttl_ms if orphan_grace_ms is None else orphan_grace_ms
        self.membership = membership
        self._live_source = live_members
        self.on_acquire = on_acquire
        self.on_lose = on_lose
        self.on_master_acquire = on_master_acquire
        self.on_master_lose = on_master_lose
        self.master = Lease(keys.master_lease, replica_id, ttl_ms, self.margin_ms)
        self._owned: dict[str, Lease] = {}
        self._unowned_since: dict[str, float] = {}
        self._events: list[tuple[Hook | None, tuple[Any, ...]]] = []
        self._draining = False
        self._tick_lock = asyncio.Lock()  # one tick at a time, even if tick() is called beside run()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0
        # Live member ids as the last tick read them (free for /readyz and `flexlb status`: a
        # status pointed at one replica must still count the others, without a Redis call)
        self.live: tuple[str, ...] = ()
        self.stepped_down = 0  # times this replica found itself no longer a member and let go
        self.loops = loops or LoopHealth()

    # ---- views ------------------------------------------------------------------------------
    def owned(self) -> dict[str, Lease]:
        """Workers this replica may act for now (held and locally valid)."""
        now = time.monotonic()
        return {w: lease for w, lease in self._owned.items() if lease.is_valid(now)}

    def lease(self, wid: str) -> Lease | None:
        """The lease object this replica holds or last held for ``wid`` (valid or not): an owner's
        loops keep it and check `is_valid()` before each action, so a renewal reaches them."""
        return self._owned.get(wid)

    def is_master(self) -> bool:
        return self.master.is_valid()

    # ---- one tick ---------------------------------------------------------------------------
    async def tick(self) -> None:
        """One full round: the Redis step, then the hooks it produced."""
        try:
            await self._tick_redis()
        finally:
            await self._fire_events()

    async def _live(self) -> list[str]:
        if self._live_source is not None:
            return sorted(set(await self._live_source()))
        if self.membership is not None:
            return await self.membership.live_members()
        return await read_members(self.redis, self.keys, "live")

    async def _read_cluster(self) -> tuple[list[str], set[str], str | None]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(self.keys.workers)
        pipe.get(self.keys.master_lease)
        live, (workers_raw, master_raw) = await asyncio.gather(self._live(), pipe.execute())
        workers = {s for s in (as_str(w) for w in workers_raw) if s is not None}
        return live, workers, as_str(master_raw)

    async def _tick_redis(self) -> None:
        async with self._tick_lock:
            if not self._draining:
                await self._tick_locked()

    async def _tick_locked(self) -> None:
        self._expire_lapsed()
        live, workers, master_val = await self._read_cluster()
        self.live = tuple(live)
        me = self.replica_id
        is_live = me in live
        if not is_live and self.membership is not None and (self._owned or self.master.held):
            # We woke (SIGSTOP, a long GC, a partition) after our membership expired: the master
            # may already have reaped us and others may be taking our workers. Step down before
            # writing anything under these leases — every one is dropped (`on_lose` stops the
            # pollers and batchers) and released; once our heartbeat is back, rendezvous hands
            # the workers back on a later tick.
            log.warning("replica %s is not a live member: stepping down from every lease", me)
            stale = [*self._owned.values(), *([self.master] if self.master.held else [])]
            values = [(lease.key, lease.value) for lease in stale]
            for lease in stale:
                self._lost(lease)  # stop acting first (locally), then tell Redis
            await RELEASE.run_many(self.redis, [([k], [v]) for k, v in values])
            self.stepped_down += 1

        # Workers deregistered while we held them: stop acting, then release below.
        to_release: list[tuple[str, str]] = []
        for w in [w for w in self._owned if w not in workers]:
            lease = self._owned.pop(w)
            to_release.append((lease.key, lease.value))
            lease.drop()
            self._events.append((self.on_lose, (w,)))
        for w in [w for w in self._unowned_since if w not in workers]:
            del self._unowned_since[w]

        # Round trip 2: renew what we hold, read the owner leases of everything else.
        others = sorted(workers - self._owned.keys())
        held = [*self._owned.values(), *([self.master] if self.master.held else [])]
        pipe = self.redis.pipeline(transaction=False)
        for w in others:
            pipe.get(self.keys.owner_lease(w))
        for lease in held:
            RENEW.queue(pipe, [lease.key], [lease.value, lease.ttl_ms])
        sent = time.monotonic()
        res = await pipe.execute(raise_on_error=False)
        values = dict(zip(others, res[: len(others)], strict=True))
        renew_res = list(res[len(others) :])
        missing = [i for i, r in enumerate(renew_res) if is_noscript(r)]
        if missing:  # Redis restarted empty or scripts flushed: load and redo just those
            sent = time.monotonic()
            again = await RENEW.run_many(
                self.redis, [([held[i].key], [held[i].value, held[i].ttl_ms]) for i in missing]
            )
            for i, r in zip(missing, again, strict=True):
                renew_res[i] = r
        for lease, r in zip(held, renew_res, strict=True):
            if isinstance(r, Exception):
                log.warning("lease renew error on %s: %r", lease.key, r)
            elif r == 1:
                lease.granted(sent)
            else:
                self._lost(lease)

        # Decide what to take.
        now = time.monotonic()
        want: list[tuple[str, Lease]] = []
        for w in others:
            v = values[w]
            if isinstance(v, Exception):
                continue
            parsed = parse_lease(v)
            if parsed is not None:
                self._unowned_since.pop(w, None)
                if parsed[0] == me:  # ours but untracked (a lost reply, or lapsed locally): free it
                    to_release.append((self.keys.owner_lease(w), as_str(v) or ""))
                continue
            since = self._unowned_since.setdefault(w, now)
            if not is_live:
                continue
            rank = ranked_owners(w, live).index(me)
            if rank == 0 or (now - since) * 1000 >= rank * self.orphan_grace_ms:
                want.append((w, Lease(self.keys.owner_lease(w), me, self.ttl_ms, self.margin_ms)))
        want_master = False
        if not self.master.held:
            parsed = parse_lease(master_val)
            if parsed is None:
                want_master = is_live
            elif parsed[0] == me:
                to_release.append((self.master.key, master_val or ""))

        if to_release:
            await RELEASE.run_many(self.redis, [([k], [v]) for k, v in to_release])

        # Round trips 3-4 (only when something is unowned): acquire.
        candidates = [lease for _, lease in want]
        if want_master:
            self.master = Lease(self.keys.master_lease, me, self.ttl_ms, self.margin_ms)
            candidates.append(self.master)
        taken = {id(lease) for lease in await acquire_leases(self.redis, self.keys.fence_counter, candidates)}
        for w, lease in want:
            if id(lease) in taken:
                self._owned[w] = lease
                self._unowned_since.pop(w, None)
                self._events.append((self.on_acquire, (w, lease.fence)))
        if want_master and id(self.master) in taken:
            self._events.append((self.on_master_acquire, (self.master.fence,)))
        self.ticks += 1

    def _lost(self, lease: Lease) -> None:
        lease.drop()
        if lease is self.master:
            self._events.append((self.on_master_lose, ()))
            return
        for w, mine in list(self._owned.items()):
            if mine is lease:
                del self._owned[w]
                self._events.append((self.on_lose, (w,)))

    def _expire_lapsed(self) -> None:
        """Drop every lease past its local deadline: renewing failed for too long, stop acting."""
        now = time.monotonic()
        for lease in [*self._owned.values(), self.master]:
            if lease.held and not lease.is_valid(now):
                log.warning("lease %s lapsed locally (fence %d): stopping", lease.key, lease.fence)
                self._lost(lease)

    async def _fire_events(self) -> None:
        events, self._events = self._events, []
        for hook, args in events:
            if hook is None:
                continue
            try:
                out = hook(*args)
                if inspect.isawaitable(out):
                    await out
            except Exception:
                log.exception("lease hook %s%r failed", getattr(hook, "__name__", hook), args)

    # ---- background loop -------------------------------------------------------------------
    async def run(self) -> None:
        """Tick every `tick_ms` until `stop()`; also wakes at the earliest local lease deadline so a
        lease whose renewals keep failing is dropped (and `on_lose` fired) on time."""
        self._stop.clear()
        if self._task is None:
            self._task = asyncio.current_task()
        period = self.tick_ms / 1000
        budget = max(self.tick_ms, self.margin_ms) / 1000
        next_tick = time.monotonic()
        while not self._stop.is_set() and not self._draining:
            if time.monotonic() >= next_tick:
                try:
                    async with asyncio.timeout(budget):
                        await self._tick_redis()
                    self.loops.ok("leases")
                except Exception as e:  # TimeoutError included: the next tick retries
                    # The tick period is the backoff: a lease renew that waits longer is a missed
                    # renew, and `valid_until` already stops us acting when renewing keeps failing.
                    self.loops.record("leases", e)
                next_tick += period
                if next_tick <= time.monotonic():
                    next_tick = time.monotonic() + period
            self._expire_lapsed()
            await self._fire_events()
            wake = min(
                [
                    next_tick,
                    *(lease.valid_until for lease in [*self._owned.values(), self.master] if lease.held),
                ]
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, wake - time.monotonic()))

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"leases-{self.replica_id}")
        return self._task

    async def stop(self) -> None:
        """Stop ticking without releasing anything (what a crash looks like to the cluster); held
        leases stop being valid at their local deadline. Use `drain()` for a graceful exit."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def release(self, wid: str) -> bool:
        """Hand one worker back (for rebalancing): stop acting (`on_lose`), then compare-and-delete, so
        the member rendezvous now prefers takes it on its next tick. False if we did not hold it."""
        async with self._tick_lock:
            lease = self._owned.pop(wid, None)
            if lease is None:
                return False
            value = lease.value
            lease.drop()
            self._events.append((self.on_lose, (wid,)))
            await self._fire_events()
            await RELEASE(self.redis, [lease.key], [value])
            return True

    async def drain(self) -> None:
        """Graceful exit: stop ticking, leave membership (so nobody assigns us work), stop acting on
        every lease (`on_lose`), then release them all so other replicas take over on their next tick."""
        self._draining = True
        await self.stop()
        if self.membership is not None:
            try:
                await self.membership.leave()
            except Exception as e:
                log.warning("leaving membership failed for %s: %r", self.replica_id, e)
        leases: list[Lease] = []
        for w, lease in list(self._owned.items()):
            leases.append(lease)
            self._events.append((self.on_lose, (w,)))
        self._owned.clear()
        if self.master.held:
            leases.append(self.master)
            self._events.append((self.on_master_lose, ()))
        values = [(lease.key, lease.value) for lease in leases]
        for lease in leases:
            lease.drop()
        await self._fire_events()
        if values:
            try:
                await RELEASE.run_many(self.redis, [([k], [v]) for k, v in values])
            except Exception as e:  # they expire within the TTL anyway
                log.warning("releasing leases failed for %s: %r", self.replica_id, e)

    def leases(self) -> Iterable[Lease]:
        """Every lease this replica tracks, valid or not (diagnostics)."""
        return [*self._owned.values(), self.master]
