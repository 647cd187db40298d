"""Fenced leases in Redis: the master lease and one owner lease per worker.

A lease is a STRING `holder|fence` written with `SET NX PX`, renewed by compare-and-extend and
released by compare-and-delete (one-key Lua scripts, so every step touches one slot).

Fencing epochs come from `INCR fence_counter` and are strictly increasing across successive holders
of one lease. That needs care because the counter and the lease live in different slots and cannot be
updated atomically together: a holder first takes the key with the *pending* value `holder|0`, takes a
fence number in the same pipeline, then swaps in `holder|fence` only if the key is still its pending
value. The fence was therefore drawn while the holder held the key, after the previous holder's tenure
ended, so it is higher than any fence of an earlier holder. (`INCR` first and `SET NX` second would let
a holder that stalled between the two install an older fence than its predecessor's.) Fence 0 means
"acquisition in progress": nobody acts under it.

Safety does not rest on Redis telling us we lost: each `Lease` keeps a local monotonic deadline
`valid_until = send time of the last successful acquire/renew + ttl − margin`. The key cannot expire
before `send time + ttl`, so a holder that stops acting at `valid_until` has stopped `margin` before
anyone else can acquire, even if every renew since hung. Owner code checks `lease.is_valid()` before
each action and passes `lease.fence` to the fenced scripts that guard shared state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from app.cluster.membership import LuaScript, as_str

log = logging.getLogger(__name__)

# KEYS[1] lease; ARGV pending value, final value, ttl_ms → 1 if the pending value was swapped in.
SET_FENCE = LuaScript(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0"
)
# KEYS[1] lease; ARGV value, ttl_ms → 1 if still ours and extended.
RENEW = LuaScript(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
# KEYS[1] lease; ARGV value → 1 if it was ours and is now deleted.
RELEASE = LuaScript(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def lease_value(holder: str, fence: int) -> str:
    return f"{holder}|{fence}"


def parse_lease(value: str | bytes | None) -> tuple[str, int] | None:
    """`holder|fence` → (holder, fence); None when unheld. A replica id may itself contain `|`."""
    s = as_str(value)
    if s is None:
        return None
    holder, _, fence = s.rpartition("|")
    try:
        return holder, int(fence)
    except ValueError:
        return s, 0


@dataclass(eq=False)
class Lease:
    """One lease as this replica sees it: whether it holds it, under which fence, until when."""

    key: str
    holder: str
    ttl_ms: int
    margin_ms: int
    fence: int = 0
    held: bool = False
    valid_until: float = 0.0  # time.monotonic() seconds; meaningless unless held

    @property
    def value(self) -> str:
        return lease_value(self.holder, self.fence)

    def is_valid(self, now: float | None = None) -> bool:
        """May we act under this lease right now? False from `valid_until` on, renewed or not."""
        return self.held and (time.monotonic() if now is None else now) < self.valid_until

    def remaining_ms(self) -> float:
        return max(0.0, (self.valid_until - time.monotonic()) * 1000) if self.held else 0.0

    def granted(self, sent: float) -> None:
        """Redis confirmed a take or renew sent at monotonic `sent`: valid until `sent` + ttl − margin."""
        self.held = True
        self.valid_until = sent + (self.ttl_ms - self.margin_ms) / 1000

    def drop(self) -> None:
        """Stop acting under it now (lost, released or given up); Redis is told separately, if at all."""
        self.held = False
        self.valid_until = 0.0

    async def acquire(self, redis: Redis, fence_key: str) -> bool:
        return bool(await acquire_leases(redis, fence_key, [self]))

    async def renew(self, redis: Redis) -> bool:
        """True: extended. False: lost (someone else's or expired), now dropped. Raises on I/O errors,
        leaving the lease to lapse at `valid_until` unless a later renew succeeds."""
        renewed, _ = await renew_leases(redis, [self])
        return bool(renewed)

    async def release(self, redis: Redis) -> None:
        await release_leases(redis, [self])


async def acquire_leases(redis: Redis, fence_key: str, leases: Sequence[Lease]) -> list[Lease]:
    """Try to take every given (unheld) lease; two round trips for any number. Returns those taken.

    A reply lost to a connection error can leave a key with our pending or fenced value that we do not
    track; it expires within the TTL, and `LeaseManager` releases such keys as soon as it sees them.
    """
    if not leases:
        return []
    pipe = redis.pipeline(transaction=False)
    for lease in leases:
        pipe.set(lease.key, lease_value(lease.holder, 0), nx=True, px=lease.ttl_ms)
        pipe.incr(fence_key)
    res = await pipe.execute(raise_on_error=False)
    won: list[tuple[Lease, int]] = []
    for i, lease in enumerate(leases):
        ok, fence = res[2 * i], res[2 * i + 1]
        if ok is True and isinstance(fence, int):
            won.append((lease, fence))
    if not won:
        return []
    sent = time.monotonic()
    results = await SET_FENCE.run_many(
        redis,
        [
            ([lease.key], [lease_value(lease.holder, 0), lease_value(lease.holder, f), lease.ttl_ms])
            for lease, f in won
        ],
    )
    taken: list[Lease] = []
    for (lease, fence), r in zip(won, results, strict=True):
        if r == 1:
            lease.fence = fence
            lease.granted(sent)
            taken.append(lease)
    return taken


async def renew_leases(redis: Redis, leases: Sequence[Lease]) -> tuple[list[Lease], list[Lease]]:
    """Compare-and-extend every held lease in one round trip → (renewed, lost).

    A lease with an I/O error is in neither list and keeps its old deadline.
    """
    held = [lease for lease in leases if lease.held]
    if not held:
        return [], []
    sent = time.monotonic()
    results = await RENEW.run_many(redis, [([lease.key], [lease.value, lease.ttl_ms]) for lease in held])
    renewed: list[Lease] = []
    lost: list[Lease] = []
    for lease, r in zip(held, results, strict=True):
        if isinstance(r, Exception):
            log.warning("lease renew error on %s: %r", lease.key, r)
        elif r == 1:
            lease.granted(sent)
            renewed.append(lease)
        else:
            lease.drop()
            lost.append(lease)
    return renewed, lost


async def release_leases(redis: Redis, leases: Sequence[Lease]) -> int:
    """Stop acting (drop locally) first, then compare-and-delete in Redis; returns keys deleted."""
    if not leases:
        return 0
    values = [(lease.key, lease.value) for lease in leases]
    for lease in leases:
        lease.drop()
    results = await RELEASE.run_many(redis, [([k], [v]) for k, v in values])
    return sum(1 for r in results if r == 1)
