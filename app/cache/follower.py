"""Feeds a replica's CacheMirror from Redis: each worker's stored snapshot first, then its diff
stream, with a blocking XREAD on a dedicated connection (a blocking read must never hold up the
request path's connection pool). The same XREAD reads each worker's speculative stream, the
hand-offs its owner read (`FLEXLB_SHARED_SPECULATIVE`, app/cache/shared_spec.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from app import metrics as M
from app.cache.mirror import CacheMirror
from app.cache.shared_spec import parse_record
from app.cluster.loops import LoopHealth
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
        loops: LoopHealth | None = None,
        *,
        replica_id: str = "",
        share_speculative: bool = True,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.mirror = mirror
        self.workers = workers
        self.block_ms = block_ms
        self._cursor: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self.applied = 0
        self.loops = loops or LoopHealth()
        self.gaps = 0  # diffs whose prev_version did not match the mirror (a lost diff): resynced
        self._gap: set[str] = set()  # workers waiting for a full snapshot after a gap
        # Speculative streams: records of our own hand-offs are skipped (the origin has them).
        self.replica_id = replica_id
        self.share_speculative = share_speculative
        self._spec_cursor: dict[str, str] = {}
        self.spec_applied = 0

    async def load(self, wid: str) -> None:
        snap = await self.redis.hgetall(self.keys.cache_snapshot(wid))
        if snap and b"keys" in snap:  # (only `last_*` fields before the first full snapshot)
            self.mirror.load_snapshot(
                wid, _s(snap[b"epoch"]), int(snap[b"version"]), unpack_keys(snap[b"keys"])
            )
        self._cursor[wid] = "0-0"  # replay the (bounded) stream: older diffs are refused by version
        if self.share_speculative:  # replayed too: records older than the TTL are dropped
            self._spec_cursor[wid] = "0-0"

    async def step(self) -> int:
        """One bounded read of every worker's diff stream; returns diffs applied."""
        for wid in self.workers():
            if wid not in self._cursor:
                await self.load(wid)
        for wid in [w for w in self._cursor if w not in set(self.workers())]:
            del self._cursor[wid]
            self._spec_cursor.pop(wid, None)
            self.mirror.drop_worker(wid)
        if not self._cursor:
            await asyncio.sleep(self.block_ms / 1000)
            return 0
        streams = {self.keys.cache_stream(w): c for w, c in self._cursor.items()}
        streams.update({self.keys.spec_stream(w): c for w, c in self._spec_cursor.items()})
        res = await self.redis.xread(streams, count=500, block=self.block_ms)
        n = 0
        for stream, entries in res or []:
            spec = _stream_worker(_s(stream), self.keys, "spec")
            if spec is not None:
                if spec in self._spec_cursor:
                    self._apply_spec(spec, entries, time.time() * 1000)
                continue
            wid = _stream_worker(_s(stream), self.keys, "cache")
            if wid is None or wid not in self._cursor:
                continue
            for entry_id, f in entries:
                self._cursor[wid] = _s(entry_id)
                full = f.get(b"full") == b"1"
                if full:
                    self._gap.discard(wid)
                elif not await self._in_sequence(wid, _s(f[b"epoch"]), int(f[b"version"]), f.get(b"prev")):
                    continue
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

    def _apply_spec(self, wid: str, entries: list[tuple[bytes, dict[bytes, bytes]]], now_ms: float) -> None:
        """Another replica's hand-offs to ``wid``, as its owner read them: speculative entries under
        the normal TTL, counted from that read (never later than now, whatever the clocks say)."""
        ttl = self.mirror.speculative_ttl_ms
        for entry_id, f in entries:
            self._spec_cursor[wid] = _s(entry_id)
            rec = parse_record(f)
            if rec is None or rec.origin == self.replica_id or now_ms - rec.at_ms >= ttl:
                M.SHARED_SPECULATIVE.labels("skipped").inc()
                continue
            self.mirror.add_speculative(wid, rec.keys.tolist(), min(rec.at_ms, now_ms))
            self.spec_applied += 1
            M.SHARED_SPECULATIVE.labels("applied").inc()

    async def _in_sequence(self, wid: str, epoch: str, version: int, prev: bytes | None) -> bool:
        """A diff says which version it follows (`prev`). When the mirror is not at that version a
        diff was lost (stream trimmed, a publish that half-failed): resync that worker — from its
        stored snapshot when that is recent enough, else by skipping its diffs until the owner's
        next full snapshot (every ~50 polls). Diffs without `prev` (older owners) are applied."""
        if wid in self._gap:
            return False
        if prev is None:
            return True
        m_epoch, m_version = self.mirror.version(wid)
        if m_epoch != epoch or m_version >= version or m_version >= int(prev):
            return True  # another epoch, an old diff (the mirror refuses it) or in sequence
        self.gaps += 1
        log.warning(
            "cache diff gap on %s: mirror at v%d, diff follows v%s; resyncing", wid, m_version, _s(prev)
        )
        snap = await self.redis.hgetall(self.keys.cache_snapshot(wid))
        if snap and b"keys" in snap and _s(snap[b"epoch"]) == epoch and int(snap[b"version"]) >= int(prev):
            self.mirror.load_snapshot(wid, epoch, int(snap[b"version"]), unpack_keys(snap[b"keys"]))
            return True
        self._gap.add(wid)
        return False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cache-follower")
        self.loops.watch(self._task, "cache_follower")

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
                self.loops.ok("cache_follower")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis hiccup: back off and retry, keep the mirror
                await self.loops.failed("cache_follower", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})


def _stream_worker(stream: str, keys: Keys, what: str) -> str | None:
    head, tail = f"{keys.prefix}:{{w:", f"}}:{what}"
    if stream.startswith(head) and stream.endswith(tail):
        return stream[len(head) : -len(tail)]
    return None
