"""The worker's three Triton models (engine role + `control`) over one simulated engine core.

Infer functions are `async def` generators (a blocking one would serialise every stream of the
instance) and all decoupled, `control` included, so a slow or hung call never holds up others.
Everything that touches the core runs on the engine thread through `EngineRunner.call`, including
subscriber registration, so effects and subscriptions never race. The models live one per module
(prefill_model.py, decode_model.py, control_model.py); this class owns the state they share and
routes the core's effects to the streams that wait for them.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from workers.engine.decode import DecodeEngine
from workers.engine.effects import (
    BatchDone,
    DecodeChunk,
    DecodeFinished,
    ExitRequested,
    KvReleased,
    PrefillResult,
)
from workers.engine.prefill import PrefillEngine

from .common import ControlError, WorkerConfig, hard_exit
from .control_model import ControlModel
from .decode_model import DecodeModel
from .kv_channel import KvClaimClient, KvClaimServer, SideLoop
from .prefill_model import PrefillModel
from .runner import EngineRunner, Subscriber

__all__ = ["ControlError", "WorkerConfig", "WorkerService"]

log = logging.getLogger("flexlb.worker")


class WorkerService(PrefillModel, DecodeModel, ControlModel):
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
        self.kv_server = (
            KvClaimServer(self._claim_local, self._kv_fetch_handler(), secret=cfg.secret)
            if cfg.role == "prefill"
            else None
        )
        self.kv_client = KvClaimClient(self._resolve_kv, self._control_release, secret=cfg.secret)
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

    def _new_core(self) -> PrefillEngine | DecodeEngine:
        if self.cfg.role == "prefill":
            return PrefillEngine(
                self.profile,
                block_size=self.cfg.block_size,
                seed=self.cfg.seed,
                kv_handle_ttl_ms=self.cfg.kv_handle_ttl_ms,
                faults=self.cfg.faults,
            )
        return DecodeEngine(
            self.profile, seed=self.cfg.seed, faults=self.cfg.faults, admission=self.cfg.decode_admission
        )

    def _kv_fetch_handler(self) -> Any:
        """What answers a side-channel fetch (a real engine's KV frame); None: claims only."""
        return None

    def start(self, kv_bind: str = "127.0.0.1") -> None:
        """`kv_bind`: where the prefill side channel listens (the worker's bind address)."""
        from app.netports import free_port

        self.runner.start()
        self.side.start()
        if self.kv_server is not None:
            self.side.run(self.kv_server.start(kv_bind, self.cfg.kv_port or free_port(kv_bind)))

    def stop(self) -> None:
        """Close the KV channel, then the side loop and the engine runner; a channel that fails
        to close must not keep the engine running, so its failure is logged and the stop goes on."""
        try:
            if self.kv_server is not None:
                self.side.run(self.kv_server.close(), timeout=5)
            self.side.run(self.kv_client.close(), timeout=5)
        except Exception:
            log.warning("KV channel close failed; stopping the engine anyway", exc_info=True)
        self.side.stop()
        self.runner.stop()

    @property
    def kv_endpoint(self) -> str:
        """`host:port` of the KV side channel (prefill only; "" when there is none)."""
        if self.kv_server is None or not self.kv_server.port:
            return ""
        return f"{self.cfg.host}:{self.kv_server.port}"

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
                hard_exit()
        for bid in list(pending):
            items = self._result_items(pending, bid)
            for s in self._subs.get(bid, []):
                s.push_many(items)
        if self._chunk_buf:
            self.flush_due_chunks()
