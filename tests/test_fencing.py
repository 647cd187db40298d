"""Issue 14 Deliver 3: every owner write that changes shared state is fenced by the owner lease or
provably safe when a stale owner repeats it (docs/state.md "Fencing rule"). Here a stale owner's
poller runs against a newer holder's lease on the real Redis and a real worker.

Fault injection, said so: the newer holder's lease value is written by the test (`SET
owner_lease`), the same value a replica's lease loop would write on taking the lease over. Making a
real replica win the lease while this poller still believes itself the owner needs a paused
process across the lease TTL; the write stages that moment exactly, and nothing else is faked."""

from __future__ import annotations

import redis.asyncio as aioredis

from app.cluster.poller import WorkerPoller
from app.rpc.worker_client import WorkerClient
from app.state.keys import Keys
from app.state.store import StateStore


async def test_a_stale_owner_cannot_publish_cache_or_health_and_no_snapshot_rolls_back(
    workers_reset, shared_embedded_redis, cluster
) -> None:
    w = workers_reset["prefill"][0]
    wid = f"prefill@{w.address}"
    redis = aioredis.from_url(shared_embedded_redis)
    keys = Keys(cluster)
    store = StateStore(redis, keys)
    await redis.set(keys.owner_lease(wid), "new-owner|9")
    current = WorkerPoller(
        wid, WorkerClient(w.address), redis, keys, store, lease_value=lambda: "new-owner|9"
    )
    stale = WorkerPoller(wid, WorkerClient(w.address), redis, keys, store, lease_value=lambda: "old-owner|3")
    dead = WorkerPoller(  # a stale owner that also sees the worker as down (its polls fail)
        wid, WorkerClient("127.0.0.1:1"), redis, keys, store, down_after=1, lease_value=lambda: "old-owner|3"
    )
    try:
        await current.poll_once()
        snap = await redis.hgetall(keys.cache_snapshot(wid))
        version = int(snap[b"version"])
        assert snap[b"last_version"] == str(version).encode()
        n_diffs = await redis.xlen(keys.cache_stream(wid))
        # the stale holder's full snapshot and diffs are refused by the fence
        stale.polls = stale.full_every - 1  # its next poll asks for a full snapshot
        await stale.poll_once()
        assert stale.fenced_out == 1
        assert await redis.xlen(keys.cache_stream(wid)) == n_diffs
        # health: the stale owner's "down" verdict does not reach the snapshot
        assert (await redis.hget(keys.snapshot(wid), "health")) == b"up"
        await dead.poll_once()
        assert dead.fenced_out == 1
        assert (await redis.hget(keys.snapshot(wid), "health")) == b"up"
        # only-newer-wins even for a holder the fence lets through: an older full snapshot of the
        # same epoch never replaces the stored one (a mirror loading it would roll back)
        epoch = snap[b"epoch"].decode()
        older = {"version": version - 1, "full": True, "added": [1, 2, 3], "removed": []}
        current.cache_version = None
        await current._publish_cache(epoch, older)
        after = await redis.hgetall(keys.cache_snapshot(wid))
        assert int(after[b"version"]) == version and after[b"keys"] == snap[b"keys"]
        assert await redis.xlen(keys.cache_stream(wid)) == n_diffs
    finally:
        for p in (current, stale, dead):
            await p.client.close()
        await redis.aclose()
