"""How hand-off entries reach the owner's batcher: the owner's blocked `XREADGROUP` on the worker's
queue stream, and — when the origin of a request is this same replica — the origin's hand-off
round trip itself, which delivers the new entries to the owner's consumer and hands them over in
process (issue 20; `scripts._OWN_READ` says why failure semantics stay the same).

Order: the two ways run on two connections, so entries can join the batcher a few places out of
stream order (concurrent requests of different origins); the batcher orders what waits by class,
then by its arrival at the owner or its deadline, and nothing relies on stream order.
Loss: an answer lost on the way back (the hand-off's round trip failed after Redis ran it) leaves
its entries pending for our consumer, as a lost blocked read does; the periodic re-claim takes
them up after `reclaim_idle_ms`.

A mixin of `OwnerDispatcher` (app/dispatch/owner.py), like `OwnerClaims`: it uses the dispatcher's
lease, readers and batcher, and keeps the dispatcher under ~500 lines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from app import metrics as M
from app.dispatch.items import QueueItem, parse_item
from app.state.handoff import GROUP
from app.state.resp import stream_entries
from app.state.text import to_str as _text

log = logging.getLogger("flexlb.owner")

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from app.cache.shared_spec import SpecOutbox
    from app.cluster.leases import Lease
    from app.cluster.loops import LoopHealth
    from app.state.handoff import Handoff
    from app.state.resp import RespConnection
    from app.state.store import StateStore


class OwnerIntake:
    wid: str
    replica_id: str
    lease: Lease
    store: StateStore
    handoff: Handoff
    loops: LoopHealth
    _reader: aioredis.Redis
    _lean_reader: RespConnection | None
    _handling: set[str]
    spec_out: SpecOutbox
    _claimed_once: asyncio.Event
    _stopping: bool
    _draining: bool
    local_taken: int
    # The pending publish of in-process entries' speculative records (one at a time).
    _spec_flush: asyncio.Task[None] | None = None

    def admit(self, item: QueueItem, now_ms: float) -> None: ...

    def local_lease(self) -> str | None:
        """The lease value under which the origin in this process may take new entries for us in
        its hand-off's round trip, or None when it must leave them to the read loop: before our
        first claim (XAUTOCLAIM would take our own fresh entries as the previous owner's), while
        draining or stopping (we read no more), and while the lease is in doubt. The script checks
        the value against Redis' own, so a lease lost meanwhile takes nothing."""
        if self._stopping or self._draining or not self._claimed_once.is_set() or not self.lease.is_valid():
            return None
        return self.lease.value

    def take_local(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        """Entries the origin's hand-off delivered to our consumer (in stream order): they join
        the batcher exactly as the read loop's would. Already in our pending list, so whatever
        happens to them from here (we stop, the lease moves) is what happens to a read entry."""
        if self._stopping:  # they stay pending: the next owner's claim takes them
            return
        # Never one already ours: a claim cannot have taken these (our first claim ended before
        # `local_lease` said yes, and later ones take only long-idle entries), but a double admit
        # would run a request twice, so it is checked, not assumed.
        fresh = [(e, f) for e, f in entries if _text(e) not in self._handling]
        self._admit_entries(fresh)
        self.local_taken += len(fresh)
        M.HANDOFF_IN_PROCESS.labels("entry").inc(len(fresh))
        if self.spec_out and self._spec_flush is None:
            self._spec_flush = asyncio.create_task(self._flush_spec(), name=f"spec_flush:{self.wid}")

    async def _flush_spec(self) -> None:
        """Publish the speculative records of entries handed over in process. They skip the read
        loop, whose next read (up to its 100 ms block away) would carry them, while the other
        replicas route on them now: one pipelined write at once, on the store's pool. A hint with
        a TTL: a failure is counted and logged, not retried."""
        try:
            await asyncio.sleep(0)  # the same tick's hand-offs join this write
            cmds = self.spec_out.take(self.store.keys.spec_stream(self.wid), time.time() * 1000)
            if not cmds:
                return
            self.store.commands_total += len(cmds)
            async with self.store.redis.pipeline(transaction=False) as pipe:
                for c in cmds:
                    pipe.execute_command(*c)
                replies = await pipe.execute(raise_on_error=False)
            M.count_shared_spec(replies)
        except Exception as exc:  # Redis hiccup: the records are lost hints, counted
            M.count_shared_spec([exc])
            log.warning("speculative records of %s not published: %s", self.wid, exc)
        finally:
            self._spec_flush = None

    def _admit_entries(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        now = time.time() * 1000
        for entry_id, fields in entries:
            item = parse_item(entry_id, fields)
            self._handling.add(item.entry_id)
            self.admit(item, now)
            self.spec_out.note(item.origin, item.keys)

    async def _read_entries(self, key: str) -> list[tuple[Any, dict[bytes, bytes]]]:
        """New entries of the worker's queue for this consumer (blocks up to 100 ms). The shared
        speculative records noted since the last read ride in front of it: one write, no round
        trip of their own (app/cache/shared_spec.py); a failed one is counted and dropped (a hint)."""
        read = ["XREADGROUP", "GROUP", GROUP, self.replica_id, "COUNT", 256, "BLOCK", 100, "STREAMS", key]
        cmds = [*self.spec_out.take(self.store.keys.spec_stream(self.wid), time.time() * 1000), [*read, ">"]]
        self.store.commands_total += len(cmds)
        if self._lean_reader is None:  # redis-py (TLS, URL options): the same pipeline, parsed replies
            pipe = self._reader.pipeline(transaction=False)
            for c in cmds:
                pipe.execute_command(*c)
            *added, res = await pipe.execute(raise_on_error=False)
        else:
            *added, res = await self._lean_reader.pipeline(cmds)
        M.count_shared_spec(added)
        if isinstance(res, Exception):
            raise res
        if self._lean_reader is None:
            return [(entry_id, fields) for _stream, entries in res or [] for entry_id, fields in entries]
        return stream_entries(res)

    async def _read_loop(self) -> None:
        name = f"owner_read:{self.wid}"
        key = self.store.keys.queue(self.wid)
        need_group = True
        await self._claimed_once.wait()
        while not self._stopping and not self._draining:
            if not self.lease.is_valid():  # not acting while the lease is in doubt; on_lose stops us
                await asyncio.sleep(0.1)
                continue
            try:
                if need_group:  # first read, or the group vanished (Redis came back empty)
                    await self.handoff.ensure_group(self.wid)
                    need_group = False
                entries = await self._read_entries(key)
                self.loops.ok(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis hiccup, NOGROUP after a rebuild: count, back off, retry
                need_group = True
                await self.loops.failed(name, exc)
                continue
            self._admit_entries(entries)
