"""The owner's ledger bookkeeping besides the commit itself: the audit that settles what no reply
will (settle-on-reply's backstop, DESIGN §7) and taking refused items' predicted ms off the worker's
queued ms.

A mixin of `OwnerDispatcher` (app/dispatch/owner.py), like `OwnerClaims`: it uses the dispatcher's
lease, store and in-flight batches, and keeps the dispatcher under ~500 lines. Also the ledger
re-anchors: moving a batch's anchor to where the engine really started it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from app import metrics as M
from app.dispatch.items import QueueItem
from app.scheduling.commit import committed_ms
from app.state.retry import TRANSIENT
from app.state.store import FencedOut

if TYPE_CHECKING:
    from app.cluster.leases import Lease
    from app.state.store import StateStore

log = logging.getLogger("flexlb.owner")


async def settle_old_epochs(store: StateStore, wid: str, epoch: str, old_epoch: str = "") -> int:
    """The old-epoch sweep (DESIGN §6: a new epoch settles everything held under the old ones):
    settle every batch in `wid`'s ledger committed under an epoch other than `epoch`, the one the
    worker runs now, and those committed with no epoch; returns how many. With no current epoch
    known (`epoch` empty) only `old_epoch`'s are settled, as the sweep did before it looked past
    the previous epoch. Batches of `epoch` itself run on the worker and are kept."""
    settled = 0
    for bid, entry in (await store.read_ledger(wid)).items():
        e = str(entry.get("epoch", ""))
        if e == "" or (e != epoch if epoch else e == old_epoch):
            await store.settle_batch(wid, bid)
            settled += 1
    return settled


class OwnerLedger:
    wid: str
    replica_id: str
    lease: Lease
    store: StateStore
    _finished_seen: dict[str, float]
    _last_audit: float
    _batch_sizes: dict[str, int]
    _marks: set[asyncio.Task[Any]]
    _stopping: bool

    async def audit_ledger(
        self, st: dict[str, Any], grace_ms: float = 2000.0, ttl_ms: float = 300_000.0
    ) -> dict[str, int]:
        """Backstop for settle-on-reply (DESIGN §7, lesson 3), run on the owner's status polls.

        A ledger batch that this owner is not dispatching, that the worker no longer holds (not
        queued, not running) and that was committed more than `grace_ms` ago will never be answered
        by a reply: it is settled here, counted by how we know — `record` (the worker reported it
        finished), `missed` (history rolled over, or the reply path died). A batch older than
        `ttl_ms` whatever its state is settled as `ttl`; that counter staying 0 is the proof the
        other paths are complete."""
        now = time.time() * 1000
        seen = self._finished_seen
        for r in st.get("finished", []):
            seen.setdefault(str(r.get("batch_id", "")), now)  # first sighting: insertion order = age
        # A batch first seen finished more than `ttl_ms` ago was committed even earlier, so the
        # audit settles it as `ttl` whatever this says: forget it (this dict otherwise filled up to
        # its 20,000 cap for half an hour of soak, growing the gateway's RSS all the while).
        while seen and (next(iter(seen.values())) < now - ttl_ms or len(seen) > 20_000):
            del seen[next(iter(seen))]
        if now - self._last_audit < 1000 or not self.lease.is_valid():
            return {}
        self._last_audit = now
        ledger = await self.store.read_ledger(self.wid)
        on_worker = {str(b.get("batch_id")) for b in st.get("live", [])}
        epoch = str(st.get("epoch", ""))
        counts: dict[str, int] = {}
        for bid, entry in ledger.items():
            age = now - float(entry.get("start_ms", now))
            if age > ttl_ms:
                path = "ttl"
            elif bid in self._batch_sizes or bid in on_worker or age < grace_ms:
                continue
            elif entry.get("epoch") and str(entry["epoch"]) != epoch:
                continue  # an older epoch's batch: settled by the epoch change (settle_epoch)
            else:
                path = "record" if bid in self._finished_seen else "missed"
            n = await self.store.settle_batch(self.wid, bid)
            if n:
                counts[path] = counts.get(path, 0) + n
                M.LEDGER_LATE_SETTLED.labels(path).inc(n)
                log.warning("owner %s: settled %d members of batch %s late (%s)", self.wid, n, bid, path)
        return counts

    async def _take_refused(self, items: list[QueueItem]) -> None:
        """Items the batcher refused leave the queue without a batch: their predicted ms come
        off the worker's queued_ms, or the worker looks busier forever (issue 14). Done by the
        fenced commit script with no members under a fresh id — it takes `take_ms` once, only for
        the lease holder, and writes no ledger entry. A failure here is repaired by the
        reconciler, which recomputes queued_ms from the queue."""
        take = committed_ms(i for i in items if not i.queued_taken)  # re-admitted: taken already
        if take <= 0:
            return
        try:
            await self.store.commit_batch(
                self.wid,
                f"r-{uuid.uuid4().hex[:16]}",
                [],
                0.0,
                time.time() * 1000,
                self.lease.fence,
                self.replica_id,
                take_ms=take,
            )
        except FencedOut:
            return
        except TRANSIENT as exc:
            log.warning("owner %s: taking %.1f refused ms off queued_ms failed: %s", self.wid, take, exc)

    def _spawn_reanchor(self, moves: list[tuple[str, float]]) -> None:
        if moves and not self._stopping:  # off the reply path, like the `dispatched` marks
            t = asyncio.create_task(self._reanchor(moves))
            self._marks.add(t)
            t.add_done_callback(self._marks.discard)

    async def _reanchor(self, moves: list[tuple[str, float]]) -> None:
        """Move ledger anchors to where the engine really started those batches (one script
        each, only when the start differs from the anchor by more than the timeline's tolerance).
        A failed write leaves the old anchor: owed time is then off by that batch until it
        settles, which the next poll's routing tolerates; it is logged and counted."""
        for bid, start_ms in moves:
            try:
                await self.store.anchor_batch(self.wid, bid, start_ms)
            except Exception as exc:  # Redis hiccup: the estimate stays as committed
                M.LEDGER_ANCHOR_FAILED.inc()
                log.warning("owner %s: re-anchoring batch %s failed: %s", self.wid, bid, exc)
