"""The `decode` model over the simulated core: one sequence in, `tokens` chunks and one `finish`
out (docs/worker-protocol.md §6), plus the claim of the KV handle on the prefill peer (§5)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from app.protocol import worker_api as W
from app.protocol.codes import EngineStatus
from workers.engine.decode import DecodeEngine, DecodeRequest
from workers.engine.effects import (
    DecodeChunk,
    DecodeFinished,
)

from .common import StreamBase, d_finish
from .kv_channel import KvClaimClient, SideLoop
from .runner import EngineRunner, Subscriber
from .stream_end import EndOfStream
from .tensors import as_int, as_str, b1, get

log = logging.getLogger("flexlb.worker")


class DecodeModel(StreamBase):
    """Mixin of `WorkerService`: the decode role's infer function, chunk coalescing and KV claim."""

    if TYPE_CHECKING:  # provided by the composed service

        def _route(self, effects: list[Any]) -> None: ...
        async def _wait_unhung(self) -> None: ...

    epoch: str
    core: Any
    runner: EngineRunner
    side: SideLoop
    kv_client: KvClaimClient
    _subs: dict[str, list[Subscriber]]
    _peer_clients: dict[str, Any]
    _chunk_buf: dict[str, list[DecodeChunk]]
    _last_flush: dict[str, float]

    def stream_interval_s(self) -> float:
        """Per-stream chunk interval: the configured one, stretched when many streams run so the
        whole worker stays under `max_events_per_s` (one PyTriton instance delivers ~1K events/s;
        beyond that tokens queue up and arrive late instead of arriving in bigger chunks)."""
        base = (self.runner.tick_ms or self.cfg.chunk_interval_ms) / 1000
        return max(base, len(self._last_flush) / self.cfg.max_events_per_s)

    def flush_due_chunks(self) -> None:
        """Engine thread: hand each stream its buffered tokens once its interval has passed."""
        now = time.monotonic()
        interval = self.stream_interval_s()
        for rid in list(self._chunk_buf):
            last = self._last_flush.setdefault(rid, 0.0)
            if now - last >= interval:
                self._flush_chunks(rid)
                self._last_flush[rid] = now

    def _flush_chunks(self, rid: str) -> None:
        merged = self._take_chunks(rid)
        if merged is not None:
            for s in self._subs.get(rid, []):
                s.push(("tokens", merged))

    def _take_chunks(self, rid: str) -> DecodeChunk | None:
        """The stream's buffered tokens as one chunk (None if there are none)."""
        chunks = self._chunk_buf.pop(rid, None)
        if not chunks:
            return None
        if len(chunks) == 1:
            return chunks[0]
        return DecodeChunk(
            rid,
            chunks[0].first_index,
            [t for c in chunks for t in c.tokens],
            chunks[0].t_first_ms,
            chunks[-1].t_last_ms,
        )

    async def decode(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for i, req in enumerate(requests):
            last_req = i == len(requests) - 1
            async for ev in self._decode_one(req):
                yield EndOfStream([ev]) if last_req and ev[W.D_EVENT][0] == b"finish" else [ev]

    async def _decode_one(self, req: Any) -> AsyncIterator[dict[str, np.ndarray]]:
        rid = as_str(get(req, W.D_REQUEST_ID))
        epoch = as_str(get(req, W.D_EPOCH))
        if epoch and epoch != self.epoch:
            yield d_finish(EngineStatus.EPOCH_MISMATCH, 0, f"worker epoch is {self.epoch}")
            return
        if not rid:
            yield d_finish(EngineStatus.INVALID, 0, "request_id is required")
            return
        dreq = DecodeRequest(
            rid,
            as_int(get(req, W.D_INPUT_TOKENS)),
            as_int(get(req, W.D_MAX_NEW_TOKENS)),
            first_index=as_int(get(req, W.D_FIRST_INDEX), 1),
            block_keys=tuple(int(k) for k in keys.reshape(-1))
            if (keys := get(req, W.D_BLOCK_KEYS)) is not None
            else (),
            block_size=as_int(get(req, W.D_BLOCK_SIZE)),
        )
        kv_worker = as_str(get(req, W.D_KV_WORKER))
        kv_epoch = as_str(get(req, W.D_KV_EPOCH))
        await self._wait_unhung()
        got = await self._acquire_kv(dreq, req, kv_worker, kv_epoch)
        if isinstance(got, dict):
            yield got
            return
        dreq = got
        loop = asyncio.get_running_loop()
        sub = Subscriber(loop)
        await self.runner.call(lambda: self._submit_decode(dreq, sub))
        finished = False
        held: tuple[str, Any] | None = None
        try:
            while True:
                item, held = held or await self._next(sub), None
                if item is None:
                    yield d_finish(
                        rid, EngineStatus.ENGINE_ERROR, 0, "worker stopping or stream idle timeout"
                    )
                    return
                kind, ev = item
                if kind == "tokens":
                    held = self._peek(sub)
                    if held is not None and held[0] == "finish" and held[1].t_ms == ev.t_last_ms:
                        # The last chunk rides on `finish` (§6.2): one response fewer.
                        fin: DecodeFinished = held[1]
                        finished = True
                        out = d_finish(fin.reason, fin.generated, fin.error, fin.t_ms)
                        out[W.D_TOKENS] = np.asarray(ev.tokens, dtype=np.int32)
                        out[W.D_FIRST_INDEX] = np.array([ev.first_index], dtype=np.int32)
                        out[W.D_T_FIRST_MS] = np.array([ev.t_first_ms], dtype=np.float64)
                        yield out
                        return
                    yield {
                        W.D_EVENT: b1("tokens"),
                        W.D_TOKENS: np.asarray(ev.tokens, dtype=np.int32),
                        W.D_FIRST_INDEX: np.array([ev.first_index], dtype=np.int32),
                        W.D_T_FIRST_MS: np.array([ev.t_first_ms], dtype=np.float64),
                        W.D_T_LAST_MS: np.array([ev.t_last_ms], dtype=np.float64),
                    }
                else:
                    finished = True
                    yield d_finish(ev.reason, ev.generated, ev.error, ev.t_ms)
                    return
        finally:
            if not finished:  # consumer or server went away mid-stream: free the engine's work
                self.runner.call_sync(
                    lambda: self._route(self._core_d().cancel(rid, self.runner.model_now()))
                )

    async def _acquire_kv(
        self, dreq: DecodeRequest, req: Any, kv_worker: str, kv_epoch: str
    ) -> DecodeRequest | dict[str, np.ndarray]:
        """Take over the request's KV before any token: the request to submit, or the `finish`
        event that ends the stream. The simulated engine claims the handle (the transfer itself
        is modelled); a real engine fetches the tensors instead (hf_service.py)."""
        if kv_worker:
            # Claim the KV handle before modelling the transfer: a lapsed handle (or a restarted
            # prefill worker) must end the stream kv_expired before any token is produced.
            status = await self._release_remote(dreq.request_id, kv_worker, kv_epoch)
            if status != EngineStatus.OK:
                err = f"KV handle on {kv_worker} is no longer valid ({status})"
                return d_finish(EngineStatus.KV_EXPIRED, 0, err)
        return dreq

    def _core_d(self) -> DecodeEngine:
        assert isinstance(self.core, DecodeEngine)
        return self.core

    def _submit_decode(self, dreq: DecodeRequest, sub: Subscriber) -> None:
        core = self._core_d()
        if dreq.request_id in core._seqs:
            # Answer only the newcomer: the live stream with this id keeps its subscribers.
            sub.push(
                (
                    "finish",
                    DecodeFinished(
                        dreq.request_id,
                        EngineStatus.DUPLICATE,
                        0,
                        self.runner.model_now(),
                        "request id already live on this engine",
                    ),
                )
            )
            return
        self._subs.setdefault(dreq.request_id, []).append(sub)
        self._route(core.submit(dreq, self.runner.model_now()))

    async def _release_remote(self, rid: str, addr: str, kv_epoch: str) -> str:
        """Claim the KV handle on prefill worker `addr` over the side channel (kv_channel.py)."""
        try:
            return await asyncio.wrap_future(self.side.submit(self.kv_client.claim(addr, rid, kv_epoch)))
        except Exception as exc:  # the prefill side is gone: its KV is gone with it
            log.warning("kv claim on %s failed: %s", addr, exc or type(exc).__name__)
            return "unreachable"

    # The three below run on the side loop.
    def _peer(self, addr: str) -> Any:
        from app.rpc.worker_client import WorkerClient

        client = self._peer_clients.get(addr)
        if client is None:
            client = self._peer_clients[addr] = WorkerClient(addr, secret=self.cfg.secret)
        return client

    async def _resolve_kv(self, addr: str) -> str | None:
        answer = await self._peer(addr).control({"op": "kv_endpoint"}, timeout=5.0)
        return str(answer.get("kv_endpoint") or "") or None  # an error (older peer): no channel

    async def _control_release(self, addr: str, rid: str, kv_epoch: str) -> str:
        body = {"op": "release", "request_id": rid, "epoch": kv_epoch}
        answer = await self._peer(addr).control(body, timeout=5.0)
        return str(answer.get("status", EngineStatus.UNKNOWN))
