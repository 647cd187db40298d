"""Feeds a replica's CacheMirror from Redis: each worker's stored snapshot first, then its diff
stream, with a blocking XREAD on a dedicated connection (a blocking read must never hold up the
request path's connection pool)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from app.cache.mirror import CacheMirror
from app.cluster.poller import unpack_keys
from app.state.keys import Keys
from app.state.text import to_str as _s

log = logging.getLogger("flexlb.cache")


class MirrorFollower:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        mirror: CacheMirror,
        workers: Callable[[], list[str]],
        block_ms: int = 500,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.mirror = mirror
        self.workers = workers
        self.block_ms = block_ms
        self._cursor: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self.applied = 0

    async def load(self, wid: str) -> None:
        snap = await self.redis.hgetall(self.keys.cache_snapshot(wid))
        if snap:
            self.mirror.load_snapshot(
                wid, _s(snap[b"epoch"]), int(snap[b"version"]), unpack_keys(snap[b"keys"])
            )
        self._cursor[wid] = "0-0"  # replay the (bounded) stream: older diffs are refused by version

    async def step(self) -> int:
        """One bounded read of every worker's diff stream; returns diffs applied."""
        for wid in self.workers():
            if wid not in self._cursor:
                await self.load(wid)
        for wid in [w for w in self._cursor if w not in set(self.workers())]:
            del self._cursor[wid]
            self.mirror.drop_worker(wid)
        if not self._cursor:
            await asyncio.sleep(self.block_ms / 1000)
            return 0
        streams = {self.keys.cache_stream(w): c for w, c in self._cursor.items()}
        res = await self.redis.xread(streams, count=500, block=self.block_ms)
        n = 0
        for stream, entries in res or []:
            wid = _stream_worker(_s(stream), self.keys)
            if wid is None or wid not in self._cursor:
                continue
            for entry_id, f in entries:
                self._cursor[wid] = _s(entry_id)
                ok = self.mirror.apply_diff(
                    wid,
                    _s(f[b"epoch"]),
                    int(f[b"version"]),
                    unpack_keys(f.get(b"add")),
                    unpack_keys(f.get(b"rem")),
                    full=f.get(b"full") == b"1",
                )
                n += int(ok)
        self.applied += n
        return n

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cache-follower")

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis hiccup: retry after a pause, keep the mirror
                log.warning("cache follower: %s", exc)
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def _stream_worker(stream: str, keys: Keys) -> str | None:
    head = f"{keys.prefix}:{{w:"
    if stream.startswith(head) and stream.endswith("}:cache"):
        return stream[len(head) : -len("}:cache")]
    return None
