"""What every model of a worker shares: its configuration, stream plumbing and event encoders.

The worker's models live one per module (prefill_model.py, decode_model.py, control_model.py) as
mixins over the state `service.WorkerService` sets up, so a second engine (workers/server/hf_service.py)
reuses the encoders and the stream helpers without the simulated core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.protocol import worker_api as W
from workers.engine.faults import Faults

from .runner import Subscriber
from .tensors import b1, bytes_arr

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
    decode_admission: str = "reserve"  # decode engine: reserve | expected (workers/engine/decode.py)
    seed: int = 0
    model_name: str = "flexlb-sim"
    tokenizer: str = "byte"
    chunk_interval_ms: float = 20.0  # wall ms between decode chunks of one stream
    kv_handle_ttl_ms: float = 30_000.0
    max_events_per_s: float = 400.0  # decode chunk budget of the whole worker (see stream_interval_s)
    stream_idle_timeout_s: float = 600.0  # end a stream whose engine work produced nothing this long
    faults: Faults = field(default_factory=Faults)
    engine: str = "sim"  # sim | hf (a real model: hf_service.py)
    model_path: str = ""  # hf: a local model directory
    device: str = "cpu"  # hf: cpu | cuda
    dtype: str = "float32"  # hf: float32 | bfloat16
    threads: int = 1  # hf: torch intra-op threads (0: torch's default, every core)
    secret: str = ""  # shared secret the control model and the KV side channel require ("" = none)
    allow_faults: bool = False  # fault injection (configure `faults`) is refused without it


class ControlError(ValueError):
    """A refused control request; reported as {"error": ...} and nothing is applied."""


class StreamBase:
    """Stream helpers every model's infer function uses; needs `self.cfg` and `self.stopping`."""

    cfg: WorkerConfig
    stopping: threading.Event

    @staticmethod
    def _peek(sub: Subscriber) -> tuple[str, Any] | None:
        """The subscriber's next item if it is already queued (see `Subscriber.push_many`)."""
        try:
            item: tuple[str, Any] = sub.queue.get_nowait()
            return item
        except asyncio.QueueEmpty:
            return None

    async def _next(self, sub: Subscriber) -> tuple[str, Any] | None:
        """Next effect for a stream; None when the worker is stopping (PyTriton's stop waits for
        every generator) or the engine produced nothing for `stream_idle_timeout_s`.

        Waits with `asyncio.timeout` in the calling task: `wait_for` ran the queue's `get` as a
        task of its own, so an item woke the stream's generator a loop turn or two later (every
        event of every stream pays it)."""
        idle = 0.0
        while not self.stopping.is_set():
            if not sub.queue.empty():
                return sub.queue.get_nowait()
            try:
                async with asyncio.timeout(0.5):
                    return await sub.queue.get()
            except TimeoutError:
                idle += 0.5
                if idle >= self.cfg.stream_idle_timeout_s:
                    return None
        return None


def p_results(epoch: str, batch_id: str, rs: list[Any], final: bool = False) -> dict[str, np.ndarray]:
    """A prefill `results` event for finished records (anything with PrefillResult's fields)."""
    out = {
        W.P_EVENT: b1("results"),
        W.P_BATCH_ID: b1(batch_id),
        W.P_EPOCH: b1(epoch),
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


def p_event(
    epoch: str, kind: str, batch_id: str, *, queue_position: int = 0, errors: list[str] | None = None
) -> dict[str, np.ndarray]:
    """`accepted`, `final` and `error` carry only their own tensors: each omitted one is
    work saved in this process, the Python-backend stub, Triton and the gateway, three times
    per batch (docs/worker-protocol.md §4.3)."""
    out = {
        W.P_EVENT: b1(kind),
        W.P_BATCH_ID: b1(batch_id),
        W.P_EPOCH: b1(epoch),
        W.P_QUEUE_POSITION: np.array([queue_position], dtype=np.int32),
    }
    if errors:
        out[W.P_ERROR] = bytes_arr(errors)
    return out


def d_finish(reason: str, generated: int, error: str, t_ms: float = 0.0) -> dict[str, np.ndarray]:
    """A decode `finish` event (the last chunk, when it rides along, is added by the caller)."""
    return {
        W.D_EVENT: b1("finish"),
        W.D_T_FIRST_MS: np.array([t_ms], dtype=np.float64),
        W.D_T_LAST_MS: np.array([t_ms], dtype=np.float64),
        W.D_FINISH_REASON: b1(str(reason)),
        W.D_GENERATED: np.array([generated], dtype=np.int32),
        W.D_ERROR: b1(error),
    }


def hard_exit() -> None:
    """Die like a crashed GPU process: take the Triton server down with us, no clean-up."""
    with contextlib.suppress(Exception):
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                child.kill()
    os._exit(70)
