"""The origin's two inboxes: its reply stream (prefill results from any owner) and its notify
channel (cancels from any replica). Both read on dedicated connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from app.state.keys import Keys
from app.state.resp import RespConnection, stream_entries
from app.state.text import to_str as s

log = logging.getLogger("flexlb.origin")


class ReplyRouter:
    """Routes each reply-stream entry to the future of the request waiting for it."""

    def __init__(self, redis_url: str, keys: Keys, replica_id: str) -> None:
        self.redis = aioredis.from_url(redis_url, socket_timeout=10.0)
        # The blocking reads go over the lean connection where the URL allows (app/state/resp.py):
        # every request's result comes this way.
        self._lean = RespConnection.from_url(redis_url, timeout_s=10.0)
        self.key = keys.replies(replica_id)
        self._waiting: dict[str, asyncio.Future[dict[str, str]]] = {}
        self._early: dict[str, dict[str, str]] = {}  # arrived before anyone waited (bounded)
        self._task: asyncio.Task[None] | None = None

    def expect(self, request_id: str) -> asyncio.Future[dict[str, str]]:
        fut: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        early = self._early.pop(request_id, None)
        if early is not None:
            fut.set_result(early)
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

    async def _run(self, last: str) -> None:
        while True:
            try:
                entries = await self._read(last)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reply stream read failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            for entry_id, f in entries:
                last = s(entry_id)
                fields = {s(k): s(v) for k, v in f.items()}
                rid = fields.get("rid", "")
                fut = self._waiting.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(fields)
                elif fut is None:
                    self._early[rid] = fields
                    while len(self._early) > 10_000:
                        self._early.pop(next(iter(self._early)))

    async def _read(self, last: str) -> list[tuple[Any, dict[Any, Any]]]:
        if self._lean is not None:
            reply = await self._lean.call("XREAD", "COUNT", 256, "BLOCK", 1000, "STREAMS", self.key, last)
            return stream_entries(reply)
        res = await self.redis.xread({self.key: last}, count=256, block=1000)
        return [(entry_id, f) for _stream, entries in res or [] for entry_id, f in entries]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):
            await self.redis.aclose()
        if self._lean is not None:
            with contextlib.suppress(Exception):
                await self._lean.close()


class NotifyListener:
    """Cancels addressed to this replica: `cancel:<request_id>`."""

    def __init__(self, redis_url: str, keys: Keys, replica_id: str, on_cancel: Callable[[str], Any]) -> None:
        self.redis = aioredis.from_url(redis_url)
        self.channel = keys.notify(replica_id)
        self.on_cancel = on_cancel
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self._task = asyncio.create_task(self._run(), name="notify")

    async def _run(self) -> None:
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("notify channel failed: %s", exc)
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    await self._pubsub.subscribe(self.channel)
                continue
            if msg and msg.get("type") == "message":
                data = s(msg["data"])
                if data.startswith("cancel:"):
                    self.on_cancel(data[len("cancel:") :])

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()
            await self.redis.aclose()
