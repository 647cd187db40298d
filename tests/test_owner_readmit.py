"""Accounting of a request the owner takes up again from a dead owner's batch (DESIGN §6 "Dead
owner"): the claim's redispatch (app/dispatch/claim.py) and the adoption's re-run after a worker
restart (app/dispatch/adopt.py), and the old-epoch sweep (`settle_old_epochs`, app/dispatch/ledger.py).

- A hand-off adds its predicted ms to the worker's `queued_ms` once and the first commit of it took
  them off; the re-admitted request's commit took them off a second time (clamped at 0, so the
  worker looked less busy than it was while other work still waited, and routing sent it more).
- `_redispatched` (request id → the old batch, to follow a `duplicate` answer) kept the entry of a
  re-admitted request that was answered other than by a result: a commit that dropped it
  (tombstoned between the check and the batch), a refusal, a failure.
- The sweep settled only batches of the epoch the poller saw last: a worker that restarted twice
  before the owner looked (or an earlier sweep that failed) left older batches owed until the
  audit's 300 s TTL.

Redis, the pool's prefill worker (a dedicated one for the restarts) and the dispatcher are real;
the dead owner's commit is the commit the product's owner makes (`StateStore.commit_batch` under its
own lease, which then lapses), and each injection is named where it is made.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import numpy as np

from app.cluster.leases import Lease, acquire_leases
from app.dispatch.items import QueueItem, parse_item
from app.dispatch.ledger import settle_old_epochs
from app.dispatch.owner import OwnerDispatcher
from app.rpc.worker_client import WorkerClient
from app.scheduling.batcher import BatcherConfig
from app.state.handoff import GROUP, pack_tokens

from .conftest import handoff_rig, start_worker

SLOW = "1500"  # each batch runs 1.5 modelled s (time scale 1): what waits behind it stays queued
# One batch at a time, of one request, dispatched at once; no starvation promotion, so a `bulk`
# item waits behind a `default` one however long it waited.
ONE_AT_A_TIME = BatcherConfig(max_size=1, max_inflight_batches=1, wait_ms=0.0, starvation_ms=0.0)
BOUND_S = 20.0  # loose wall bound on each wait


async def _poll(cond: Any, what: str, bound_s: float = BOUND_S, every_s: float = 0.02) -> Any:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        got = await cond()
        if got:
            return got
        await asyncio.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


class Rig:
    """A worker's hand-off queue on real Redis, a dead owner's commits, and the new owner."""

    def __init__(self, url: str, rig: tuple[Any, str, Any, Any, Any], epoch: str) -> None:
        self.url, self.epoch = url, epoch
        self.keys, self.wid, self.r, self.store, self.handoff = rig
        self.old = Lease(self.keys.owner_lease(self.wid), "gw-old", 400, 100)  # the dead owner's: lapses soon
        self.new = Lease(self.keys.owner_lease(self.wid), "gw-new", 3000, 1000)
        self._renew: asyncio.Task[None] | None = None

    async def hand_off(self, pred: float, priority: int | None = None) -> str:
        """The origin's hand-off (as app/request/handoff_stage.py appends it): `pred` ms queued."""
        rid = f"ra-{uuid.uuid4().hex[:8]}"
        meta: dict[str, Any] = {"rid": rid, "origin": "gw-origin", "pred": pred}
        if priority is not None:
            meta["pr"] = priority
        entry, _, _ = await self.handoff.append(
            self.wid, meta, pack_tokens(np.arange(48) + len(rid) + int(pred)), pred, 1000
        )
        assert entry is not None
        return rid

    async def old_owner_commits(self, n: int) -> list[QueueItem]:
        """The dead owner read the next `n` entries and committed each as its own batch under its
        lease (taking their ms off queued_ms), then died before sending them: its lease lapses."""
        assert await acquire_leases(self.r, self.keys.fence_counter, [self.old])
        res = await self.r.xreadgroup(GROUP, "gw-old", {self.keys.queue(self.wid): ">"}, count=n)
        items = [parse_item(eid, f) for eid, f in res[0][1]]
        for i in items:
            kept = await self.store.commit_batch(
                self.wid,
                f"b-old-{i.request_id}",
                [i.request_id],
                i.predicted_ms,
                time.time() * 1000,
                self.old.fence,
                "gw-old",
                epoch=self.epoch,
                take_ms=i.predicted_ms,
            )
            assert kept == [i.request_id]
        return items

    async def take_over(self) -> None:
        """The new owner's fenced acquire, once the dead owner's lease lapsed; kept renewed."""

        async def acquired() -> bool:
            return bool(await acquire_leases(self.r, self.keys.fence_counter, [self.new]))

        await _poll(acquired, "the dead owner's lease to lapse", 5.0, 0.05)

        async def keep() -> None:
            while True:
                await self.new.renew(self.r)
                await asyncio.sleep(0.5)

        self._renew = asyncio.create_task(keep())

    async def queued_ms(self) -> float:
        return float(await self.r.get(self.keys.queued_ms(self.wid)) or 0.0)

    async def at_commit_of(self, rid: str, not_batch: str) -> float:
        """The worker's queued_ms at the moment the ledger first holds `rid` in a batch other than
        `not_batch`, read in one transaction with the ledger (MULTI): the value right after that
        commit, whatever commits next."""

        async def look() -> tuple[float] | None:  # (0.0,): found, and nothing queued
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.hgetall(self.keys.ledger(self.wid))
                pipe.get(self.keys.queued_ms(self.wid))
                raw, q = await pipe.execute()
            for bid, entry in raw.items():
                if bid.decode() != not_batch and rid in json.loads(entry)["members"]:
                    return (float(q or 0.0),)
            return None

        return float((await _poll(look, f"the commit of {rid}"))[0])

    async def replies(self, rids: list[str]) -> dict[str, str]:
        async def all_in() -> dict[str, str] | None:
            got = {
                f[b"rid"].decode(): f[b"status"].decode()
                for _, f in await self.r.xrange(self.keys.replies("gw-origin"))
            }
            return got if set(rids) <= set(got) else None

        got: dict[str, str] = await _poll(all_in, f"replies to {rids}", every_s=0.1)
        return got

    async def close(self, d: OwnerDispatcher | None) -> None:
        if self._renew is not None:
            self._renew.cancel()
        if d is not None:
            await d.stop()
        await self.r.aclose()


