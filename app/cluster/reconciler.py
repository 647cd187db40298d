"""The master's reconciler (issue 14, DESIGN §13): on a period, find state that nothing will ever
clean up and repair it, counting every correction (`flexlb_reconciled_total{kind}`). In a healthy
cluster every counter stays 0 — each path that should have cleaned up did; a counter that moves
names the path that did not.

What it repairs, and why each repair is safe while requests run:

- `hold_released`: a decode reservation whose request record is missing, terminal, or owned by a
  replica that is not live. A record is created before (or in the same pipeline as) its hold, and
  the origin releases the hold in the same round trip as the terminal transition, so a hold next to
  a terminal or missing record can never be released later by anyone else.
- `record_owner_lost`: a non-terminal record whose origin is not live (its clients' connections died
  with it). The same step releases its hold and tombstones its prefill so a queued one never runs.
- `engine_cancelled`: the same request's prefill and decode still running on the engines (nobody
  will read their output) are cancelled there through the worker control `cancel`, so they stop
  taking batch slots and KV — once the origin has stayed dead `cancel_after_s` (and the record is
  still `owner_lost`): a replica that was only stalled past its membership TTL and wakes within
  that time still completes what its clients are waiting for. A failed cancel is logged: the
  engine still ends the work at its max_new_tokens or deadline.
  A stalled origin that wakes and completes the request overwrites `owner_lost` with `completed`
  (app/state/scripts.py TRANSITION), so a client's answer is never recorded as lost.
- `queued_tombstoned`: queued prefill work of a dead origin (the owner's commit drops it).
- `queued_ms_corrected`: a worker's queued time above the sum of the predictions of the entries
  still in its queue. Every ms added comes with an entry in one script and is taken off before that
  entry is deleted, so the sum is an upper bound at every instant — clamping to it never removes
  time a live entry still owes. (It also brings an idle queue back to exactly 0.)
- `reply_stream_deleted`, `origin_set_deleted`, `consumer_deleted`: a dead replica's reply stream,
  live set and queue-group consumers (a consumer is deleted only once it has no pending entries;
  the next owner claims them first).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from app import metrics as M
from app.cluster.membership import LuaScript
from app.rpc.worker_client import WorkerUnavailable
from app.state.handoff import GROUP
from app.state.keys import Keys
from app.state.store import TERMINAL, StateStore

log = logging.getLogger("flexlb.reconciler")

# KEYS[1] queue stream, KEYS[2] queued_ms → the correction made, as text ('0' when none).
# Atomic, so no hand-off or commit can slip between the read of the entries and the write.
# `pred` in an entry's meta is rounded to 3 decimals; the hand-off added the 6-decimal value, so
# the bound allows 0.001 ms per entry.
_CLAMP_QUEUED = LuaScript(
    """
local q = tonumber(redis.call('GET', KEYS[2]) or '0')
if q <= 0 then return '0' end
local sum, n = 0, 0
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
  local f = e[2]
  for i = 1, #f, 2 do
    if f[i] == 'm' then
      local ok, m = pcall(cjson.decode, f[i + 1])
      if ok and m['pred'] then sum = sum + tonumber(m['pred']) end
    end
  end
  n = n + 1
end
if q > sum + 0.001 * n + 0.01 then
  redis.call('SET', KEYS[2], string.format('%.6f', sum))
  return string.format('%.6f', q - sum)
