"""The owner's claims on pending hand-off entries (DESIGN §6 "Dead owner", issue 14): once the
lease is ours, take over the previous owner's pending entries; then, on a period, re-claim entries
idle too long that no task of ours is handling. Each claimed entry is delivered from the worker's
finished record, adopted if the worker still has it, or dispatched once.

A mixin of `OwnerDispatcher` (app/dispatch/owner.py): it uses the dispatcher's lease, reader,
worker client, store, batcher and reply path, and keeps the dispatcher under ~500 lines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app import metrics as M
from app.dispatch.items import QueueItem, parse_item
from app.rpc.worker_client import WorkerUnavailable
from app.state.handoff import GROUP
from app.state.text import to_str as s

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from app.cluster.leases import Lease
    from app.cluster.loops import LoopHealth
    from app.rpc.worker_client import WorkerClient
    from app.scheduling.batcher import Batcher
    from app.state.handoff import Handoff
    from app.state.store import StateStore

log = logging.getLogger("flexlb.owner")


class OwnerClaims:
    wid: str
    replica_id: str
    lease: Lease
    store: StateStore
    handoff: Handoff
    client: WorkerClient
    loops: LoopHealth
    batcher: Batcher
    wake: asyncio.Event
    reclaim_idle_ms: int
    reclaim_every_s: float
    reclaimed: int
    _reader: aioredis.Redis
    _handling: set[str]
    _claimed_once: asyncio.Event
    _redispatched: dict[str, str]
    _inflight: set[asyncio.Task[None]]
    _stopping: bool
    _draining: bool

    time_scale: Callable[[], float]

    async def _reply(self, item: QueueItem, batch_id: str, result: dict[str, Any]) -> None: ...

    def admit(self, item: QueueItem, now_ms: float) -> None: ...

    if TYPE_CHECKING:  # OwnerAdopt's (adopt.py); a stub here would shadow it in the MRO

        async def _adopt(self, item: QueueItem, batch_id: str, epoch: str = "") -> None: ...

    async def _claim_loop(self) -> None:
        """Claim the previous owner's pending entries once the lease is ours (min idle 0), then
        every `reclaim_every_s` re-claim entries idle for `reclaim_idle_ms` that no task of ours is
        handling — ours whose reply could not be written, or a stalled consumer's. A failed claim
        is retried with backoff, logged and counted (`flexlb_loop_errors_total{loop="owner_claim"}`)."""
        name = f"owner_claim:{self.wid}"
        key = self.store.keys.queue(self.wid)
        first = True
        while not self._stopping and not self._draining:
            if not self.lease.is_valid():
                await asyncio.sleep(0.1)
                continue
            try:
                if first:
                    await self.handoff.ensure_group(self.wid)
                n = await self._claim_pending(key, 0 if first else self.reclaim_idle_ms)
                if not first:
                    self.reclaimed += n
                first = False
                self._claimed_once.set()
                self.loops.ok(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self.loops.failed(name, exc)
                continue
            await asyncio.sleep(self.reclaim_every_s)

    async def _claim_pending(self, key: str, min_idle_ms: int = 0) -> int:
        """DESIGN §6 "Dead owner": only after our fenced acquire (we hold the lease) do we take
        over the previous owner's pending entries. Each is delivered from the worker's finished
        record, adopted if the worker has it queued or running, or — never seen by the worker —
        its old batch is tombstoned and it is dispatched once. Entries a task of ours is still
        handling (in the batcher, in a batch in flight) are left alone."""
        claimed: list[QueueItem] = []
        cursor = "0-0"
        while self.lease.is_valid():
            self.store.commands_total += 1
            res = await self._reader.xautoclaim(key, GROUP, self.replica_id, min_idle_ms, cursor, count=256)
            cursor, entries = s(res[0]), res[1]
            claimed += [parse_item(eid, f) for eid, f in entries if f]
            if cursor == "0-0" or not entries:
                break
        claimed = [i for i in claimed if i.entry_id not in self._handling]
        if not claimed:
            return 0
        # Both reads before any entry is marked ours: a failure here (a pooled connection that
        # died with a restarted Redis answers "Connection closed by server") must leave the
        # entries to the next claim, not marked as handled by a task that never got them.
        st = await self.client.status(0, timeout=5.0)
        finished = {r["request_id"]: r for r in st.get("finished", [])}
        live = {rid for b in st.get("live", []) for rid in b.get("request_ids", [])}
        ledger = await self.store.read_ledger(self.wid)
        log.warning(
            "owner %s: claimed %d pending entries (min idle %d ms)", self.wid, len(claimed), min_idle_ms
        )
        # Entries not yet handed to a path that answers them (reply, adoption, the batcher).
        unhanded = {i.entry_id for i in claimed}
        self._handling |= unhanded
        try:
            for item in claimed:
                await self._take_over(item, st, finished, live, ledger)
                unhanded.discard(item.entry_id)
        finally:
            # A failure part-way (a Redis error settling an old batch): the rest is claimed again
            # by the next pass (at once while the first claim has not succeeded), not skipped by
            # every later claim as "handled" — which left entries pending for good (test_faults
            # case 5b, tests/test_owner_faults.py::test_a_claim_that_fails_part_way_is_taken_up_again).
            self._handling -= unhanded
        return len(claimed)

    async def _take_over(
        self,
        item: QueueItem,
        st: dict[str, Any],
        finished: dict[str, Any],
        live: set[str],
        ledger: dict[str, dict[str, Any]],
    ) -> None:
        """Deliver a claimed entry from the worker's finished record, adopt it if the worker still
        has it, or — never seen by the worker — tombstone its old batch and dispatch it once."""
        rec = finished.get(item.request_id)
        old_batches = [b for b, e in ledger.items() if item.request_id in e.get("members", [])]
        if rec is not None:
            M.CLAIMED.labels("delivered").inc()
            await self._reply(
                item, rec["batch_id"], {**rec, "epoch": st.get("epoch", ""), "worker": self.wid}
            )
        elif item.request_id in live:
            M.CLAIMED.labels("adopted").inc()
            t = asyncio.create_task(
                self._adopt(item, old_batches[0] if old_batches else "", str(st.get("epoch", "")))
            )
            self._inflight.add(t)
            t.add_done_callback(self._inflight.discard)
        else:
            M.CLAIMED.labels("redispatched").inc()
            self._redispatched[item.request_id] = old_batches[0] if old_batches else ""
            for bid in old_batches:  # a late arrival of the old batch must not run it twice
                try:
                    await self.client.cancel(bid)
                except (WorkerUnavailable, TimeoutError) as exc:
                    # The worker's own tombstone is what we wanted; without it the engine's
                    # `duplicate` answer for the old batch still keeps it from running twice.
                    log.warning("owner %s: cancel of old batch %s failed: %s", self.wid, bid, exc)
                await self.store.settle(self.wid, bid, item.request_id)
            # Committed before (its old batch is in the ledger): that commit took its predicted
            # ms off queued_ms, so this one must not. Never committed (its owner died between
            # the read and the commit): its ms are still queued, and its commit takes them.
            item.queued_taken = bool(old_batches)
            self.admit(item, time.time() * 1000)