async def _rig(url: str, p: WorkerClient, prefix: str) -> Rig:
    epoch = str((await p.status())["epoch"])
    return Rig(url, await handoff_rig(url, prefix, p.address), epoch)


def _owner(rig: Rig, p: WorkerClient) -> OwnerDispatcher:
    return OwnerDispatcher(
        rig.wid,
        "gw-new",
        rig.new,
        rig.store,
        p,
        rig.url,
        epoch=lambda: rig.epoch,
        config=lambda: ONE_AT_A_TIME,
    )


async def test_a_readmitted_requests_queued_ms_come_off_once(clients, shared_embedded_redis) -> None:
    """Two requests of a dead owner's batches come back to the new owner: R1 through the claim's
    redispatch (the worker never saw its batch), R2 through the adoption's re-run. F, a fresh
    hand-off of 1000 ms, waits in the batcher behind them the whole time (one batch at a time,
    F `bulk`), so the worker's published queued_ms must read exactly F's 1000 ms right after each
    of their commits: their own ms came off at the dead owner's commit. Before the fix each
    commit took its request's ms again (950, then 900).

    The re-run's cause — the worker restarting under an adopted request — is injected: the
    dispatcher's `_rerun` is called as `_adopt` calls it on seeing the new epoch (here the
    worker's own epoch), and R2's entry is marked handled as the claim marks one it hands to
    `_adopt`. tests/test_adopt_restart_live.py causes the restart for real, end to end."""
    p = clients["prefill"][0]
    await p.configure(formula=SLOW)
    rig = await _rig(shared_embedded_redis, p, "t-readmit")
    d: OwnerDispatcher | None = None
    try:
        r1, r2 = await rig.hand_off(50.0), await rig.hand_off(50.0)
        old = {i.request_id: i for i in await rig.old_owner_commits(2)}
        f = await rig.hand_off(1000.0, priority=0)
        assert await rig.queued_ms() == 1000.0  # the dead owner's commits took R1's and R2's
        await rig.take_over()
        d = _owner(rig, p)
        d._handling.add(old[r2].entry_id)  # R2 is the adoption's (see the docstring)
        d.start()
        assert await rig.at_commit_of(r1, f"b-old-{r1}") == 1000.0
        rerun = asyncio.create_task(d._rerun(old[r2], f"b-old-{r2}", rig.epoch))
        assert await rig.at_commit_of(r2, f"b-old-{r2}") == 1000.0
        assert await rig.replies([r1, r2, f]) == {r1: "ok", r2: "ok", f: "ok"}
        await asyncio.wait_for(rerun, BOUND_S)  # it settled R2's old batch
        assert await rig.queued_ms() == 0.0  # F's own commit took its 1000 ms
        assert not await rig.r.hlen(rig.keys.ledger(rig.wid))
        assert d._redispatched == {}
        assert not (await rig.r.xpending(rig.keys.queue(rig.wid), GROUP))["pending"]
    finally:
        await rig.close(d)


