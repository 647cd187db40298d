"""The worker registry in Redis: who the workers are (`role@host:port`), seeded from `--workers`
idempotently, changed by the admin API, announced on the events channel so every replica
refreshes its local copy at once instead of polling."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from app.state.keys import Keys
from app.state.text import to_str as _s

ROLES = ("prefill", "decode")


class BadWorkerSpec(ValueError):
    """A worker spec that is not `role@host:port`."""


@dataclass(frozen=True)
class WorkerSpec:
    role: str
    host: str
    port: int

    @property
    def id(self) -> str:
        return f"{self.role}@{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_worker(spec: str) -> WorkerSpec:
    spec = spec.strip()
    role, sep, addr = spec.partition("@")
    host, sep2, port_s = addr.rpartition(":")
    if not sep or not sep2 or role not in ROLES or not host or not port_s.isdigit():
        raise BadWorkerSpec(f"bad worker spec {spec!r}: expected role@host:port with role prefill|decode")
    port = int(port_s)
    if not 0 < port < 65536:
        raise BadWorkerSpec(f"bad port in {spec!r}")
    return WorkerSpec(role, host, port)


def parse_workers(specs: str) -> list[WorkerSpec]:
    return [parse_worker(s) for s in specs.split(",") if s.strip()]


class Registry:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def add(self, specs: list[WorkerSpec]) -> list[str]:
        """Idempotent: re-adding a known worker changes nothing but un-drains it."""
        if not specs:
            return []
        now = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=True) as p:
            for s in specs:
                p.sadd(self.keys.workers, s.id)
                p.hsetnx(self.keys.worker_info(s.id), "added_ms", now)
                p.hset(
                    self.keys.worker_info(s.id),
                    mapping={"role": s.role, "address": s.address, "state": "active"},
                )
                p.persist(self.keys.tombstones(s.id))  # back: its tombstones live by their scores again
            await p.execute()
        return [s.id for s in specs]

    async def remove(self, worker_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as p:
            p.srem(self.keys.workers, worker_id)
            p.hset(self.keys.worker_info(worker_id), "state", "removed")
            res = await p.execute()
        if res[0]:
            await self.forget_views(worker_id)
        return bool(res[0])

    def view_keys(self, worker_id: str) -> list[str]:
        """What the worker's owner publishes about it (snapshot, cache diffs and snapshot,
        speculative entries, queued ms): read only while the worker is registered. Left after a
        removal, they stayed for good (no TTL, no writer to trim them), and so did its tombstones
        (purged only by the next commit to it): ~0.8 MB per removed prefill worker at the soak's
        rates, so a cluster whose workers come and go under new addresses grew by that much per
        departure (docs/state.md)."""
        k = self.keys
        snapshots = [k.snapshot(worker_id), k.cache_stream(worker_id), k.cache_snapshot(worker_id)]
        return [*snapshots, k.spec_stream(worker_id), k.queued_ms(worker_id)]

    async def forget_views(self, worker_id: str) -> int:
        """Delete `view_keys` of a worker that is no longer registered (one slot: one DEL), and let
        its tombstones expire with their last entry (they still refuse a late commit until then;
        `add` makes them lasting again). The queue, ledger and reservations are not touched: what is
        in flight there settles by itself. Run at removal, and again by the owner once its poller
        stopped (`Ownership.on_lose`), which may have written once more in between. Returns the
        keys deleted."""
        tomb = self.keys.tombstones(worker_id)
        async with self.redis.pipeline(transaction=False) as p:
            p.delete(*self.view_keys(worker_id))
            p.zrange(tomb, -1, -1, withscores=True)
            deleted, last = await p.execute()
        if last:
            await self.redis.pexpireat(tomb, int(last[0][1]) + 1)
        return int(deleted)

    async def drain(self, worker_id: str) -> bool:
        if not await self.redis.sismember(self.keys.workers, worker_id):
            return False
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(self.keys.worker_info(worker_id), "state", "draining")
            await p.execute()
        return True

    async def list(self) -> dict[str, dict[str, str]]:
        ids = sorted(await self.redis.smembers(self.keys.workers))
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as p:
            for wid in ids:
                p.hgetall(self.keys.worker_info(_s(wid)))
            infos = await p.execute()
        return {_s(w): {_s(k): _s(v) for k, v in info.items()} for w, info in zip(ids, infos, strict=True)}
