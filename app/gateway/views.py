"""This replica's copy of the cluster's workers: the registry (id → role, address, state), each
worker's latest owner snapshot, and the origin's own overlays on them (the queued ms its last
hand-off there returned). What routing reads per request (`Pipeline.views`); refreshed from Redis
by the replica's refresh loop; also the gRPC clients to the workers, one per worker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio as aioredis

from app import metrics as M
from app.cache.mirror import CacheMirror
from app.cluster.registry import Registry
from app.rpc.worker_client import WorkerClient
from app.scheduling.in_flight import HandoffsInFlight
from app.scheduling.routing import overlay_less_prefilled
from app.state.keys import Keys
from app.state.retry import TRANSIENT
from app.state.text import to_str as _s

__all__ = ["WorkerViews"]


def content_time(snap: dict[str, str], read_at: float) -> float:
    """When a snapshot's loads (queued and owed ms) were true: when its owner read them
    (`loads_ms`, the owner's wall clock), else when we read it. An origin's own hand-off made
    after that moment is not in the snapshot, so its overlay must still win (`current_loads`).
    Dated by our read instead, every hand-off between the owner's read and ours was dropped from
    the view: under load (polls, publication and our read each late) a burst was admitted against
    a backlog missing its latest requests, and ran past its deadline (test_overload_live's burst:
    7 admitted where 6 fit, in a CI run at load 9). An owner clock ahead of ours falls back to
    our read; one behind keeps our overlays a little longer, which over-counts, never under."""
    owner = float(snap.get("loads_ms", 0.0) or 0.0) / 1000.0
    return owner if 0.0 < owner < read_at else read_at


class WorkerViews:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        registry: Registry,
        mirror: CacheMirror,
        worker_secret: str = "",
        grpc_mux: bool = True,
        grpc_mux_decode: bool = True,
    ) -> None:
        self._worker_secret = worker_secret  # the workers' control secret (FLEXLB_WORKER_SECRET)
        self._grpc_mux = grpc_mux  # FLEXLB_GRPC_MUX: shared streams for control and prefill calls
        self._grpc_mux_decode = grpc_mux_decode  # FLEXLB_GRPC_MUX_DECODE: reused decode streams
        self._redis = redis
        self._keys = keys
        self._registry = registry
        self._mirror = mirror  # only for the snapshot metrics (blocks mirrored per worker)
        self.workers: dict[str, dict[str, str]] = {}  # local copy of the registry
        self.snapshots: dict[str, dict[str, str]] = {}  # latest owner snapshot per worker
        self.snapshot_time: dict[str, float] = {}  # wall s each snapshot was read
        self.queued_overlay: dict[str, tuple[float, float]] = {}  # wid → (queued ms, when) from hand-offs
        self.overlay_answer_of: dict[str, str] = {}  # wid → the request whose own answer it is, if one
        self.in_flight = HandoffsInFlight()  # hand-offs sent whose answer is not in the overlay yet
        self.clients: dict[str, WorkerClient] = {}

    def note_queued(self, wid: str, queued_ms: float, when: float, answer_of: str = "") -> None:
        """The queued ms a hand-off script read on ``wid`` (its answer); ``answer_of``: the request
        it appended, when the answer holds it (`routing.overlay_less_prefilled`)."""
        self.queued_overlay[wid] = (queued_ms, when)
        self.overlay_answer_of[wid] = answer_of

    def note_prefilled(self, wid: str, request_id: str, predicted_ms: float) -> None:
        """``request_id``'s prefill on ``wid`` finished: off the overlay if it is its own answer."""
        ov = overlay_less_prefilled(
            self.queued_overlay.get(wid), self.overlay_answer_of.get(wid), request_id, predicted_ms
        )
        if ov is not None:
            self.queued_overlay[wid] = ov
            self.overlay_answer_of[wid] = ""

    def prefill_ids(self) -> list[str]:
        return sorted(w for w, i in self.workers.items() if i.get("role") == "prefill")

    def decode_ids(self) -> list[str]:
        return sorted(w for w, i in self.workers.items() if i.get("role") == "decode")

    def worker_up(self, wid: str) -> bool:
        return self.snapshots.get(wid, {}).get("health") == "up"

    def awaiting_first_snapshot(self) -> bool:
        """Some registered worker has no owner snapshot yet (just started, or just added)."""
        return any(not self.snapshots.get(w) for w in self.workers)

    def client(self, wid: str) -> WorkerClient:
        c = self.clients.get(wid)
        if c is None:
            addr = self.workers.get(wid, {}).get("address") or wid.split("@", 1)[1]
            c = self.clients[wid] = WorkerClient(
                addr, secret=self._worker_secret, mux=self._grpc_mux, decode_mux=self._grpc_mux_decode
            )
        return c

    async def load_registry(self) -> None:
        """The registry from Redis; a removed worker's client and metric series go with it."""
        self.workers = await self._registry.list()
        M.retain_workers(self.workers)  # series leave with their worker, whoever removed it
        for wid in list(self.clients):
            if wid not in self.workers:
                with contextlib.suppress(*TRANSIENT):  # a removed worker's channel: just let go
                    await self.clients.pop(wid).close()
                M.remove_worker_series(wid)

    async def load_snapshots(self) -> None:
        ids = list(self.workers)
        if not ids:
            self.snapshots = {}
            return
        async with self._redis.pipeline(transaction=False) as p:
            for wid in ids:
                p.hgetall(self._keys.snapshot(wid))  # "_retired" rides along; nobody reads it
            rows = await p.execute()
        self.snapshots = {
            wid: {_s(k): _s(v) for k, v in row.items()} for wid, row in zip(ids, rows, strict=True)
        }
        now = time.time()
        for wid in ids:
            self.snapshot_time[wid] = content_time(self.snapshots[wid], now)
        for wid, snap in self.snapshots.items():
            M.export_worker_snapshot(wid, snap, self._mirror.size(wid))

    async def close(self) -> None:
        async def close_one(c: WorkerClient) -> None:
            with contextlib.suppress(*TRANSIENT):
                await c.close()

        # together: each may wait a moment for its worker to end its shared streams
        await asyncio.gather(*(close_one(c) for c in self.clients.values()))