async def test_a_readmitted_request_dropped_at_commit_leaves_the_duplicate_map(
    clients, shared_embedded_redis
) -> None:
    """The map that follows `duplicate` answers (`_redispatched`) holds a re-admitted request
    until its batch answers it; one whose commit drops it (tombstoned: its origin cancelled it
    between the check and the batch) is answered `cancelled` by the commit and must leave it too.
    R1 comes back through the claim's redispatch, cancelled while its owner was dead; R2 through
    the re-run (injected as in the test above), cancelled while it waits behind a running batch G.
    Before the fix both entries stayed for the dispatcher's life (the map ended at size 2)."""
    p = clients["prefill"][0]
    await p.configure(formula=SLOW)
    rig = await _rig(shared_embedded_redis, p, "t-readmit-drop")
    d: OwnerDispatcher | None = None
    try:
        r1, r2 = await rig.hand_off(50.0), await rig.hand_off(50.0)
        old = {i.request_id: i for i in await rig.old_owner_commits(2)}
        await rig.store.tombstone(rig.wid, r1, 60_000)  # the origin's cancel (app/request/endings.py)
        await rig.take_over()
        d = _owner(rig, p)
        d._handling.add(old[r2].entry_id)  # R2 is the adoption's
        d.start()
        assert await rig.replies([r1]) == {r1: "cancelled"}
        g = await rig.hand_off(10.0)
        await rig.at_commit_of(g, "")  # G runs 1.5 s: R2 waits behind it
        rerun = asyncio.create_task(d._rerun(old[r2], f"b-old-{r2}", rig.epoch))

        async def admitted() -> bool:
            return r2 in d._redispatched  # type: ignore[union-attr]

        await _poll(admitted, "R2 re-admitted")
        await rig.store.tombstone(rig.wid, r2, 60_000)  # cancelled after the re-run's check
        got = await rig.replies([r2, g])
        assert (got[r2], got[g]) == ("cancelled", "ok"), got
        await asyncio.wait_for(rerun, BOUND_S)
        assert d._redispatched == {}
        assert await rig.queued_ms() == 0.0
    finally:
        await rig.close(d)


async def test_the_sweep_settles_batches_of_every_older_epoch(
    worker_pool, shared_embedded_redis, worker_tmp
) -> None:
    """A batch committed under epoch E1 outlives its owner (stopped while it ran: it leaves the
    batch to the next owner) and the worker restarts twice, E1 → E2 → E3, with no owner polling in
    between — as when the owner replica is paused, its lease moves, or its sweep failed. The sweep
    the poller runs on seeing E2 → E3 must settle E1's batch too, not only E2's; before the fix it
    stayed owed until the audit's 300 s TTL (the audit leaves older epochs to the sweep).

    Real: Redis, a dedicated worker (killed and started again on its port twice) and the owner
    that committed and sent the batch. The sweep is called as `Ownership.on_health` calls it for
    the poller's E2 → E3 change: a poller that saw E2 and not E1's end cannot be made to order."""
    own = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "600000")
    port = str(own.ready["grpc_port"])
    p = WorkerClient(own.address)
    rig = await _rig(shared_embedded_redis, p, "t-sweep")
    d: OwnerDispatcher | None = None
    try:
        e1 = rig.epoch
        await rig.take_over()
        d = _owner(rig, p)
        d.start()
        await asyncio.wait_for(d._claimed_once.wait(), BOUND_S)
        rid = await rig.hand_off(5.0)
        await rig.at_commit_of(rid, "")

        async def running() -> bool:
            st = await p.status()
            return any(rid in b["request_ids"] and b["phase"] == "running" for b in st["live"])

        await _poll(running, "its batch running")
        await d.stop()  # the owner leaves (lease gone): the batch stays committed, owed
        d = None
        epochs = [e1]
        for _ in range(2):
            own.kill_hard()
            own = start_worker(
                "prefill", worker_tmp, "--profile", "formula", "--formula", "1", "--grpc-port", port
            )
            epochs.append(own.epoch)
        e2, e3 = epochs[1], epochs[2]
        assert len(set(epochs)) == 3
        ledger = await rig.store.read_ledger(rig.wid)
        assert [e["epoch"] for e in ledger.values()] == [e1], ledger
        assert await settle_old_epochs(rig.store, rig.wid, e3, e2) == 1
        assert not await rig.r.hlen(rig.keys.ledger(rig.wid))
    finally:
        await rig.close(d)
        await p.close()
        own.stop()


async def test_a_batch_whose_members_were_all_cancelled_while_queued_leaves_no_size(
    clients, shared_embedded_redis
) -> None:
    """The owner keeps each batch's size (`_batch_sizes`, for its replies and for the ledger audit,
    which skips batches it is still dispatching) until the batch's call ends. A batch whose only
    member was tombstoned while queued (its origin cancelled it) is dropped at the commit and never
    sent: its size stayed for the dispatcher's life (bench/leak_probe.py: 0.5-1.2 entries per 1,000
    requests, without bound). R is queued behind a running batch G (one batch in flight at a
    time), then cancelled by its origin's tombstone."""
    p = clients["prefill"][0]
    await p.configure(formula=SLOW)
    rig = await _rig(shared_embedded_redis, p, "t-sizes-drop")
    d: OwnerDispatcher | None = None
    try:
        await rig.take_over()
        d = _owner(rig, p)
        d.start()
        g = await rig.hand_off(10.0)
        await rig.at_commit_of(g, "")  # G runs 1.5 s: R waits behind it
        r = await rig.hand_off(10.0)
        await rig.store.tombstone(rig.wid, r, 60_000)  # the origin's cancel (app/request/endings.py)
        got = await rig.replies([r, g])
        assert (got[r], got[g]) == ("cancelled", "ok"), got

        async def idle() -> bool:
            return not d._inflight and not d._handling  # type: ignore[union-attr]

        await _poll(idle, "the owner done with both batches")
        assert d._batch_sizes == {}
    finally:
        await rig.close(d)
