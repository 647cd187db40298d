"""Cluster coordination: rendezvous assignment, membership heartbeats, fenced leases.

The Redis tests run on `FLEXLB_REDIS_URL` when set, else on the embedded real Redis; each uses its
own key prefix and deletes only its own keys. TTLs are a few hundred ms so the whole file runs in
seconds; every wait is a bounded poll, and each bound is the property under test (e.g. "moves
within 2×TTL"), not a guess at a sleep.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from app.cluster.leases import Lease, LeaseManager, parse_lease
from app.cluster.membership import LuaScript, Membership
from app.cluster.rendezvous import assign, preferred_owner, ranked_owners, weight
from app.state.keys import Keys

REDIS_URL = os.environ.get("FLEXLB_REDIS_URL")


# ---- helpers ---------------------------------------------------------------------------------
async def wait_until(pred: Callable[[], Any], timeout_s: float, interval_s: float = 0.005) -> float:
    """Poll `pred` (sync or async) until truthy; returns the seconds it took, fails past the bound."""
    t0 = time.monotonic()
    while True:
        out = pred()
        if isinstance(out, Awaitable):
            out = await out
        if out:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s:.3f} s")
        await asyncio.sleep(interval_s)


class Cluster:
    """One test's Redis client + private key prefix, and everything it started (stopped at teardown)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.running: list[Membership | LeaseManager] = []

    def workers(self, n: int) -> list[str]:
        return [f"prefill@10.0.0.{i}:8001" for i in range(n)]

    async def register(self, workers: list[str]) -> None:
        await self.redis.sadd(self.keys.workers, *workers)

    def membership(self, rid: str, ttl_ms: int, heartbeat_ms: int | None = None) -> Membership:
        m = Membership(self.redis, self.keys, rid, f"{rid}:8000", heartbeat_ms or ttl_ms // 4, ttl_ms)
        self.running.append(m)
        return m

    def manager(self, rid: str, ttl_ms: int, **kw: Any) -> LeaseManager:
        lm = LeaseManager(self.redis, self.keys, rid, ttl_ms, **kw)
        self.running.append(lm)
        return lm

    async def holders(self, workers: list[str]) -> dict[str, str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for w in workers:
            pipe.get(self.keys.owner_lease(w))
        return dict(zip(workers, await pipe.execute(), strict=True))


def only(rid: str) -> Callable[[], Awaitable[list[str]]]:
    """A live-members source that sees only `rid`: every manager believes every worker is its own,
    so they genuinely race on each SET NX."""

    async def src() -> list[str]:
        return [rid]

    return src


class Recorder:
    """Hook sink: which workers each hook says we act for."""

    def __init__(self) -> None:
        self.active: dict[str, int] = {}
        self.lost: list[str] = []

    def on_acquire(self, wid: str, fence: int) -> None:
        assert wid not in self.active, "acquired twice without a loss in between"
        self.active[wid] = fence

    async def on_lose(self, wid: str) -> None:
        self.active.pop(wid)
        self.lost.append(wid)


@pytest.fixture
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    # FLEXLB_REDIS_URL when set; otherwise the session's embedded real Redis (never skipped).
    url = REDIS_URL or request.getfixturevalue("shared_embedded_redis")
    redis = Redis.from_url(url, decode_responses=True)
    c = Cluster(redis, Keys(prefix=f"test-cluster-{uuid.uuid4().hex[:12]}"))
    try:
        yield c
    finally:
        for obj in reversed(c.running):
            await obj.stop()
        mine = [k async for k in redis.scan_iter(match=f"{c.keys.prefix}:*", count=1000)]
        if mine:
            await redis.delete(*mine)
        await redis.aclose()


# ---- rendezvous (pure) -----------------------------------------------------------------------
def test_assign_is_deterministic_and_order_free() -> None:
    workers = [f"w{i}" for i in range(50)]
    a = assign(workers, ["r1", "r2", "r3"])
    assert a == assign(reversed(workers), ["r3", "r1", "r2", "r1"])
    assert set(a) == set(workers) and set(a.values()) <= {"r1", "r2", "r3"}
    for w, m in a.items():
        assert preferred_owner(w, ["r2", "r3", "r1"]) == m == ranked_owners(w, ["r1", "r2", "r3"])[0]
    assert assign(workers, []) == {} and preferred_owner("w", []) is None
    assert weight("r1", "w1") == weight("r1", "w1") != weight("r1", "w2")


@settings(max_examples=30, deadline=None)
@given(
    members=st.sets(st.text(min_size=1, max_size=12), min_size=2, max_size=6),
    n_workers=st.integers(min_value=1, max_value=80),
    data=st.data(),
)
def test_removing_a_member_moves_only_its_workers(members: set[str], n_workers: int, data: Any) -> None:
    workers = [f"decode@h{i}:9" for i in range(n_workers)]
    before = assign(workers, members)
    gone = data.draw(st.sampled_from(sorted(members)))
    after = assign(workers, members - {gone})
    for w in workers:
        if before[w] != gone:
            assert after[w] == before[w], "a worker of a surviving member moved"
        else:
            assert after[w] == ranked_owners(w, members)[1], "an orphan went somewhere but its runner-up"
    # and symmetrically: adding `gone` back takes only the workers it wins
    assert assign(workers, members) == before


def test_spread_over_three_members_is_roughly_even() -> None:
    counts: dict[str, int] = {}
    for m in assign(
        [f"prefill@10.1.{i // 250}.{i % 250}:8001" for i in range(300)], ["a", "b", "c"]
    ).values():
        counts[m] = counts.get(m, 0) + 1
    assert sorted(counts) == ["a", "b", "c"]
    assert all(70 <= c <= 130 for c in counts.values()), counts  # mean 100, sd ≈ 8.2


# ---- membership ------------------------------------------------------------------------------
async def test_heartbeat_writes_member_and_leave_removes_at_once(cluster: Cluster) -> None:
    m = cluster.membership("r-a", ttl_ms=500)
    assert await m.heartbeat_once() is True  # new entry
    assert await m.heartbeat_once() is False
    assert await m.live_members() == ["r-a"]
    info = await cluster.redis.hgetall(cluster.keys.member("r-a"))
    assert info["address"] == "r-a:8000" and int(info["started_ms"]) > 0
    assert 0 < await cluster.redis.pttl(cluster.keys.member("r-a")) <= 500
    await m.leave()
    assert await m.live_members() == [] and await m.dead_members() == []
    assert not await cluster.redis.exists(cluster.keys.member("r-a"))
    assert await m.heartbeat_once() is True  # back after being removed


async def test_silent_member_lapses_within_ttl_and_is_reaped(cluster: Cluster) -> None:
    ttl = 400
    a, b = cluster.membership("r-a", ttl), cluster.membership("r-b", ttl)
    a.start()
    b.start()
    await wait_until(lambda: _eq(a.live_members(), ["r-a", "r-b"]), 2 * ttl / 1000)
    await a.stop()  # crash-like: no leave
    took = await wait_until(lambda: _not_in(b.live_members(), "r-a"), 2 * ttl / 1000)
    assert took <= 2 * ttl / 1000
    assert await b.dead_members() == ["r-a"]
    assert await b.reap() == ["r-a"]
    assert await b.dead_members() == [] and await b.live_members() == ["r-b"]
    assert not await cluster.redis.zscore(cluster.keys.members, "r-a")


async def _eq(aw: Awaitable[Any], want: Any) -> bool:
    return (await aw) == want


async def _not_in(aw: Awaitable[list[str]], rid: str) -> bool:
    return rid not in await aw


async def test_scripts_load_themselves_on_noscript(cluster: Cluster) -> None:
    fresh = LuaScript(f"-- {uuid.uuid4()}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])")  # never cached
    key = cluster.keys.w("x", "n")
    assert await fresh.run_many(cluster.redis, [([key], [1]), ([key], [2])]) == [1, 3]  # each ran once
    assert await fresh(cluster.redis, [key], [4]) == 7


# ---- single lease ----------------------------------------------------------------------------
async def test_lease_fence_increases_and_only_holder_renews_or_releases(cluster: Cluster) -> None:
    r, key, fk = cluster.redis, cluster.keys.owner_lease("w"), cluster.keys.fence_counter
    a, b = Lease(key, "r-a", 500, 150), Lease(key, "r-b", 500, 150)
    assert await a.acquire(r, fk) and a.is_valid() and a.fence > 0
    assert await r.get(key) == f"r-a|{a.fence}"
    assert not await b.acquire(r, fk) and not b.held
    await b.release(r)  # not ours: a compare-and-delete must not touch it
    assert await r.get(key) == a.value
    assert await a.renew(r) and 350 - 50 < a.remaining_ms() <= 350
    first = a.fence
    await a.release(r)
    assert not a.is_valid() and await r.get(key) is None
    assert await b.acquire(r, fk) and b.fence > first
    assert not await a.renew(r)  # never renews what it does not hold
    assert parse_lease(b.value) == ("r-b", b.fence) and parse_lease("x|y|7") == ("x|y", 7)


# ---- lease managers --------------------------------------------------------------------------
async def test_racing_managers_never_both_hold_a_worker(cluster: Cluster) -> None:
    ttl = 300
    workers = cluster.workers(40)
    await cluster.register(workers)
    a = cluster.manager("r-a", ttl, live_members=only("r-a"))
    b = cluster.manager("r-b", ttl, live_members=only("r-b"))
    a.start()
    b.start()
    samples = checked = 0
    killed_at: float | None = None
    restarted = False
    t0 = time.monotonic()
    # 2 s, or longer (bounded) until the sample counts below are reached: on a loaded 2-core box a
    # sample (one Redis round trip) can take 20 ms, and the check must not thin out with the load.
    while time.monotonic() - t0 < 2.0 or (
        (samples <= 100 or checked <= 1000) and time.monotonic() - t0 < 8.0
    ):
        if killed_at is None and time.monotonic() - t0 > 0.7:
            await a.stop()  # A stops renewing; B takes over as A's keys expire, A restarts later
            killed_at = time.monotonic()
        if killed_at is not None and not restarted and time.monotonic() - killed_at > 0.5:
            a.start()
            restarted = True
        oa, ob = a.owned(), b.owned()
        assert not (oa.keys() & ob.keys()), f"both hold {oa.keys() & ob.keys()}"
        held = {**oa, **ob}
        values = await cluster.holders(sorted(held))
        for w, lease in held.items():
            # Still valid after the read came back ⇒ the key was ours when Redis answered.
            if lease.is_valid():
                assert values[w] == lease.value, (w, values[w], lease.value)
                checked += 1
        samples += 1
        await asyncio.sleep(0.002)
    assert samples > 100 and checked > 1000
    assert set(a.owned()) | set(b.owned()) == set(workers)


async def test_stale_holder_stops_before_another_acquires_and_cannot_renew(cluster: Cluster) -> None:
    ttl = 450
    w = cluster.workers(1)
    await cluster.register(w)
    rec = Recorder()
    a = cluster.manager("r-a", ttl, live_members=only("r-a"), on_acquire=rec.on_acquire, on_lose=rec.on_lose)
    b = cluster.manager("r-b", ttl, live_members=only("r-b"))
    t_send = time.monotonic()
    await a.tick()
    stale = a.owned()[w[0]]
    assert rec.active == {w[0]: stale.fence}
    # A is now partitioned: it never ticks again. B polls until the key expires and it wins.
    await b.tick()
    assert b.owned() == {}  # sticky: B never takes a held lease
    lapsed = await wait_until(lambda: not stale.is_valid(), ttl / 1000)
    assert time.monotonic() - t_send <= ttl / 1000 and lapsed < ttl / 1000
    while not b.owned():
        assert not stale.is_valid()  # A had stopped acting before B could possibly hold it
        await b.tick()
        assert time.monotonic() - t_send < 2 * ttl / 1000
    fresh = b.owned()[w[0]]
    assert fresh.fence > stale.fence
    assert not await stale.renew(cluster.redis) and not stale.held
    assert await cluster.redis.get(cluster.keys.owner_lease(w[0])) == fresh.value
    await a.tick()  # A notices, fires on_lose, and does not take it back
    assert rec.active == {} and rec.lost == w and a.owned() == {}


async def test_key_lost_early_renew_fails_and_drops_at_once(cluster: Cluster) -> None:
    w = cluster.workers(1)
    await cluster.register(w)
    rec = Recorder()
    a = cluster.manager("r-a", 3000, live_members=only("r-a"), on_acquire=rec.on_acquire, on_lose=rec.on_lose)
    await a.tick()
    lease = a.owned()[w[0]]
    # The key vanishes while A's local deadline is far away (e.g. a failover lost it) and B takes it.
    await cluster.redis.delete(lease.key)
    other = Lease(lease.key, "r-b", 3000, 1000)
    assert await other.acquire(cluster.redis, cluster.keys.fence_counter)
    await a.tick()
    assert a.owned() == {} and not lease.is_valid() and rec.lost == w
    assert await cluster.redis.get(lease.key) == other.value


async def test_killed_manager_leases_move_to_survivor_within_two_ttl(cluster: Cluster) -> None:
    ttl = 500
    workers = cluster.workers(30)
    await cluster.register(workers)
    ma, mb = cluster.membership("r-a", ttl), cluster.membership("r-b", ttl)
    await ma.heartbeat_once()
    await mb.heartbeat_once()
    a = cluster.manager("r-a", ttl, membership=ma)
    rec = Recorder()
    b = cluster.manager("r-b", ttl, membership=mb, on_acquire=rec.on_acquire, on_lose=rec.on_lose)
    for x in (ma, mb, a, b):
        x.start()
    await wait_until(lambda: len(a.owned()) + len(b.owned()) == len(workers), 2 * ttl / 1000)
    old = a.owned()
    assert (
        old
        and b.owned()
        and set(old) == {w for w, m in assign(workers, ["r-a", "r-b"]).items() if m == "r-a"}
    )
    await a.stop()  # killed: no release, no leave
    await ma.stop()
    took = await wait_until(lambda: len(b.owned()) == len(workers), 2 * ttl / 1000)
    assert took <= 2 * ttl / 1000
    assert a.owned() == {}  # its local deadlines passed before B could acquire
    assert all(b.owned()[w].fence > lease.fence for w, lease in old.items())
    assert set(rec.active) == set(workers)
    print(f"moved {len(old)} leases in {took * 1000:.0f} ms (ttl {ttl} ms)")


async def test_drain_releases_at_once_and_other_acquires_on_next_tick(cluster: Cluster) -> None:
    ttl = 3000  # ticks are driven by hand here: nothing may expire by itself
    workers = cluster.workers(20)
    await cluster.register(workers)
    ma, mb = cluster.membership("r-a", ttl), cluster.membership("r-b", ttl)
    await ma.heartbeat_once()
    await mb.heartbeat_once()
    ra = Recorder()
    a = cluster.manager("r-a", ttl, membership=ma, on_acquire=ra.on_acquire, on_lose=ra.on_lose)
    b = cluster.manager("r-b", ttl, membership=mb)
    await a.tick()
    await b.tick()
    mine = set(a.owned())
    assert mine and set(b.owned()) == set(workers) - mine and a.is_master() != b.is_master()
    was_master = a.is_master()
    await a.drain()
    assert a.owned() == {} and not a.is_master() and ra.active == {} and set(ra.lost) == mine
    holders = await cluster.holders(workers)
    assert all(v is None for w, v in holders.items() if w in mine)
    assert await mb.live_members() == ["r-b"]
    await b.tick()
    assert set(b.owned()) == set(workers)
    if was_master:
        assert b.is_master()


async def test_master_lease_has_a_single_holder_and_moves_on_death(cluster: Cluster) -> None:
    ttl = 400
    ids = ["r-a", "r-b", "r-c"]
    ms = {rid: cluster.membership(rid, ttl) for rid in ids}
    lms = {rid: cluster.manager(rid, ttl, membership=ms[rid]) for rid in ids}
    for rid in ids:
        ms[rid].start()
        lms[rid].start()
    await wait_until(lambda: any(lm.is_master() for lm in lms.values()), 2 * ttl / 1000)
    for _ in range(100):
        masters = [rid for rid, lm in lms.items() if lm.is_master()]
        assert len(masters) <= 1, masters
        if masters:
            lease = lms[masters[0]].master
            value = await cluster.redis.get(cluster.keys.master_lease)
            if lease.is_valid():
                assert value == lease.value
        await asyncio.sleep(0.005)
    (old,) = [rid for rid, lm in lms.items() if lm.is_master()]
    old_fence = lms[old].master.fence
    await lms[old].stop()
    await ms[old].stop()
    took = await wait_until(
        lambda: any(lm.is_master() for rid, lm in lms.items() if rid != old), 2 * ttl / 1000
    )
    assert took <= 2 * ttl / 1000
    (new,) = [rid for rid, lm in lms.items() if lm.is_master()]
    assert new != old and lms[new].master.fence > old_fence


async def test_orphan_of_a_member_that_never_acquires_is_taken_after_grace(cluster: Cluster) -> None:
    ttl = 300
    workers = cluster.workers(12)
    await cluster.register(workers)
    lazy, ma = cluster.membership("r-lazy", 3000), cluster.membership("r-a", 3000)
    await lazy.heartbeat_once()  # live, but runs no lease manager
    await ma.heartbeat_once()
    a = cluster.manager("r-a", ttl, membership=ma, orphan_grace_ms=200)
    await a.tick()
    lazys = {w for w, m in assign(workers, ["r-lazy", "r-a"]).items() if m == "r-lazy"}
    assert lazys and set(a.owned()) == set(workers) - lazys  # its own at once, the orphans not yet
    t0 = time.monotonic()
    while set(a.owned()) != set(workers):
        await asyncio.sleep(0.05)
        await a.tick()
        assert time.monotonic() - t0 < 1.0
    assert time.monotonic() - t0 >= 0.2


async def test_deregistered_worker_is_released(cluster: Cluster) -> None:
    workers = cluster.workers(3)
    await cluster.register(workers)
    rec = Recorder()
    a = cluster.manager("r-a", 3000, live_members=only("r-a"), on_acquire=rec.on_acquire, on_lose=rec.on_lose)
    await a.tick()
    assert set(a.owned()) == set(workers) == set(rec.active)
    await cluster.redis.srem(cluster.keys.workers, workers[0])
    await a.tick()
    assert set(a.owned()) == set(workers[1:]) and rec.lost == [workers[0]]
    assert await cluster.redis.get(cluster.keys.owner_lease(workers[0])) is None
    assert await a.release(workers[1]) and not await a.release(workers[1])  # hand-off for rebalancing
    assert set(a.owned()) == {workers[2]} and rec.lost == workers[:2]
    assert await cluster.redis.get(cluster.keys.owner_lease(workers[1])) is None
