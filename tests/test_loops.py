"""Background loops survive Redis faults (issue 14, Deliver 1): they log, count, back off, go on,
and `/readyz` names a loop that cannot run — instead of a task that dies on the first error."""

from __future__ import annotations

import asyncio
import random
import time

import redis.asyncio as aioredis

from app import metrics as M
from app.cluster.loops import Backoff, LoopHealth
from app.cluster.poller import WorkerPoller
from app.rpc.worker_client import WorkerClient
from app.state.keys import Keys
from app.state.retry import TerminalWrites
from app.state.store import StateStore
from tests.faultproxy import FaultProxy


def test_backoff_grows_exponentially_with_jitter_up_to_its_cap() -> None:
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(1))
    for attempt, top in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        d = [b.delay(attempt) for _ in range(50)]
        assert all(top / 2 <= x <= top for x in d)
        assert len({round(x, 6) for x in d}) > 1  # jittered


def test_a_loop_failing_for_long_is_named_for_readyz_and_clears_on_success() -> None:
    h = LoopHealth(unready_after=3, unready_after_s=0.0)
    before = M.LOOP_ERRORS.labels("poller")._value.get()
    for _ in range(2):
        h.record("poller:w1", ConnectionError("down"))
    assert h.problems() == []  # a blip does not flap readiness
    h.record("poller:w1", ConnectionError("down"))
    assert h.problems() and "poller:w1" in h.problems()[0] and "ConnectionError" in h.problems()[0]
    assert M.LOOP_ERRORS.labels("poller")._value.get() == before + 3  # label is the loop kind
    h.ok("poller:w1")
    assert h.problems() == []


async def test_a_dead_loop_task_is_reported_not_lost() -> None:
    h = LoopHealth()

    async def boom() -> None:
        raise RuntimeError("bug")

    t = asyncio.create_task(boom())
    h.watch(t, "owner_decide:w1")
    await asyncio.wait({t})
    await asyncio.sleep(0)
    assert h.problems() == ["loop owner_decide:w1 died: RuntimeError: bug"]


async def test_poller_survives_redis_loss_and_publishes_again(
    worker_pool, shared_embedded_redis, cluster
) -> None:
    """Before issue 14 a ConnectionError in the snapshot write ended the poll task while the lease
    stayed held: the worker's snapshot froze for good."""
    proxy = FaultProxy(shared_embedded_redis)
    redis = aioredis.from_url(proxy.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    keys = Keys(cluster)
    store = StateStore(redis, keys)
    w = worker_pool["prefill"][0]
    wid = f"prefill@{w.address}"
    loops = LoopHealth(unready_after=2, unready_after_s=0.3)
    poller = WorkerPoller(wid, WorkerClient(w.address), redis, keys, store, interval_ms=50, loops=loops)
    direct = aioredis.from_url(shared_embedded_redis)

    async def seq() -> int:
        return int(await direct.hget(keys.snapshot(wid), "seq") or 0)

    async def until(cond, timeout: float) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not await cond():
            assert time.monotonic() < end, "timed out"
            await asyncio.sleep(0.05)

    try:
        poller.start()
        await until(lambda: _gt(seq(), 0), 10)
        proxy.down()
        await until(lambda: _true(loops.failures(f"poller:{wid}") >= 2), 5)
        await asyncio.sleep(0.4)
        assert any(wid in p for p in loops.problems())  # /readyz would name it
        frozen = await seq()
        proxy.up()
        await until(lambda: _gt(seq(), frozen), 10)  # publishing again
        assert poller._task is not None and not poller._task.done()
        # The snapshot lands mid-iteration (the cache publish and the loop's `ok` come after it, and
        # that publish may meet a pooled connection the outage closed): healthy once an iteration
        # completes, within a bound.
        await until(lambda: _true(loops.problems() == []), 5)
    finally:
        await poller.stop()
        await poller.client.close()
        await redis.aclose()
        await direct.aclose()
        proxy.close()


async def test_terminal_writes_wait_for_redis_and_apply_in_order(shared_embedded_redis, cluster) -> None:
    proxy = FaultProxy(shared_embedded_redis)
    redis = aioredis.from_url(proxy.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    direct = aioredis.from_url(shared_embedded_redis)
    q = TerminalWrites(LoopHealth(backoff=Backoff(0.02, 0.2)))
    key = f"{cluster}:order"
    try:
        proxy.down()
        for i in range(3):
            assert not await q.run_or_queue(f"w{i}", lambda i=i: redis.rpush(key, i))
        assert len(q) == 3
        await asyncio.sleep(0.3)
        assert len(q) == 3  # still away: nothing dropped
        proxy.up()
        end = time.monotonic() + 5
        while len(q):
            assert time.monotonic() < end
            await asyncio.sleep(0.05)
        assert await direct.lrange(key, 0, -1) == [b"0", b"1", b"2"]
    finally:
        await q.stop(0)
        await direct.delete(key)
        await redis.aclose()
        await direct.aclose()
        proxy.close()


async def test_a_queued_write_that_fails_for_good_is_dropped_and_the_rest_still_apply(
    shared_embedded_redis, cluster
) -> None:
    """A queued write that Redis refuses for a reason other than being away (here WRONGTYPE, a real
    error of the real server) would fail the same way forever: it is dropped and counted, and the
    writes behind it still apply. The drain task used to die on it, and the queue stalled until the
    next write restarted it on the same head."""
    proxy = FaultProxy(shared_embedded_redis)
    redis = aioredis.from_url(proxy.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    direct = aioredis.from_url(shared_embedded_redis)
    q = TerminalWrites(LoopHealth(backoff=Backoff(0.02, 0.2)))
    key, wrong = f"{cluster}:order2", f"{cluster}:a-hash"
    failed0 = M.TERMINAL_WRITES.labels("failed")._value.get()
    try:
        await direct.hset(wrong, "f", "v")
        proxy.down()
        assert not await q.run_or_queue("w0", lambda: redis.rpush(key, 0))
        assert not await q.run_or_queue("bad", lambda: redis.rpush(wrong, "x"))  # WRONGTYPE once up
        assert not await q.run_or_queue("w1", lambda: redis.rpush(key, 1))
        proxy.up()
        end = time.monotonic() + 5
        while len(q):
            assert time.monotonic() < end, "the queue stalled"
            await asyncio.sleep(0.05)
        assert await direct.lrange(key, 0, -1) == [b"0", b"1"]
        assert M.TERMINAL_WRITES.labels("failed")._value.get() == failed0 + 1
        assert q._task is not None and not q._task.done()  # still draining, for the next outage
    finally:
        await q.stop(0)
        await direct.delete(key, wrong)
        await redis.aclose()
        await direct.aclose()
        proxy.close()


async def _gt(v, n: int) -> bool:  # type: ignore[no-untyped-def]
    return (await v) > n


async def _true(b: bool) -> bool:
    return b
