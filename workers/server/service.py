"""The worker's three Triton models (engine role + `control`) over one engine core.

Infer functions are `async def` generators (a blocking one would serialise every stream of the
instance) and all decoupled, `control` included, so a slow or hung call never holds up others.
Everything that touches the core runs on the engine thread through `EngineRunner.call`, including
subscriber registration, so effects and subscriptions never race.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from app.protocol import worker_api as W
from app.protocol.blocks import block_keys
from app.protocol.codes import EngineStatus
from app.scheduling.formula import FormulaError
from workers.engine.decode import DecodeEngine, DecodeRequest
from workers.engine.effects import (
    BatchDone,
    DecodeChunk,
    DecodeFinished,
    ExitRequested,
    KvReleased,
    PrefillResult,
)
from workers.engine.faults import Faults
from workers.engine.prefill import PrefillEngine, PrefillRequest
from workers.engine.profiles import EngineProfile, get_profile

from .kv_channel import KvClaimClient, KvClaimServer, SideLoop
from .runner import EngineRunner, Subscriber
from .stream_end import EndOfStream
from .tensors import as_int, as_str, as_strs, b1, bytes_arr, get

log = logging.getLogger("flexlb.worker")

_EMPTY_B = np.array([], dtype=np.bytes_)
_EMPTY_I32 = np.array([], dtype=np.int32)
_EMPTY_I64 = np.array([], dtype=np.int64)
_EMPTY_F64 = np.array([], dtype=np.float64)
_ONE_I32 = np.array([1], dtype=np.int32)


@dataclass
class WorkerConfig:
    role: str
    host: str = "127.0.0.1"
    grpc_port: int = 0
    kv_port: int = 0  # prefill: the KV side channel's port (0: a free one)
    profile: str = "llama3.1-8b-h100"
    formula: str | None = None
    time_scale: float = 1.0
    block_size: int = 64
    kv_capacity_tokens: int | None = None
    seed: int = 0
    model_name: str = "flexlb-sim"
    tokenizer: str = "byte"
    chunk_interval_ms: float = 20.0  # wall ms between decode chunks of one stream
    kv_handle_ttl_ms: float = 30_000.0
    max_events_per_s: float = 400.0  # decode chunk budget of the whole worker (see stream_interval_s)
    stream_idle_timeout_s: float = 600.0  # end a stream whose engine work produced nothing this long
    faults: Faults = field(default_factory=Faults)


class ControlError(ValueError):
    """A refused control request; reported as {"error": ...} and nothing is applied."""


class WorkerService:
    def __init__(self, cfg: WorkerConfig, stopping: threading.Event | None = None) -> None:
        if cfg.role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        self.cfg = cfg
        self.epoch = uuid.uuid4().hex[:12]
        self.profile = self._profile(cfg.profile, cfg.formula, cfg.kv_capacity_tokens)
        self.core: PrefillEngine | DecodeEngine = self._new_core()
        self.runner = EngineRunner(
            self.core,
            time_scale=cfg.time_scale,
            tick_ms=cfg.chunk_interval_ms if cfg.role == "decode" else None,
            on_effects=self._route,
            on_tick=self.flush_due_chunks if cfg.role == "decode" else None,
        )
        self.stopping = stopping or threading.Event()  # set when Triton stops: streams end at once
        self._subs: dict[str, list[Subscriber]] = {}
        self._peer_clients: dict[str, Any] = {}  # gRPC clients of prefill peers (side loop only)
        self.side = SideLoop()
        self.kv_server = KvClaimServer(self._claim_local) if cfg.role == "prefill" else None
        self.kv_client = KvClaimClient(self._resolve_kv, self._control_release)
        self.released = {"released": 0, "expired": 0, "cancelled": 0, "reset": 0}
        self._status_seq = 0
        # What configure last applied (reset restores the start-up values): later configure calls
        # change only what they name.
        self.current: dict[str, Any] = {
            "profile": cfg.profile,
            "formula": cfg.formula,
            "kv_capacity_tokens": cfg.kv_capacity_tokens,
        }
        self._chunk_buf: dict[str, list[DecodeChunk]] = {}
        self._last_flush: dict[
            str, float
        ] = {}  # strictly increasing per answered status: pollers' only-newer-wins key

    # ---- set-up ---------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.cfg.grpc_port}"

    def _profile(self, name: str, formula: str | None, cap: int | None) -> EngineProfile:
        return get_profile(name, formula=formula, kv_capacity_tokens=cap)

    def _new_core(self) -> PrefillEngine | DecodeEngine:
        if self.cfg.role == "prefill":
            return PrefillEngine(
                self.profile,
                block_size=self.cfg.block_size,
                seed=self.cfg.seed,
                kv_handle_ttl_ms=self.cfg.kv_handle_ttl_ms,
                faults=self.cfg.faults,
            )
        return DecodeEngine(self.profile, seed=self.cfg.seed, faults=self.cfg.faults)

    def start(self, kv_bind: str = "127.0.0.1") -> None:
        """`kv_bind`: where the prefill side channel listens (the worker's bind address)."""
        from app.netports import free_port

        self.runner.start()
        self.side.start()
        if self.kv_server is not None:
            self.side.run(self.kv_server.start(kv_bind, self.cfg.kv_port or free_port(kv_bind)))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.kv_server is not None:
                self.side.run(self.kv_server.close(), timeout=5)
            self.side.run(self.kv_client.close(), timeout=5)
        self.side.stop()
        self.runner.stop()

    @property
    def kv_endpoint(self) -> str:
        """`host:port` of the KV side channel (prefill only; "" when there is none)."""
        if self.kv_server is None or not self.kv_server.port:
            return ""
        return f"{self.cfg.host}:{self.kv_server.port}"

    # ---- effects (engine thread) ----------------------------------------------------------
    def _route(self, effects: list[Any]) -> None:
        pending: dict[str, list[PrefillResult]] = {}
        for e in effects:
            if isinstance(e, PrefillResult):
                pending.setdefault(e.batch_id, []).append(e)
            elif isinstance(e, BatchDone):
                items: list[tuple[str, Any]] = self._result_items(pending, e.batch_id)
                items.append(("final", None))
                for s in self._subs.pop(e.batch_id, []):
                    s.push_many(items)
            elif isinstance(e, DecodeChunk):
                self._chunk_buf.setdefault(e.request_id, []).append(e)
            elif isinstance(e, DecodeFinished):
                chunk = self._take_chunks(e.request_id)
                self._last_flush.pop(e.request_id, None)
                items = [("tokens", chunk), ("finish", e)] if chunk is not None else [("finish", e)]
                for s in self._subs.pop(e.request_id, []):
                    s.push_many(items)
            elif isinstance(e, KvReleased):
                self.released[e.reason] = self.released.get(e.reason, 0) + 1
            elif isinstance(e, ExitRequested):
                log.error("fault exit_after_batches reached: exiting abruptly")
                _hard_exit()
        for bid in list(pending):
            items = self._result_items(pending, bid)
            for s in self._subs.get(bid, []):
                s.push_many(items)
        if self._chunk_buf:
            self.flush_due_chunks()

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

    def _result_items(self, pending: dict[str, list[PrefillResult]], batch_id: str) -> list[tuple[str, Any]]:
        """One `results` item per completion instant of the batch's pending results."""
        by_t: dict[float, list[PrefillResult]] = {}
        for r in pending.pop(batch_id, None) or []:
            by_t.setdefault(r.end_ms, []).append(r)
        return [("results", group) for group in by_t.values()]

    @staticmethod
    def _peek(sub: Subscriber) -> tuple[str, Any] | None:
        """The subscriber's next item if it is already queued (see `Subscriber.push_many`)."""
        try:
            item: tuple[str, Any] = sub.queue.get_nowait()
            return item
        except asyncio.QueueEmpty:
            return None

    # ---- prefill --------------------------------------------------------------------------
    async def prefill(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for i, req in enumerate(requests):
            last_req = i == len(requests) - 1
            async for ev in self._prefill_one(req):
                ends = W.P_FINAL in ev or ev[W.P_EVENT][0] in (b"final", b"error")
                yield EndOfStream([ev]) if last_req and ends else [ev]

    async def _prefill_one(self, req: Any) -> AsyncIterator[dict[str, np.ndarray]]:
        batch_id = as_str(get(req, W.P_BATCH_ID))
        try:
            reqs = self._parse_prefill(req, batch_id)
        except ControlError as exc:
            yield self._p_event("error", batch_id, errors=[str(exc)])
            return
        await self._wait_unhung()
        loop = asyncio.get_running_loop()
        sub = Subscriber(loop)
        pos, replay = await self.runner.call(lambda: self._submit_prefill(batch_id, reqs, sub))
        yield self._p_event("accepted", batch_id, queue_position=pos)
        if replay is not None:
            yield (
                self._p_results(batch_id, replay, final=True) if replay else self._p_event("final", batch_id)
            )
            return
        held: tuple[str, Any] | None = None
        while True:
            item, held = held or await self._next(sub), None
            if item is None:
                yield self._p_event("error", batch_id, errors=["worker stopping or stream idle timeout"])
                return
            kind, payload = item
            if kind == "results":
                # The batch's last results and its `final` travel as one event when both are
                # ready: one response fewer through the stub, Triton and the gateway (§4.2).
                held = self._peek(sub)
                last = held is not None and held[0] == "final"
                yield self._p_results(batch_id, payload, final=last)
                if last:
                    return
            else:
                yield self._p_event("final", batch_id)
                return

    async def _next(self, sub: Subscriber) -> tuple[str, Any] | None:
        """Next effect for a stream; None when the worker is stopping (PyTriton's stop waits for
        every generator) or the engine produced nothing for `stream_idle_timeout_s`."""
        idle = 0.0
        while not self.stopping.is_set():
            try:
                return await asyncio.wait_for(sub.queue.get(), 0.5)
            except TimeoutError:
                idle += 0.5
                if idle >= self.cfg.stream_idle_timeout_s:
                    return None
        return None

    def _parse_prefill(self, req: Any, batch_id: str) -> list[PrefillRequest]:
        epoch = as_str(get(req, W.P_EPOCH))
        if epoch and epoch != self.epoch:
            raise ControlError(f"{EngineStatus.EPOCH_MISMATCH}: worker epoch is {self.epoch}")
        if not batch_id:
            raise ControlError(f"{EngineStatus.INVALID}: batch_id is required")
        ids_t, lens_t, rid_t = get(req, W.P_INPUT_IDS), get(req, W.P_INPUT_LENGTHS), get(req, W.P_REQUEST_IDS)
        if ids_t is None or lens_t is None or rid_t is None:
            raise ControlError(
                f"{EngineStatus.INVALID}: request_ids, input_ids and input_lengths are required"
            )
        rids = as_strs(rid_t)
        lens = lens_t.reshape(-1).astype(np.int64)
        ids = ids_t.reshape(-1)
        if len(rids) == 0:
            raise ControlError(f"{EngineStatus.INVALID}: empty batch")
        if len(lens) != len(rids) or int(lens.sum()) != len(ids) or (lens < 0).any():
            raise ControlError(f"{EngineStatus.INVALID}: input_lengths do not match input_ids/request_ids")
        out: list[PrefillRequest] = []
        off = 0
        bs = self.cfg.block_size
        for rid, n in zip(rids, lens.tolist(), strict=True):
            toks = ids[off : off + n]
            off += n
            keys = block_keys(toks, bs, model=self.cfg.model_name, tokenizer=self.cfg.tokenizer)
            out.append(PrefillRequest(rid, n, tuple(keys)))
        return out

    def _submit_prefill(
        self, batch_id: str, reqs: list[PrefillRequest], sub: Subscriber
    ) -> tuple[int, list[PrefillResult] | None]:
        core = self.core
        assert isinstance(core, PrefillEngine)
        now = self.runner.model_now()
        known = batch_id in core._batches
        if known:
            done = core._batches[batch_id].phase == "done"
            past = [r for r in core.history if r.batch_id == batch_id]
            if done:
                return 0, past
            self._subs.setdefault(batch_id, []).append(sub)
            if past:
                sub.push(("results", past))
            out = core.submit(batch_id, reqs, now)
            self._route(out.effects)
            return out.queue_position, None
        self._subs.setdefault(batch_id, []).append(sub)
        out = core.submit(batch_id, reqs, now)
        self._route(out.effects)
        return out.queue_position, None

    def _p_results(
        self, batch_id: str, rs: list[PrefillResult], final: bool = False
    ) -> dict[str, np.ndarray]:
        out = {
            W.P_EVENT: b1("results"),
            W.P_BATCH_ID: b1(batch_id),
            W.P_EPOCH: b1(self.epoch),
            W.P_REQUEST_IDS: bytes_arr(r.request_id for r in rs),
            W.P_STATUS: bytes_arr(r.status for r in rs),
            W.P_FIRST_TOKEN: np.array([r.first_token for r in rs], dtype=np.int32),
            W.P_CACHED_TOKENS: np.array([r.cached_tokens for r in rs], dtype=np.int32),
            W.P_INPUT_TOKENS: np.array([r.input_tokens for r in rs], dtype=np.int32),
            W.P_START_MS: np.array([r.start_ms for r in rs], dtype=np.float64),
            W.P_END_MS: np.array([r.end_ms for r in rs], dtype=np.float64),
            W.P_KV_EXPIRY_MS: np.array([r.kv_expiry_ms for r in rs], dtype=np.float64),
            W.P_SEQ: np.array([r.seq for r in rs], dtype=np.int64),
            W.P_ERROR: bytes_arr(r.error for r in rs),
        }
        if final:
            out[W.P_FINAL] = _ONE_I32
        return out

    def _p_event(
        self, kind: str, batch_id: str, *, queue_position: int = 0, errors: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """`accepted`, `final` and `error` carry only their own tensors: each omitted one is
        work saved in this process, the Python-backend stub, Triton and the gateway, three times
        per batch (docs/worker-protocol.md §4.3)."""
        out = {
            W.P_EVENT: b1(kind),
            W.P_BATCH_ID: b1(batch_id),
            W.P_EPOCH: b1(self.epoch),
            W.P_QUEUE_POSITION: np.array([queue_position], dtype=np.int32),
        }
        if errors:
            out[W.P_ERROR] = bytes_arr(errors)
        return out

    # ---- decode ---------------------------------------------------------------------------
    async def decode(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for i, req in enumerate(requests):
            last_req = i == len(requests) - 1
            async for ev in self._decode_one(req):
                yield EndOfStream([ev]) if last_req and ev[W.D_EVENT][0] == b"finish" else [ev]

    async def _decode_one(self, req: Any) -> AsyncIterator[dict[str, np.ndarray]]:
        rid = as_str(get(req, W.D_REQUEST_ID))
        epoch = as_str(get(req, W.D_EPOCH))
        if epoch and epoch != self.epoch:
            yield self._d_finish(rid, EngineStatus.EPOCH_MISMATCH, 0, f"worker epoch is {self.epoch}")
            return
        if not rid:
            yield self._d_finish(rid, EngineStatus.INVALID, 0, "request_id is required")
            return
        dreq = DecodeRequest(
            rid,
            as_int(get(req, W.D_INPUT_TOKENS)),
            as_int(get(req, W.D_MAX_NEW_TOKENS)),
            first_index=as_int(get(req, W.D_FIRST_INDEX), 1),
        )
        kv_worker = as_str(get(req, W.D_KV_WORKER))
        kv_epoch = as_str(get(req, W.D_KV_EPOCH))
        await self._wait_unhung()
        if kv_worker:
            # Claim the KV handle before modelling the transfer: a lapsed handle (or a restarted
            # prefill worker) must end the stream kv_expired before any token is produced.
            status = await self._release_remote(rid, kv_worker, kv_epoch)
            if status != EngineStatus.OK:
                err = f"KV handle on {kv_worker} is no longer valid ({status})"
                yield self._d_finish(rid, EngineStatus.KV_EXPIRED, 0, err)
                return
        loop = asyncio.get_running_loop()
        sub = Subscriber(loop)
        await self.runner.call(lambda: self._submit_decode(dreq, sub))
        finished = False
        held: tuple[str, Any] | None = None
        try:
            while True:
                item, held = held or await self._next(sub), None
                if item is None:
                    yield self._d_finish(
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
                        out = self._d_finish(rid, fin.reason, fin.generated, fin.error, fin.t_ms)
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
                    yield self._d_finish(rid, ev.reason, ev.generated, ev.error, ev.t_ms)
                    return
        finally:
            if not finished:  # consumer or server went away mid-stream: free the engine's work
                self.runner.call_sync(
                    lambda: self._route(self._core_d().cancel(rid, self.runner.model_now()))
                )

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
            client = self._peer_clients[addr] = WorkerClient(addr)
        return client

    async def _resolve_kv(self, addr: str) -> str | None:
        answer = await self._peer(addr).control({"op": "kv_endpoint"}, timeout=5.0)
        return str(answer.get("kv_endpoint") or "") or None  # an error (older peer): no channel

    async def _control_release(self, addr: str, rid: str, kv_epoch: str) -> str:
        body = {"op": "release", "request_id": rid, "epoch": kv_epoch}
        answer = await self._peer(addr).control(body, timeout=5.0)
        return str(answer.get("status", EngineStatus.UNKNOWN))

    async def _claim_local(self, rid: str, epoch: str) -> str:
        """A claim arriving over the side channel: the same answer as `control.release`."""
        await self._wait_unhung()
        if epoch and epoch != self.epoch:
            return EngineStatus.EPOCH_MISMATCH
        return str((await self.runner.call(lambda: self._release(rid)))["status"])

    def _d_finish(
        self, rid: str, reason: str, generated: int, error: str, t_ms: float = 0.0
    ) -> dict[str, np.ndarray]:
        return {
            W.D_EVENT: b1("finish"),
            W.D_T_FIRST_MS: np.array([t_ms], dtype=np.float64),
            W.D_T_LAST_MS: np.array([t_ms], dtype=np.float64),
            W.D_FINISH_REASON: b1(str(reason)),
            W.D_GENERATED: np.array([generated], dtype=np.int32),
            W.D_ERROR: b1(error),
        }

    # ---- control --------------------------------------------------------------------------
    async def control(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for req in requests:
            try:
                body = json.loads(as_str(get(req, W.C_REQUEST)) or "{}")
                if not isinstance(body, dict):
                    raise ControlError("request must be a JSON object")
                resp = await self._control(body)
            except (ControlError, FormulaError, ValueError, TypeError, KeyError) as exc:
                resp = {"error": str(exc), "code": EngineStatus.INVALID}
            resp.setdefault("epoch", self.epoch)
            out = [{W.C_RESPONSE: b1(json.dumps(resp))}]
            yield EndOfStream(out) if req is requests[-1] else out

    async def _control(self, body: dict[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        if op == "configure":
            return await self._configure(body)
        if op == "reset":
            return await self.runner.call(self._reset)
        await self._wait_unhung()
        if op == "status":
            return await self.runner.call(lambda: self._status(int(body.get("since_seq", 0))))
        if op == "cache":
            return await self.runner.call(lambda: self._cache(body))
        if op == "poll":  # status + cache in one call: what an owner's poll needs
            since_seq = int(body.get("since_seq", 0))
            return await self.runner.call(
                lambda: {"status": self._status(since_seq), "cache": self._cache(body)}
            )
        if op == "cancel":
            some_id = str(body["id"])
            return await self.runner.call(lambda: self._cancel(some_id))
        if op == "kv_endpoint":
            return {"kv_endpoint": self.kv_endpoint}
        if op == "release":
            if body.get("epoch") and body["epoch"] != self.epoch:
                return {"status": EngineStatus.EPOCH_MISMATCH}
            rid = str(body["request_id"])
            return await self.runner.call(lambda: self._release(rid))
        raise ControlError(f"unknown op {op!r}")

    async def _wait_unhung(self) -> None:
        """Fault `hang`: the worker stops answering anything but configure/reset."""
        while self.core.faults.hang:
            await asyncio.sleep(0.05)

    def _status(self, since_seq: int) -> dict[str, Any]:
        core = self.core
        now = self.runner.model_now()
        self._status_seq += 1
        st: dict[str, Any] = {
            "status_seq": self._status_seq,
            "role": self.cfg.role,
            "epoch": self.epoch,
            "address": self.address,
            "now_ms": now,
            "block_size": self.cfg.block_size,
            "time_scale": self.runner.time_scale,
            "profile": self.current["profile"],
            "lag_ms": self.runner.lag_ms,
            "max_lag_ms": self.runner.max_lag_ms,
            **core.kv_view(),
        }
        if isinstance(core, PrefillEngine):
            resync, recs = core.records_since(since_seq, W.STATUS_PAGE_LIMIT)
            live = core.live_view()
            st.update(
                seq=core.seq,
                resync=resync,
                finished=[asdict(r) for r in recs],
                more=bool(recs) and recs[-1].seq < core.seq,
                live=live,
                queue_len=sum(1 for b in live if b["phase"] == "queued"),
                queued_predicted_ms=core.queued_predicted_ms(),
                batches_done=core.batches_done,
                pinned=core.pinned_ids(),
                kv_released=dict(self.released),
            )
        else:
            live_d = core.live_view()
            st.update(
                live=live_d,
                running=len(live_d["running"]),
                queue_len=len(live_d["waiting"]) + len(live_d["fetching"]),
                step_ms=core.step_ms,
                avg_step_ms=core.avg_step_ms(),
                tokens_total=core.tokens_total,
            )
        return st

    def _cache(self, body: dict[str, Any]) -> dict[str, Any]:
        core = self.core
        if not isinstance(core, PrefillEngine):
            return {"version": 0, "full": True, "added": [], "removed": []}
        since = body.get("since_version")
        if body.get("epoch") != self.epoch:
            since = None
        d = core.cache_diff(None if since is None else int(since))
        return {
            "version": d.version,
            "full": d.full,
            "added": d.added,
            "removed": d.removed,
            "block_size": self.cfg.block_size,
        }

    def _cancel(self, some_id: str) -> dict[str, Any]:
        now = self.runner.model_now()
        if isinstance(self.core, PrefillEngine):
            what, effects = self.core.cancel(some_id, now)
        else:
            known = some_id in self.core.live_view()["running"] or some_id in self.core._seqs
            effects = self.core.cancel(some_id, now)
            what = "cancelled" if known else "unknown"
        self._route(effects)
        return {"result": what}

    def _release(self, rid: str) -> dict[str, Any]:
        if not isinstance(self.core, PrefillEngine):
            return {"status": EngineStatus.UNKNOWN}
        status, effects = self.core.release(rid, self.runner.model_now())
        self._route(effects)
        return {"status": str(status)}

    async def _configure(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate everything first; apply all or nothing."""
        allowed = {
            "op",
            "profile",
            "formula",
            "kv_capacity_tokens",
            "faults",
            "time_scale",
            "kv_handle_ttl_ms",
            "chunk_interval_ms",
        }
        bad = set(body) - allowed
        if bad:
            raise ControlError(f"unknown configure option(s): {sorted(bad)}")
        profile = None
        new_current = dict(self.current)
        if "profile" in body or "formula" in body or "kv_capacity_tokens" in body:
            cap = body.get("kv_capacity_tokens", self.current["kv_capacity_tokens"])
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
                raise ControlError("kv_capacity_tokens must be a positive integer")
            name = body.get("profile", "formula" if "formula" in body else self.current["profile"])
            formula = body.get("formula", self.current["formula"])
            profile = self._profile(name, formula, cap)
            new_current = {"profile": name, "formula": formula, "kv_capacity_tokens": cap}
        faults = Faults.from_dict(body["faults"]) if "faults" in body else None
        scale = body.get("time_scale")
        if scale is not None and not (isinstance(scale, int | float) and 0 < scale <= 1000):
            raise ControlError("time_scale must be in (0, 1000]")
        ttl = body.get("kv_handle_ttl_ms")
        if ttl is not None and not (isinstance(ttl, int | float) and ttl > 0):
            raise ControlError("kv_handle_ttl_ms must be > 0")
        chunk = body.get("chunk_interval_ms")
        if chunk is not None and not (isinstance(chunk, int | float) and chunk > 0):
            raise ControlError("chunk_interval_ms must be > 0")

        def apply() -> dict[str, Any]:
            now = self.runner.model_now()
            if scale is not None:
                self.runner.set_time_scale(float(scale))
            if chunk is not None and self.runner.tick_ms is not None:
                self.runner.tick_ms = float(chunk)
            kw: dict[str, Any] = {"faults": faults, "profile": profile}
            if profile is not None:
                kw["kv_capacity_tokens"] = profile.kv_capacity_tokens
            if isinstance(self.core, PrefillEngine):
                kw["kv_handle_ttl_ms"] = ttl
            self._route(self.core.configure(now, **kw))
            self.current = new_current
            return {"ok": True}

        return await self.runner.call(apply)

    def _reset(self) -> dict[str, Any]:
        now = self.runner.model_now()
        self._route(self.core.reset(now))
        self.profile = self._profile(self.cfg.profile, self.cfg.formula, self.cfg.kv_capacity_tokens)
        self.current = {
            "profile": self.cfg.profile,
            "formula": self.cfg.formula,
            "kv_capacity_tokens": self.cfg.kv_capacity_tokens,
        }
        kw: dict[str, Any] = {
            "profile": self.profile,
            "kv_capacity_tokens": self.profile.kv_capacity_tokens,
            "faults": Faults(**asdict(self.cfg.faults)),
        }
        if isinstance(self.core, PrefillEngine):
            kw["kv_handle_ttl_ms"] = self.cfg.kv_handle_ttl_ms
        self._route(self.core.configure(now, **kw))
        self.runner.set_time_scale(self.cfg.time_scale)
        if self.runner.tick_ms is not None:
            self.runner.tick_ms = self.cfg.chunk_interval_ms
        return {"ok": True}


def _hard_exit() -> None:
    """Die like a crashed GPU process: take the Triton server down with us, no clean-up."""
    with contextlib.suppress(Exception):
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                child.kill()
    os._exit(70)
