"""Adopted requests (DESIGN §6 "Dead owner"): a claimed entry the worker is still running for a
dead owner is followed until its finished record appears, then delivered. If the worker restarts
meanwhile (a new epoch), the request is gone with the old process and no record will ever come: it
is run again, once, on the new epoch, instead of leaving its client to wait for its deadline.

A mixin of `OwnerDispatcher` (app/dispatch/owner.py), like `OwnerClaims` (claim.py): it uses the
dispatcher's lease, worker client, store, batcher (`admit`), epoch view and reply path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app import metrics as M
from app.dispatch.items import QueueItem
from app.rpc.worker_client import WorkerUnavailable
from app.state.retry import TRANSIENT
from app.state.store import TERMINAL

if TYPE_CHECKING:
    from app.cluster.leases import Lease
    from app.rpc.worker_client import WorkerClient
    from app.state.store import StateStore

log = logging.getLogger("flexlb.owner")

#: How long a re-run waits for the owner's view of the worker (its poller's epoch, which every
#: dispatch carries) to learn the new epoch before it is admitted anyway: the poller polls several
#: times a second, so this only bounds a poller that is failing. A dispatch that still carries the
#: old epoch is refused `epoch_mismatch` before the engine sees it and retried once under the
#: worker's epoch (`OwnerDispatcher._dispatch`), so admitting after the bound is still correct.
VIEW_WAIT_S = 5.0
#: How long a re-run leaves the old batch to the owner's old-epoch sweep (`Ownership.settle_epoch`,
#: run as soon as the poller sees the new epoch) before settling it itself: the sweep does not run
#: when the poller never saw the old epoch (it started polling after the restart).
SWEEP_WAIT_S = 5.0


class OwnerAdopt:
    wid: str
    lease: Lease
    store: StateStore
    client: WorkerClient
    epoch: Callable[[], str]
    _redispatched: dict[str, str]

    async def _reply(self, item: QueueItem, batch_id: str, result: dict[str, Any]) -> None: ...

    def admit(self, item: QueueItem, now_ms: float) -> None: ...

    async def _adopt(self, item: QueueItem, batch_id: str, epoch: str = "") -> None:
        """The worker is running it for a dead owner (under `epoch`, the one the claim saw): wait
        for its finished record, then deliver. A new epoch in the worker's status means it
        restarted and the request is gone: look once at the new process (it may hold or have
        finished it after all: follow or deliver that) and otherwise run it again (`_rerun`)."""
        since = 0
        restarted = False
        deadline = item.deadline_ms or (time.time() * 1000 + 120_000)
        while time.time() * 1000 < deadline and self.lease.is_valid():
            try:
                st = await self.client.status(since, timeout=5.0)
            except (WorkerUnavailable, TimeoutError) as exc:  # a blip: the deadline bounds us
                log.debug("owner %s: adopt status of %s failed: %s", self.wid, item.request_id, exc)
                await asyncio.sleep(0.2)
                continue
            now_epoch = str(st.get("epoch", ""))
            epoch = epoch or now_epoch
            if now_epoch and now_epoch != epoch:
                # Restarted: the new process numbers its records from 1, so read them all.
                epoch, since, restarted = now_epoch, 0, True
                continue
            rec = next((r for r in st.get("finished", []) if r["request_id"] == item.request_id), None)
            if rec is not None:
                await self._reply(item, rec["batch_id"], {**rec, "epoch": epoch, "worker": self.wid})
                return
            for r in st.get("finished", []):
                since = max(since, int(r["seq"]))
            if restarted and not st.get("more") and item.request_id not in _live_ids(st):
                # Neither running nor finished on the new process (all its records read).
                await self._rerun(item, batch_id, epoch)
                return
            if not st.get("more"):
                await asyncio.sleep(0.1)
        await self._reply(
            item, batch_id, {"status": "worker_error", "error": "adopted request never finished"}
        )

    async def _rerun(self, item: QueueItem, batch_id: str, new_epoch: str) -> None:
        """The worker restarted under an adopted request: run it again on `new_epoch`, once.

        It ran on the old process only, which is gone, so this is its first run on the new one;
        the engine's own guards still answer `duplicate` for a request id live there (followed,
        not answered, through `_redispatched`). A request already ended (its origin's reaper
        ended it `owner_lost`, or it was cancelled) is answered `cancelled`, not run, and the
        commit drops one ended between that check and its batch. The dispatch carries the owner's view
        of the epoch, so the re-run waits (bounded) for that view to learn the new one: dispatched
        under the old epoch it would be refused `epoch_mismatch` (and retried once, see
        `VIEW_WAIT_S`). Counted `flexlb_owner_claimed_total{outcome="rerun"}`."""
        end = min(time.monotonic() + VIEW_WAIT_S, time.monotonic() + _left_s(item))
        while self.epoch() != new_epoch and time.monotonic() < end and self.lease.is_valid():
            await asyncio.sleep(0.05)
        if not self.lease.is_valid():
            return  # the entry stays pending: the next owner claims it
        if await self._ended(item.request_id):
            # Its origin's reaper (a dead origin, DESIGN §6) or a cancel ended it: nobody waits
            # for a re-run. Answered under no batch: the old one is the sweep's (`_settle_old`).
            await self._reply(item, "", {"status": "cancelled", "error": "ended before its re-run"})
        else:
            log.warning(
                "owner %s: worker restarted (epoch %s) under adopted request %s: running it again",
                self.wid,
                new_epoch,
                item.request_id,
            )
            M.CLAIMED.labels("rerun").inc()
            self._redispatched[item.request_id] = batch_id
            # The worker ran it, so a commit took its predicted ms off queued_ms already.
            item.queued_taken = True
            self.admit(item, time.time() * 1000)
        if batch_id:
            await self._settle_old(item, batch_id)

    async def _ended(self, rid: str) -> bool:
        """Whether the request's record is terminal. Unknown (Redis failed) counts as not: the
        commit still drops a request its origin's reaper tombstoned."""
        try:
            rec = await self.store.get_request(rid)
        except TRANSIENT as exc:
            log.warning("owner %s: reading %s before its re-run failed: %s", self.wid, rid, exc)
            return False
        return rec is not None and rec.get("state") in TERMINAL

    async def _settle_old(self, item: QueueItem, batch_id: str) -> None:
        """The re-run request's old batch will never be answered: the old-epoch sweep settles it
        (DESIGN §6: a new epoch settles everything held under the old one). Only if it is still in
        the ledger after `SWEEP_WAIT_S` (no sweep ran: the poller never saw the old epoch) is its
        member settled here, so the sweep stays the one path in the common case."""
        end = time.monotonic() + SWEEP_WAIT_S
        try:
            while time.monotonic() < end and self.lease.is_valid():
                entry = (await self.store.read_ledger(self.wid)).get(batch_id)
                if entry is None or item.request_id not in entry.get("members", []):
                    return
                await asyncio.sleep(0.1)
            if self.lease.is_valid() and await self.store.settle(self.wid, batch_id, item.request_id):
                log.warning(
                    "owner %s: settled old-epoch batch %s of re-run %s", self.wid, batch_id, item.request_id
                )
        except TRANSIENT as exc:  # the request is answered or admitted already; the audit's TTL
            log.warning("owner %s: settling old batch %s failed: %s", self.wid, batch_id, exc)


def _live_ids(st: dict[str, Any]) -> set[str]:
    return {rid for b in st.get("live", []) for rid in b.get("request_ids", [])}


def _left_s(item: QueueItem) -> float:
    """Seconds to the request's deadline (120 s when it has none, as the adoption assumes)."""
    if not item.deadline_ms:
        return 120.0
    return max(0.0, (item.deadline_ms - time.time() * 1000) / 1000)
