"""The worker's Triton models over a real Hugging Face model (`flexlb worker --engine hf`).

The same three models, tensors and statuses as the simulated worker (docs/worker-protocol.md), so
the gateway, the batcher and the routing strategies need no change. `HfWorkerService` is
`WorkerService` with four things swapped:

- the engine core: `HfPrefillEngine` / `HfDecodeEngine` (workers/engine/hf_*.py) run real forward
  passes on the engine thread, which `EngineRunner` drives: blocking torch work never runs on an
  event loop, and control calls, joins and cancels are served between forward passes;
- a prefill member carries its tokens and sampling fields (`temperature`, `top_p`, `seed`);
- the decode side *fetches* the KV over the side channel as a binary frame (kv_frames.py) instead
  of only claiming the handle: a bad frame ends the stream `kv_expired` with a `kv_frame_invalid`
  error, so the gateway re-runs the prefill once (the handle is gone either way);
- `status` adds the engine's own counters (`engine_stats`: computed tokens, forward passes, ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any

import numpy as np

from app.protocol import worker_api as W
from app.protocol.codes import EngineStatus
from workers.engine.decode import DecodeRequest
from workers.engine.hf_decode import HfDecodeEngine, HfDecodeRequest
from workers.engine.hf_model import HfModel, Sampling
from workers.engine.hf_prefill import HfPrefillEngine, HfPrefillRequest
from workers.engine.prefill import PrefillRequest
from workers.engine.profiles import EngineProfile, get_profile

from . import kv_frames
from .common import WorkerConfig, d_finish
from .service import WorkerService
from .tensors import get

log = logging.getLogger("flexlb.worker.hf")

HF_KV_TOKENS = 32_768  # default KV budget of a real engine: the prefix cache, handles and decode


class HfWorkerService(WorkerService):
    def __init__(self, cfg: WorkerConfig, model: HfModel, stopping: threading.Event | None = None) -> None:
        self.model = model  # before the base class builds the core
        super().__init__(cfg, stopping)

    def _new_core(self) -> Any:
        clock = self._clock
        if self.cfg.role == "prefill":
            return HfPrefillEngine(
                self.model,
                self.profile,
                clock=clock,
                wake=self._wake,
                block_size=self.cfg.block_size,
                seed=self.cfg.seed,
                kv_capacity_tokens=self.cfg.kv_capacity_tokens,
                kv_handle_ttl_ms=self.cfg.kv_handle_ttl_ms,
                faults=self.cfg.faults,
            )
        return HfDecodeEngine(
            self.model,
            self.profile,
            clock=clock,
            seed=self.cfg.seed,
            kv_capacity_tokens=self.cfg.kv_capacity_tokens,
            faults=self.cfg.faults,
        )

    def _profile(self, name: str, formula: str | None, cap: int | None) -> EngineProfile:
        """The profile still predicts batch times for the gateway's status view; its context
        limit and KV size come from the model, and the KV budget defaults to HF_KV_TOKENS."""
        p = get_profile(name, formula=formula, kv_capacity_tokens=cap or HF_KV_TOKENS)
        return dataclasses.replace(
            p,  # type: ignore[type-var]
            max_context_tokens=min(p.max_context_tokens, self.model.max_context),
            kv_bytes_per_token=self.model.kv_bytes_per_token,
        )

    def _clock(self) -> float:
        return self.runner.model_now()

    def _wake(self) -> None:
        """From the compute thread: the engine thread wakes to complete the computed batch."""
        self.runner.wake()

    def _kv_fetch_handler(self) -> Any:
        return self._fetch_local

    def _core_d(self) -> Any:
        return self.core

    # ---- prefill ----------------------------------------------------------------------------
    needs_input_ids = True  # the model computes on the tokens: block keys alone are refused

    def _prefill_request(
        self, req: Any, i: int, rid: str, n: int, toks: np.ndarray | None, keys: tuple[int, ...]
    ) -> PrefillRequest:
        assert toks is not None  # _parse_prefill refuses a batch without ids (needs_input_ids)
        return HfPrefillRequest(rid, n, keys, tokens=tuple(toks.tolist()), sampling=_sampling(req, i, None))

    async def _fetch_local(self, rid: str, epoch: str) -> tuple[str, bytes | None]:
        """Side channel, prefill side: hand over the handle's KV frame and release the handle."""
        await self._wait_unhung()
        if epoch and epoch != self.epoch:
            return EngineStatus.EPOCH_MISMATCH, None
        core = self.core
        assert isinstance(core, HfPrefillEngine)

        def take() -> tuple[str, Any]:
            status, held, effects = core.fetch(rid, self.runner.model_now())
            self._route(effects)
            return status, held

        status, held = await self.runner.call(take)
        if status != EngineStatus.OK or held is None:
            return str(status), None
        frame = kv_frames.KvFrame(rid, held.kv, held.first_token, held.sampling)
        data = await asyncio.to_thread(kv_frames.encode, frame)
        return EngineStatus.OK, _inject(data, core.faults.kv_frame)

    # ---- decode -----------------------------------------------------------------------------
    async def _acquire_kv(
        self, dreq: DecodeRequest, req: Any, kv_worker: str, kv_epoch: str
    ) -> DecodeRequest | dict[str, np.ndarray]:
        rid = dreq.request_id
        if not kv_worker:
            err = "kv_worker is required: a real decode needs the prefill KV"
            return d_finish(EngineStatus.INVALID, 0, err)
        try:
            status, frame = await asyncio.wrap_future(
                self.side.submit(self.kv_client.fetch(kv_worker, rid, kv_epoch))
            )
        except Exception as exc:  # the prefill side is gone, or the frame was cut: the KV is lost
            log.warning("kv fetch from %s failed: %s", kv_worker, exc or type(exc).__name__)
            status, frame = "unreachable", None
        if status != EngineStatus.OK or frame is None:
            err = f"KV handle on {kv_worker} is no longer valid ({status})"
            return d_finish(EngineStatus.KV_EXPIRED, 0, err)
        try:
            got = await asyncio.to_thread(kv_frames.decode, frame, self.model.device)
            if got.request_id != rid:
                raise kv_frames.KvFrameError(f"frame is for {got.request_id!r}")
            if got.tokens != dreq.input_tokens:
                raise kv_frames.KvFrameError(f"frame holds {got.tokens} tokens, not {dreq.input_tokens}")
            if got.kv.dtype != self.model.dtype or list(got.kv.shape[:3]) != [
                self.model.layers,
                2,
                self.model.kv_heads,
            ]:
                raise kv_frames.KvFrameError("frame does not fit this model")
        except kv_frames.KvFrameError as exc:
            return d_finish(EngineStatus.KV_EXPIRED, 0, f"kv_frame_invalid: {exc}")
        return HfDecodeRequest(
            rid,
            dreq.input_tokens,
            dreq.max_new_tokens,
            first_index=dreq.first_index,
            kv=got.kv,
            first_token=got.first_token,
            sampling=_sampling(req, 0, got.sampling),
        )

    # ---- control ----------------------------------------------------------------------------
    def _status(self, since_seq: int) -> dict[str, Any]:
        st = super()._status(since_seq)
        st["engine"] = "hf"
        st["engine_stats"] = {
            **self.core.stats(),
            "model": str(self.model.path),
            "params": self.model.params,
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }
        return st


def _inject(data: bytes, fault: str) -> bytes:
    """Fault `kv_frame`: damage the frame as a broken link or memory would (tests cause the decode
    side's checks for real this way)."""
    if fault == "corrupt":
        i = len(data) // 2
        return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
    if fault == "truncate":
        return data[: len(data) * 2 // 3]
    return data


def _sampling(req: Any, i: int, base: Sampling | None) -> Sampling:
    """Request `i`'s sampling from the optional tensors; `base` (the frame's) where absent."""
    t, p, s = get(req, W.P_TEMPERATURE), get(req, W.P_TOP_P), get(req, W.P_SEED)
    b = base or Sampling()

    def pick(arr: np.ndarray | None, default: float) -> float:
        if arr is None:
            return default
        flat = arr.reshape(-1)
        return float(flat[i]) if i < len(flat) else default

    temperature = max(0.0, pick(t, b.temperature))
    top_p = min(1.0, max(0.0, pick(p, b.top_p))) or 1.0
    return Sampling(temperature, top_p, int(pick(s, b.seed)))
