"""The prefill hand-off in Redis: each worker's queue stream (origins append, the owner consumes
through the `owner` consumer group) and each replica's reply stream (owners append results, the
origin reads them). Token ids cross Redis once, packed as little-endian int32, never as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from app.state.keys import Keys
from app.state.store import StateStore
from app.state.text import to_str

GROUP = "owner"
#: The hand-off scripts' entry id when the worker's live backlog exceeded the request's allowance.
OVER_BACKLOG = "-2"
REPLY_MAXLEN = 10_000


def pack_tokens(ids: Any) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_tokens(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i4")


def pack_keys(space: int, keys: Any) -> bytes:
    """The routing block keys for the hand-off entry's `k` field: the key space's namespace seed
    (`app.protocol.blocks.namespace_seed`) then every key, little-endian uint64 (8 bytes a block:
    1/64 of the ids' bytes at block size 64). The owner hands them to the worker instead of
    hashing the prompt again (issue 20)."""
    return np.asarray([space, *keys], dtype="<u8").tobytes()


def unpack_keys(raw: bytes) -> tuple[int, np.ndarray] | None:
    """(namespace seed, keys) of a `k` field; None when absent or malformed (hash instead)."""
    if len(raw) < 8 or len(raw) % 8:
        return None
    arr = np.frombuffer(raw, dtype="<u8")
    return int(arr[0]), arr[1:]


class Handoff:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.redis: aioredis.Redis = store.redis
        self.keys: Keys = store.keys

    async def append(
        self,
        wid: str,
        meta: Mapping[str, Any],
        ids: bytes,
        predicted_ms: float,
        max_len: int,
        time_scale: float = 1.0,
        keys: bytes = b"",
        max_backlog: float | None = None,
    ) -> tuple[str | None, float, float]:
        """Hand a request to the worker's owner; (entry id or None when the queue is full, the
        worker's queued predicted ms after this call, its ledger's owed ms now). `meta` travels
        as one JSON field, the token ids as one binary field, and `keys` (`pack_keys`, when
        given) as a third. With `max_backlog` (`Verdict.max_backlog_ms`): `OVER_BACKLOG` and the live
        (queued, owed) ms, nothing written, when the worker's backlog exceeds it (scripts.HANDOFF)."""
        argv: list[Any] = [
            max_len,
            f"{predicted_ms:.6f}",
            json.dumps(meta, separators=(",", ":")),
            ids,
            f"{time_scale:g}",
            keys,
        ]
        if max_backlog is not None:
            argv += ["", "", "", repr(float(max_backlog))]
        res = await self.store.run_script(
            "handoff", [self.keys.queue(wid), self.keys.queued_ms(wid), self.keys.ledger(wid)], argv
        )
        entry = to_str(res[0])
        return (None if entry == "-1" else entry), float(to_str(res[1])), float(to_str(res[2]))

    async def ensure_group(self, wid: str) -> None:
        """The owners' consumer group; created from the stream's start so nothing queued before
        an owner existed is skipped."""
        self.store.commands_total += 1
        try:
            await self.redis.xgroup_create(self.keys.queue(wid), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def settle_ack(self, wid: str, batch_id: str, request_id: str, entry_id: str) -> bool:
        res = await self.store.run_script(
            "settle_ack",
            [self.keys.ledger(wid), self.keys.tombstones(wid), self.keys.queue(wid)],
            [batch_id, request_id, self.store.settled_batch_ttl_ms, GROUP, entry_id],
        )
        return int(res) == 1

    async def reply_and_settle(
        self, origin: str, fields: Mapping[str, Any], wid: str, batch_id: str, request_id: str, entry_id: str
    ) -> bool:
        """The result on the origin's reply stream, then `settle_ack`, in one round trip (in this
        order: a reply never waits on the settlement). Only the settlement is retried after
        NOSCRIPT: the reply must not repeat."""
        flat: list[Any] = []
        for k, v in fields.items():
            flat += [k, v]
        settle = [
            "EVALSHA",
            self.store.sha("settle_ack"),
            3,
            self.keys.ledger(wid),
            self.keys.tombstones(wid),
            self.keys.queue(wid),
            batch_id,
            request_id,
            self.store.settled_batch_ttl_ms,
            GROUP,
            entry_id,
        ]
        xadd = ["XADD", self.keys.replies(origin), "MAXLEN", "~", REPLY_MAXLEN, "*", *flat]
        sent, settled = await self.store.execute_scripts([xadd, settle])
        for r in (sent, settled):
            if isinstance(r, ResponseError):
                raise r
        return int(settled) == 1
