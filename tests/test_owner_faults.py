"""Two faults of the chaos suite's cases, each pinned down on its own with real Redis and real
Triton workers (tests/test_faults.py runs the cases end to end): the owner's claim that fails
part-way (case 5b's leftovers) and the engine work of a dead origin (case 1's reconciler), the
latter through real replicas, one of them SIGKILLed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid

import httpx
import numpy as np
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.cluster.leases import Lease, acquire_leases
from app.dispatch.owner import OwnerDispatcher
from app.state.handoff import GROUP, pack_tokens
from app.state.keys import Keys

from .conftest import finished_records, handoff_rig, record_mark, running_on, worker_call
from .gateways import metric_value, start_gateway, wait_for

# ---- the reconciler cancels a dead origin's engine work -----------------------------------------
# The dead origin's prefill batch runs 600 modelled s (time scale 1) and its generation 8,000
# tokens (the API's most) at a 100x slower clock: only a cancel ends either within the test.
DEAD_PREFILL_FORMULA = "600000"
DEAD_DECODE_TOKENS = 8_000
DEAD_DECODE_SCALE = 100.0


def test_dead_origins_running_prefill_and_decode_are_cancelled_on_the_engines(
    workers_reset, shared_embedded_redis, cluster, tmp_path
) -> None:
    """The reconciler ends a dead origin's request `owner_lost` and cancels what still runs for it
    on the engines (its output has no reader) once it has stayed dead `cancel_after_s` (10 s): a
    slow prefill batch and a long decode both end `cancelled` then, instead of taking their slot
    and KV to the end.

    The death is real: replica B (joined after A, so A owns every worker and is the master) accepts
    both requests, and is SIGKILLed by PID while one decodes and the other's batch runs. A's
    master finds it gone after the membership TTL and reconciles. `workers_reset` puts the pool
    back, pass or fail."""
    pool = workers_reset
    prefills, d = pool["prefill"], pool["decode"][0]
    assert worker_call(d.address, "configure", time_scale=DEAD_DECODE_SCALE)["ok"]
    spec = ",".join([*(f"prefill@{p.address}" for p in prefills), f"decode@{d.address}"])
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec)
    b = start_gateway(tmp_path, shared_embedded_redis, cluster)
    keys = Keys(cluster)
    r = redis.Redis.from_url(shared_embedded_redis)
    rd, rp = f"rd-{cluster}", f"rp-{cluster}"
    marks = {p.address: record_mark(p.address) for p in prefills}

    def send(rid: str, max_new: int) -> None:
        body = {"prompt": f"dead origin {rid}", "max_new_tokens": max_new, "request_id": rid}
        # B dies under it: the client sees its connection drop, whatever the request's fate
        with contextlib.suppress(httpx.TransportError):
            httpx.post(b.url + "/v1/generate", json=body, timeout=120)

    def decoding() -> list[str]:
        running: list[str] = worker_call(d.address, "status")["live"]["running"]
        return running

    def prefill_running(rid: str) -> bool:
        return any(running_on(p.address, rid) for p in prefills)

    def state(rid: str) -> str:
        return (r.hget(keys.request(rid), "state") or b"").decode()

    threads = [
        threading.Thread(target=send, args=(rd, DEAD_DECODE_TOKENS), daemon=True),
        threading.Thread(target=send, args=(rp, 2), daemon=True),
    ]
    try:
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="ready")
        leases = a.get("/admin/leases", admin=True).json()
        assert {(o or {}).get("holder") for o in leases["owners"].values()} == {a.replica_id}, leases
        threads[0].start()  # prefilled at the pool's formula (1 ms), then a long generation
        wait_for(lambda: rd in decoding(), 30, what="B's first request decoding")
        for p in prefills:  # from now on a prefill batch runs for 600 s
            assert worker_call(p.address, "configure", formula=DEAD_PREFILL_FORMULA)["ok"]
        threads[1].start()
        wait_for(lambda: prefill_running(rp), 30, what="B's second request's batch running")

        b.kill()  # SIGKILL by PID: B's membership lapses, nothing of it answers again
        wait_for(lambda: state(rd) == state(rp) == "owner_lost", 30, what="both ended owner_lost")
        # Too soon to cancel: a stalled origin may still wake within cancel_after_s.
        assert rd in decoding() and prefill_running(rp), "cancelled before cancel_after_s"

        def prefill_record() -> dict | None:
            for p in prefills:
                for rec in finished_records(p.address, marks[p.address]):
                    if rec["request_id"] == rp:
                        return rec
            return None

        rec = wait_for(prefill_record, 120, interval=0.5, what="B's prefill ended on its engine")
        assert rec["status"] == "cancelled", rec  # not its 600 s batch run to the end
        wait_for(lambda: rd not in decoding(), 60, what="B's generation ended on its engine")
        assert int(worker_call(d.address, "status")["running"]) == 0
        reconciled = {
            k: metric_value(a, "flexlb_reconciled_total", kind=k)
            for k in ("record_owner_lost", "engine_cancelled")
        }
        assert reconciled == {"record_owner_lost": 2, "engine_cancelled": 2}, reconciled
    finally:
        b.kill()
        a.stop()
        for th in threads:
            if th.is_alive():
                th.join(30)
        r.close()


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
