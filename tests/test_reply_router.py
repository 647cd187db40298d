"""The origin's reply inbox (`ReplyRouter`, app/request/channels.py) on real Redis: what the
cross-replica hand-off's reply goes through (issue 20). The stream's once-a-second XTRIM rides in
front of the next read (no round trip of its own, never before a delivery), and a read's entries
are delivered once, also when an earlier read's answer comes late."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis

from app.request.channels import ReplyRouter
from app.state.keys import Keys


async def test_the_trim_rides_the_next_read_and_a_stop_right_after_a_reply_returns(
    redis_url: str, cluster: str
) -> None:
    """A reply read starts the stream's trim (the first at once), sent in front of the next
    blocking read on the same connection: the stream's older entries go (approximate `MINID ~`
    trims whole nodes, so 300 older entries lose at least 200). Stopping the router right after
    a reply returns at once: before, the loop awaited redis-py's XTRIM there, and a cancel that
    landed in it was swallowed and `stop()` waited forever (seen with the trim observed)."""
    keys = Keys(cluster)
    replica = f"gw-{uuid.uuid4().hex[:6]}"
    r = aioredis.from_url(redis_url)
    key = keys.replies(replica)
    pipe = r.pipeline(transaction=False)
    for i in range(300):  # before the router starts: never read, only trimmed
        pipe.xadd(key, {"rid": f"old-{i}", "status": "ok"})
    await pipe.execute()
    try:
        for stop_at_once in (False, True):
            router = ReplyRouter(redis_url, keys, replica)
            await router.start()
            try:
                rid = f"rr-{uuid.uuid4().hex[:8]}"
                fut = router.expect(rid)
                await r.xadd(key, {"rid": rid, "status": "ok", "att": "1"})
                reply = await asyncio.wait_for(fut, 10)
                assert reply["rid"] == rid and reply["status"] == "ok"
                if not stop_at_once:
                    end = time.monotonic() + 10
                    while await r.xlen(key) > 101:
                        assert time.monotonic() < end, "the stream was never trimmed"
                        await asyncio.sleep(0.01)
            finally:
                await asyncio.wait_for(router.stop(), 5)
    finally:
        await r.delete(key)
        await r.aclose()


async def test_a_reads_entries_are_delivered_once(redis_url: str, cluster: str) -> None:
    """Entries at or before the read position are skipped: a read whose caller timed out is
    delivered when its answer comes, after the next read went out from the old position and may
    return the same entries. Delivered twice, the second would sit in the parked replies as if it
    had come before its request waited."""
    keys = Keys(cluster)
    replica = f"gw-{uuid.uuid4().hex[:6]}"
    router = ReplyRouter(redis_url, keys, replica)
    r = aioredis.from_url(redis_url)
    try:
        rid = f"rr-{uuid.uuid4().hex[:8]}"
        eid = await r.xadd(keys.replies(replica), {"rid": rid, "status": "ok", "att": "1"})
        res = await r.xread({keys.replies(replica): "0-0"})
        entries = [(e, f) for _s, es in res for e, f in es]
        fut = router.expect(rid)
        assert router._take(entries) == 1
        assert fut.done() and fut.result()["rid"] == rid
        assert router._last == eid.decode()
        assert router._take(entries) == 0, "delivered twice"
        assert rid not in router._early
    finally:
        await router.stop()
        await r.delete(keys.replies(replica))
        await r.aclose()


async def test_a_reply_nobody_waits_for_is_dropped_after_its_ttl(redis_url: str, cluster: str) -> None:
    """A request that ends before its reply comes (client gone, cancelled: `forget`) leaves the
    reply with nobody to take it. Parked replies are kept `early_ttl_s`: before, they stayed until
    10,000 had piled up (~8 per 1,000 requests under bench/leak_probe.py's mix, ~1 KiB each), so
    a replica's memory grew for hours. Real Redis: the replies come through the stream, as an
    owner on another replica writes them (`HandoffStore.reply_and_settle`)."""
    keys = Keys(cluster)
    replica = f"gw-{uuid.uuid4().hex[:6]}"
    key = keys.replies(replica)
    router = ReplyRouter(redis_url, keys, replica, early_ttl_s=0.3)
    r = aioredis.from_url(redis_url)
    await router.start()
    try:

        async def reply_to(rid: str) -> None:
            router.forget(rid)  # as the pipeline's `finally` does for a request that ended
            await r.xadd(key, {"rid": rid, "status": "ok", "att": "1"})
            end = time.monotonic() + 10
            while rid not in router._early:
                assert time.monotonic() < end, "the reply was never read"
                await asyncio.sleep(0.01)

        gone = [f"gone-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
        for rid in gone:
            await reply_to(rid)
        await asyncio.sleep(0.35)  # past their TTL (wall clock: the TTL is the router's own)
        late = f"late-{uuid.uuid4().hex[:6]}"
        await reply_to(late)
        assert list(router._early) == [late], "replies past their TTL still parked"
        fut = router.expect(late)  # one that is waited for within its TTL is still delivered
        assert fut.done() and fut.result()["rid"] == late
        assert router._early == {}
    finally:
        await asyncio.wait_for(router.stop(), 5)
        await r.delete(key)
        await r.aclose()
