"""The origin's two inboxes: its reply stream (prefill results from any owner) and its notify
channel (cancels from any replica). Both read on dedicated connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

from app.cluster.loops import LoopHealth
from app.state.connect import redis_client
from app.state.keys import Keys
from app.state.resp import RespConnection, stream_entries
from app.state.text import to_str as s

log = logging.getLogger("flexlb.origin")

_CLOSE_ERRORS = (RedisError, OSError)
# A reply nobody waits for is kept this long (a request waiting for it takes it at once) and at
# most this many: see `ReplyRouter._early`.
EARLY_TTL_S = 30.0
EARLY_MAX = 10_000


def _stream_id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


class ReplyRouter:
    """Routes each reply-stream entry to the future of the request waiting for it."""

    def __init__(
        self,
        redis_url: str,
        keys: Keys,
        replica_id: str,
        loops: LoopHealth | None = None,
        early_ttl_s: float = EARLY_TTL_S,
    ) -> None:
        self.loops = loops or LoopHealth()
        self.redis = redis_client(redis_url, socket_timeout=10.0)
        # The blocking reads go over the lean connection where the URL allows (app/state/resp.py):
        # every request's result comes this way.
        self._lean = RespConnection.from_url(redis_url, timeout_s=10.0)
        self.key = keys.replies(replica_id)
        self._waiting: dict[str, asyncio.Future[dict[str, str]]] = {}
        # Arrived with nobody waiting: (when, reply). A request expects its reply before its
        # hand-off, so these are nearly all replies to requests that ended first (client gone,
        # cancelled, failed): kept `early_ttl_s`, not until 10,000 had piled up (~1 KiB each;
        # ~8 per 1,000 requests with 3 % disconnects and 4 % cancels, bench/leak_probe.py).
        self._early: dict[str, tuple[float, dict[str, str]]] = {}
        self.early_ttl_s = early_ttl_s
        self._task: asyncio.Task[None] | None = None
        self._last = "0-0"  # the last entry id read (set by `start`)
        self._delivered = 0  # entries the last lean read delivered (`_on_read`)
        #: Commands this inbox issued (its XREADs and XTRIMs): part of each request's Redis cost,
        #: added to the store's count in `flexlb_redis_commands_total` and `GET /admin/stats`.
        self.commands_total = 0

    def expect(self, request_id: str) -> asyncio.Future[dict[str, str]]:
        fut: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        early = self._early.pop(request_id, None)
        if early is not None:
            fut.set_result(early[1])
        else:
            self._waiting[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._early.pop(request_id, None)

    async def start(self) -> None:
        # Start from the stream's current end: replies are only for requests made from now on.
        info = await self.redis.xinfo_stream(self.key) if await self.redis.exists(self.key) else None
        last = s(info["last-generated-id"]) if info else "0-0"
        self._task = asyncio.create_task(self._run(last), name="replies")
        self.loops.watch(self._task, "replies")

    async def _run(self, last: str) -> None:
        self._last = last
        trimmed_at = 0.0
        trim: str | None = None  # trim up to here, in front of the next read
        while True:
            try:
                n = await self._read(trim)
                self.loops.ok("replies")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the owners retry their replies meanwhile
                await self.loops.failed("replies", exc)
                continue
            trim = None
            if n and time.monotonic() - trimmed_at >= 1.0:
                # Entries read are delivered (or parked in `_early`) by now: trim them once a
                # second so the stream stays near empty instead of growing to its MAXLEN cap.
                # The XTRIM rides in front of the next read (one write, no round trip of its
                # own): before, the loop awaited it before delivering what it had read, so one
                # reply a second waited on it (the p99 of sequential requests), and a stop that
                # cancelled the loop inside redis-py's XTRIM was swallowed there and hung.
                trimmed_at = time.monotonic()
                trim = self._last

    def _take(self, entries: list[tuple[Any, dict[Any, Any]]]) -> int:
        """Deliver a read's entries and move the read position past them: called as the XREAD's
        reply is parsed off the lean connection (`RespConnection.pipeline`'s `on_replies`), so
        the waiting request resumes without a hop through this loop's task (issue 20). Advancing
        here, not in `_run`, and skipping what it passed, keeps the entries of a read whose caller
        timed out (delivered when its reply came, after the next read was sent from the old
        position) from being delivered twice."""
        n = 0
        for entry_id, f in entries:
            eid = s(entry_id)
            if _stream_id(eid) <= _stream_id(self._last):  # a late read's, delivered already
                continue
            self._last = eid
            self.deliver({s(k): s(v) for k, v in f.items()})
            n += 1
        return n

    def deliver(self, fields: dict[str, str]) -> None:
        """One reply to the request waiting for it (or parked until it waits): from the stream,
        or straight from this replica's own owner (`OwnerDispatcher._reply`, issue 20)."""
        rid = fields.get("rid", "")
        fut = self._waiting.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(fields)
        elif fut is None:
            early = self._early
            now = time.monotonic()
            early.pop(rid, None)  # re-inserted at the end: the dict stays in arrival order
            early[rid] = (now, fields)
            while len(early) > EARLY_MAX or next(iter(early.values()))[0] < now - self.early_ttl_s:
                del early[next(iter(early))]

    async def _read(self, trim: str | None = None) -> int:
        """One blocking XREAD from `_last`, after the trim up to ``trim`` when given; the number of
        entries it delivered."""
        read: list[Any] = ["XREAD", "COUNT", 256, "BLOCK", 1000, "STREAMS", self.key, self._last]
        if self._lean is not None:
            cmds = [["XTRIM", self.key, "MINID", "~", trim], read] if trim else [read]
            self.commands_total += len(cmds)
            *trimmed, reply = await self._lean.pipeline(cmds, self._on_read)
            if trimmed and isinstance(trimmed[0], ResponseError):  # the next trim catches up
                log.debug("reply stream trim failed: %s", trimmed[0])
            if isinstance(reply, ResponseError):
                raise reply
            return self._delivered
        if trim:
            self.commands_total += 1
            try:
                await self.redis.xtrim(self.key, minid=trim)
            except RedisError as exc:  # the next trim catches up
                log.debug("reply stream trim failed: %s", exc)
        self.commands_total += 1
        res = await self.redis.xread({self.key: self._last}, count=256, block=1000)
        return self._take([(entry_id, f) for _stream, entries in res or [] for entry_id, f in entries])

    def _on_read(self, replies: list[Any]) -> None:
        reply = replies[-1]
        self._delivered = 0 if isinstance(reply, ResponseError) else self._take(stream_entries(reply))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
        with contextlib.suppress(*_CLOSE_ERRORS):  # closing: nothing left to protect
            await self.redis.aclose()
        if self._lean is not None:
            with contextlib.suppress(*_CLOSE_ERRORS):
                await self._lean.close()


class NotifyListener:
    """Cancels addressed to this replica: `cancel:<request_id>`."""

    def __init__(
        self,
        redis_url: str,
        keys: Keys,
        replica_id: str,
        on_cancel: Callable[[str], Any],
        loops: LoopHealth | None = None,
    ) -> None:
        self.loops = loops or LoopHealth()
        self.redis = redis_client(redis_url)
        self.channel = keys.notify(replica_id)
        self.on_cancel = on_cancel
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self._task = asyncio.create_task(self._run(), name="notify")
        self.loops.watch(self._task, "notify")

    async def _run(self) -> None:
        resubscribe = False
        while True:
            try:
                if resubscribe:
                    await self._pubsub.subscribe(self.channel)
                    resubscribe = False
                msg = await self._pubsub.get_message(timeout=1.0)
                self.loops.ok("notify")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                resubscribe = True
                await self.loops.failed("notify", exc)
                continue
            if msg and msg.get("type") == "message":
                data = s(msg["data"])
                if data.startswith("cancel:"):
                    self.on_cancel(data[len("cancel:") :])

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
        with contextlib.suppress(*_CLOSE_ERRORS):
            await self._pubsub.aclose()
            await self.redis.aclose()
