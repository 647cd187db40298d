"""Two faults of the chaos suite's cases, each pinned down on its own with real Redis and real
Triton workers (tests/test_faults.py runs the cases end to end): the owner's claim that fails
part-way (case 5b's leftovers) and the engine work of a dead origin (case 1's reconciler)."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.cluster.leases import Lease, acquire_leases
from app.cluster.reconciler import Reconciler
from app.dispatch.owner import OwnerDispatcher
from app.state.handoff import GROUP, pack_tokens
from app.state.keys import Keys
from app.state.store import StateStore

from .conftest import handoff_rig


# ---- the reconciler cancels a dead origin's engine work -----------------------------------------
async def test_dead_origins_running_prefill_and_decode_are_cancelled_on_the_engines(
    clients, shared_embedded_redis
) -> None:
    """The reconciler ends a dead origin's request `owner_lost` and cancels what still runs for it
    on the engines (its output has no reader) once it has stayed dead `cancel_after_s`: a slow
    prefill batch and a long decode both end `cancelled` then, instead of taking their slot and KV
    to the end."""
    p, d = clients["prefill"][0], clients["decode"][0]
    await p.configure(formula="20000")  # 20 s per batch: only a cancel ends it early
    await d.configure(profile="formula", formula="1", time_scale=1.0)
    pe, de = (await p.status())["epoch"], (await d.status())["epoch"]
    keys = Keys(f"t-eng-{uuid.uuid4().hex[:6]}")
    r = aioredis.from_url(shared_embedded_redis)
    store = StateStore(r, keys)
    await store.load_scripts()
    wp, wd = f"prefill@{p.address}", f"decode@{d.address}"
    rp, rd = f"rp-{uuid.uuid4().hex[:8]}", f"rd-{uuid.uuid4().hex[:8]}"
    dead = "gw-dead"
    await store.create_request(rp, dead, {"prefill_worker": wp})
    await store.create_request(rd, dead, {"decode_worker": wd})
    await r.sadd(keys.origin_requests(dead), rp, rd)
    await r.sadd(keys.replicas_seen, dead)
    prefill_events: list = []
    decoded: list = []

    async def run_prefill() -> None:
        async for ev in p.prefill(f"b-{rp}", pe, [(rp, np.arange(200, dtype=np.int32))], timeout=60):
            prefill_events.append(ev)

    async def run_decode() -> None:
        async for ev in d.decode(rd, de, 100, 100_000, timeout=60):
            decoded.append(ev)

    tasks = [asyncio.create_task(run_prefill()), asyncio.create_task(run_decode())]
    try:
        for _ in range(500):  # both running on their engines
            if decoded and any(ev.event == "accepted" for ev in prefill_events):
                break
            await asyncio.sleep(0.01)
        rec = Reconciler(
            r,
            keys,
            store,
            live_members=lambda: _aw(["gw-live"]),
            workers=lambda: {wp: {"role": "prefill"}, wd: {"role": "decode"}},
            cancel_on=lambda wid, rid: {wp: p, wd: d}[wid].cancel(rid, timeout=2.0),
            cancel_after_s=1.0,
        )
        counts: dict[str, int] = {}
        t0 = time.monotonic()
        assert await rec.end_origin(dead, counts, [wp]) == 2  # as the master's reaping does
        counts.update(await rec.run_once())  # too soon: a stalled origin may still wake
        assert "engine_cancelled" not in counts and not any(ev.event == "results" for ev in prefill_events)
        await asyncio.sleep(1.0)
        counts.update(await rec.run_once())  # dead for cancel_after_s: its engine work goes
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        took = time.monotonic() - t0
    finally:
        for t in tasks:
            t.cancel()
        await r.aclose()
    assert counts.get("record_owner_lost") == 2 and counts.get("engine_cancelled") == 2, counts
    results = [x for ev in prefill_events if ev.event == "results" for x in ev.results]
    assert [x["status"] for x in results] == ["cancelled"], prefill_events
    assert decoded[-1].finish_reason == "cancelled" and sum(len(e.tokens) for e in decoded) < 100_000
    assert took < 5.0, took  # not the batch's 20 s
    assert (await d.status())["running"] == 0


async def _aw(x):  # type: ignore[no-untyped-def]
    return x


# ---- case 5b's cause: a claim that fails part-way ------------------------------------------------
async def test_a_claim_that_fails_part_way_is_taken_up_again(clients, shared_embedded_redis) -> None:
    """Case 5b left entries pending for good: after Redis came back empty, the new owner's first
    claim took the entries (XAUTOCLAIM) and then lost a pooled connection ("Connection closed by
    server") reading the ledger; the entries stayed marked as handled by us, so every later claim
    skipped them. Here the next claim must take them up and answer every one.

    The fault is injected (the ledger read raises once): a connection dying exactly between two
    given commands cannot be caused for real on demand. Redis, the worker and the owner are real."""
    p = clients["prefill"][0]
    await p.configure(formula="5")
    epoch = (await p.status())["epoch"]
    keys, wid, r, store, handoff = await handoff_rig(shared_embedded_redis, "t-claim", p.address)
    rids = [f"cl-{uuid.uuid4().hex[:8]}" for _ in range(5)]
    for rid in rids:
        meta = {"rid": rid, "origin": "gw-origin", "pred": 5.0}
        await handoff.append(wid, meta, pack_tokens(np.arange(64) + len(rid)), 5.0, 1000)
    # A previous owner read them and died: pending for its consumer.
    await r.xreadgroup(GROUP, "gw-old", {keys.queue(wid): ">"}, count=100)
    lease = Lease(keys.owner_lease(wid), "gw-new", 3000, 1000)
    assert await acquire_leases(r, keys.fence_counter, [lease])
    d = OwnerDispatcher(
        wid, "gw-new", lease, store, p, shared_embedded_redis, epoch=lambda: epoch, reclaim_every_s=0.2
    )
    real_read = store.read_ledger
    failures = [0]

    async def read_ledger_failing_once(w: str):  # type: ignore[no-untyped-def]
        if not failures[0]:
            failures[0] += 1
            raise RedisConnectionError("Connection closed by server.")
        return await real_read(w)

    store.read_ledger = read_ledger_failing_once  # type: ignore[method-assign]
    renew = None
    d.start()
    try:

        async def keep_lease() -> None:
            while True:
                await lease.renew(r)
                await asyncio.sleep(0.5)

        renew = asyncio.create_task(keep_lease())
        end = time.monotonic() + 15
        while time.monotonic() < end:
            pending = (await r.xpending(keys.queue(wid), GROUP))["pending"]
            if not pending:
                break
            await asyncio.sleep(0.1)
        assert failures[0] == 1
        assert pending == 0, await r.xpending_range(keys.queue(wid), GROUP, "-", "+", 10)
        replies = await r.xrange(keys.replies("gw-origin"))
        got = {f[b"rid"].decode(): f[b"status"].decode() for _, f in replies}
        assert got == dict.fromkeys(rids, "ok"), got
    finally:
        if renew is not None:
            renew.cancel()
        await d.stop()
        await r.aclose()