end
if n == 0 then redis.call('SET', KEYS[2], '0.000000') end  -- float dust on an empty queue
return '0'
"""
)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes | bytearray) else str(x)


class Reconciler:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        store: StateStore,
        live_members: Callable[[], Awaitable[list[str]]],
        workers: Callable[[], dict[str, dict[str, str]]],
        *,
        forget_after_s: float = 60.0,
        cancel_on: Callable[[str, str], Awaitable[Any]] | None = None,
        cancel_after_s: float = 10.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.store = store
        self.live_members = live_members
        self.workers = workers
        self.totals: dict[str, int] = {}
        # A dead replica stays in `replicas_seen` this long (master-local clock): an owner may still
        # answer one of its dispatched requests, re-creating its reply stream, which we delete again.
        self.forget_after_s = forget_after_s
        self._dead_since: dict[str, float] = {}
        # (worker id, request id) → the worker's control `cancel`; None: nothing is cancelled on
        # the engines (the simulator, unit tests without workers).
        self.cancel_on = cancel_on
        self.cancel_after_s = cancel_after_s
        # dead origin → (worker id, request id) of its requests we ended `owner_lost` whose engine
        # work is cancelled once the origin has been dead `cancel_after_s` (dropped if it returns).
        self._engine_work: dict[str, list[tuple[str, str]]] = {}

    def _count(self, counts: dict[str, int], kind: str, n: int = 1) -> None:
        if n:
            counts[kind] = counts.get(kind, 0) + n
            self.totals[kind] = self.totals.get(kind, 0) + n
            M.RECONCILED.labels(kind).inc(n)

    async def run_once(self) -> dict[str, int]:
        """One full pass; returns the corrections made, by kind (empty when all was well)."""
        counts: dict[str, int] = {}
        live = set(await self.live_members())
        if not live:
            return counts  # we are the master, so at least we are live: Redis answered oddly
        ws = self.workers()
        prefill = sorted(w for w, i in ws.items() if i.get("role") == "prefill")
        decode = sorted(w for w, i in ws.items() if i.get("role") == "decode")
        seen = {_s(x) for x in await self.redis.smembers(self.keys.replicas_seen)}
        queued_of_dead: set[str] = set()
        for wid in prefill:
            queued_of_dead |= await self._queue(wid, live, counts)
        now = time.monotonic()
        for dead in sorted(seen - live):
            since = self._dead_since.setdefault(dead, now)
            final = now - since >= self.forget_after_s and dead not in queued_of_dead
            await self.end_origin(dead, counts, prefill, final=final)
        for rid in [r for r in self._dead_since if r not in seen or r in live]:
            del self._dead_since[rid]
        await self._cancel_dead_engine_work(live, now, counts)
        for wid in decode:
            await self._holds(wid, live, counts)
        if counts:
            log.warning("reconciler corrected %s", json.dumps(counts), extra={"event": "reconciled"})
        return counts

    async def end_origin(
        self, dead: str, counts: dict[str, int], prefill: list[str], *, final: bool = False
    ) -> int:
        """DESIGN §6 "Dead origin": every live request of `dead` ends `owner_lost`, its hold is
        released and its queued prefill tombstoned; then its reply stream, live set and consumers
        go. Idempotent: a second pass finds nothing left."""
        ended = 0
        key = self.keys.origin_requests(dead)
        for rid in sorted(_s(x) for x in await self.redis.smembers(key)):
            rec = await self.store.get_request(rid)
            if rec is not None and rec.get("state") not in TERMINAL:
                await self._release(rec, rid, counts)
                if rec.get("prefill_worker"):
                    await self.store.tombstone(rec["prefill_worker"], rid, 600_000)
                outcome = {
                    "error": {
                        "message": f"origin replica {dead} died before the request finished",
                        "type": "service_unavailable",
                        "code": "owner_lost",
                        "retryable": True,
                    }
                }
                if await self.store.transition(rid, "owner_lost", outcome=outcome):
                    ended += 1
                    self._count(counts, "record_owner_lost")
                    work = [(str(rec[f]), rid) for f in ("prefill_worker", "decode_worker") if rec.get(f)]
                    if self.cancel_on is not None and work:
                        self._engine_work.setdefault(dead, []).extend(work)
                        self._dead_since.setdefault(dead, time.monotonic())
            await self.redis.srem(key, rid)
        if not final:
            # A replica that was only stalled (SIGSTOP, a long pause) comes back to its reply
            # stream and queue-group consumer: they go only after `forget_after_s` of silence.
            return ended
        consumers_left = 0
        for wid in prefill:
            consumers_left += await self._drop_consumer(wid, dead, counts)
        if consumers_left:
            return ended  # its pending entries are not claimed yet: come back next period
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.replies(dead))
        pipe.delete(key)
        pipe.srem(self.keys.replicas_seen, dead)
        pipe.delete(self.keys.cancels(dead))
        res = await pipe.execute()
        self._count(counts, "reply_stream_deleted", int(res[0]))
        self._count(counts, "origin_set_deleted", int(res[1]))
        return ended

    async def sweep_own(
        self, me: str, running: Callable[[str], bool], cancel: Callable[[str], Any] | None = None
    ) -> dict[str, int]:
        """Each replica's own sweep (not the master's: only the origin knows which of its requests
        still run). A request in this replica's live set that no task here runs any more, with no
        terminal write waiting in the retry queue, was left behind by a failure between its record
        and its clean-up (a round trip that applied in Redis but whose answer was lost): end it
        `failed` (state_unavailable), release its hold, tombstone its prefill. Records of another
        origin (a refused duplicate id) are only removed from our set."""
        counts: dict[str, int] = {}
        key = self.keys.origin_requests(me)
        if cancel is not None:  # cancels recorded by other replicas (their notify may be lost)
            for rid in sorted(_s(x) for x in await self.redis.smembers(self.keys.cancels(me))):
                cancel(rid)
                await self.redis.srem(self.keys.cancels(me), rid)
        for rid in sorted(_s(x) for x in await self.redis.smembers(key)):
            if running(rid):
                continue
            rec = await self.store.get_request(rid)
            if running(rid):  # started meanwhile (a retry of the id on this replica)
                continue
            if rec is not None and rec.get("origin") == me and rec.get("state") not in TERMINAL:
                await self._release(rec, rid, counts)
                if rec.get("prefill_worker"):
                    await self.store.tombstone(rec["prefill_worker"], rid, 600_000)
                outcome = {
                    "error": {
                        "message": "the request's state was left behind by a Redis failure",
                        "type": "service_unavailable",
                        "code": "state_unavailable",
                        "retryable": True,
                    }
                }
                if await self.store.transition(rid, "failed", outcome=outcome):
                    self._count(counts, "record_failed")
            await self.redis.srem(key, rid)
        if counts:
            log.warning("own sweep corrected %s", json.dumps(counts), extra={"event": "reconciled"})
        return counts

    async def _cancel_dead_engine_work(self, live: set[str], now: float, counts: dict[str, int]) -> None:
        """Cancel, on the engines, the work of requests ended `owner_lost` whose origin has stayed
        dead `cancel_after_s`; a record a woken origin completed meanwhile keeps its work."""
        for origin in list(self._engine_work):
            if origin in live:  # it came back: its requests may still complete
                del self._engine_work[origin]
                continue
            since = self._dead_since.get(origin)  # None: forgotten, so dead for forget_after_s
            if since is not None and now - since < self.cancel_after_s:
                continue
            work = self._engine_work.pop(origin)
            for wid, rid in work:
                state = await self.redis.hget(self.keys.request(rid), "state")
                if state is None or _s(state) != "owner_lost" or self.cancel_on is None:
                    continue
                try:
                    res = await self.cancel_on(wid, rid)
                except (WorkerUnavailable, TimeoutError) as exc:
                    log.warning("cancel of dead origin's %s on %s failed: %s", rid, wid, exc)
                    continue
                if isinstance(res, dict) and res.get("result") in ("cancelled", "released"):
                    self._count(counts, "engine_cancelled")

    async def _release(self, rec: dict[str, Any], rid: str, counts: dict[str, int]) -> None:
        dec = rec.get("decode_worker")
        if dec and await self.store.release(dec, rid):
            self._count(counts, "hold_released")

    async def _drop_consumer(self, wid: str, dead: str, counts: dict[str, int]) -> int:
        """Delete `dead`'s consumer from the worker's queue group once it holds nothing pending;
        returns its pending count (0 when gone or deleted)."""
        try:
            infos = await self.redis.xinfo_consumers(self.keys.queue(wid), GROUP)
        except aioredis.ResponseError:  # no stream or no group yet: nothing to delete
            return 0
        for c in infos:
            if _s(c.get("name", "")) != dead:
                continue
            pending = int(c.get("pending", 0))
            if pending:
                return pending
            if await self.redis.xgroup_delconsumer(self.keys.queue(wid), GROUP, dead) == 0:
                self._count(counts, "consumer_deleted")
                return 0
        return 0

    async def _holds(self, wid: str, live: set[str], counts: dict[str, int]) -> None:
        rids = [
            r for r in (_s(x) for x in await self.redis.hkeys(self.keys.reservations(wid))) if r != "_total"
        ]
        if not rids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.hmget(self.keys.request(rid), "state", "origin")
        rows = await pipe.execute()
        for rid, (state, origin) in zip(rids, rows, strict=True):
            st, org = (_s(state) if state else None), (_s(origin) if origin else None)
            leaked = st is None or st in TERMINAL or (org is not None and org not in live)
            if leaked and await self.store.release(wid, rid):
                self._count(counts, "hold_released")
                log.warning("released leaked hold of %s on %s (record %s)", rid, wid, st or "missing")

    async def _queue(self, wid: str, live: set[str], counts: dict[str, int]) -> set[str]:
        """Tombstone dead origins' queued work, clamp queued_ms; returns the dead origins that
        still have entries in this queue."""
        queue = self.keys.queue(wid)
        dead: set[str] = set()
        for _eid, f in await self.redis.xrange(queue, "-", "+"):
            raw = f.get(b"m") or f.get("m")
            if raw is None:
                continue
            meta = json.loads(_s(raw))
            if str(meta.get("origin")) not in live:
                dead.add(str(meta.get("origin")))
                rid = str(meta.get("rid"))
                tomb = await self.redis.zscore(self.keys.tombstones(wid), rid)
                if tomb is None:
                    await self.store.tombstone(wid, rid, 600_000)
                    self._count(counts, "queued_tombstoned")
        fixed = float(_s(await _CLAMP_QUEUED(self.redis, [queue, self.keys.queued_ms(wid)])))
        if fixed > 0:
            self._count(counts, "queued_ms_corrected")
            log.warning("queued_ms of %s was %.3f ms above its queue: corrected", wid, fixed)
        return dead
