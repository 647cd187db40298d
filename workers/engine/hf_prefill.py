"""The prefill engine with a real model: the simulated core's bookkeeping, real compute.

`HfPrefillEngine` subclasses `PrefillEngine`, so everything the gateway relies on stays the same
code: FIFO of batches, idempotency by batch id, tombstones, cancel, KV handles with expiry, the
prefix cache of chained block keys with its versioned diffs, finished records and the KV accounting
in tokens (the `--kv-capacity-tokens` budget). What changes:

- a batch that starts is computed for real, in one forward pass (`HfModel.prefill`), the next time
  the driver advances the engine; it ends when the compute has ended (the injected clock), so
  `end_ms - start_ms` is measured time, not a profile's prediction;
- a cached leading block is not recomputed: its KV comes from the block store, and only the
  uncached tokens go through the model (`computed_tokens` counts them);
- the first token is sampled from the last position's logits by the request's sampling fields;
- each handle keeps its request's KV tensor until the decode side fetches it (`fetch`), it is
  released or cancelled, or it expires.

The block store holds one KV slice per cached key; it follows the cache's own diff log, so an
evicted key frees its tensor and the cache and the store never disagree.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from app.protocol.blocks import hit_blocks_cap
from app.protocol.codes import EngineStatus

from .effects import BatchStarted, Effect, PrefillResult
from .faults import Faults
from .hf_model import GREEDY, HfModel, Sampling, sample_token
from .prefill import INF, PrefillEngine, PrefillRequest
from .profiles import EngineProfile

log = logging.getLogger("flexlb.worker.hf")


@dataclass(frozen=True, slots=True)
class HfPrefillRequest(PrefillRequest):
    """A prefill request with what real compute needs: the token ids and the sampling fields."""

    tokens: tuple[int, ...] = ()
    sampling: Sampling = GREEDY


@dataclass(frozen=True, slots=True)
class HeldKv:
    """What a KV handle holds: the prompt's KV and what decode needs to continue the stream."""

    request_id: str
    kv: torch.Tensor  # [layers, 2, kv_heads, input_tokens, head_dim]
    first_token: int
    sampling: Sampling


class HfPrefillEngine(PrefillEngine):
    def __init__(
        self,
        model: HfModel,
        profile: EngineProfile,
        *,
        clock: Callable[[], float],
        wake: Callable[[], Any] | None = None,
        block_size: int = 64,
        seed: int = 0,
        kv_capacity_tokens: int | None = None,
        kv_handle_ttl_ms: float = 30_000.0,
        faults: Faults | None = None,
    ) -> None:
        super().__init__(
            profile,
            block_size=block_size,
            seed=seed,
            kv_capacity_tokens=kv_capacity_tokens,
            kv_handle_ttl_ms=kv_handle_ttl_ms,
            faults=faults,
        )
        self.model = model
        self.clock = clock  # the driver's modelled clock (wall ms at time scale 1)
        self._blocks: dict[int, torch.Tensor] = {}
        self._synced = self.cache.version
        self._held_kv: dict[str, HeldKv] = {}
        self._out: dict[str, tuple[int, torch.Tensor, Sampling]] = {}
        self._pending: Any = None  # started, its compute not yet handed over
        # One compute thread: forward passes run one at a time, off the engine thread.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf-prefill")
        self._inflight: tuple[Any, list[Any], Future[Any], float] | None = None
        self.wake = wake  # the driver's nudge: a finished compute completes its batch at once
        self._done_at = 0.0
        self._advancing = False
        self.computed_tokens = 0  # prompt tokens that went through the model
        self.cached_tokens_total = 0  # prompt tokens whose KV came from the block store
        self.forward_passes = 0
        self.compute_ms_total = 0.0

    # ---- the decode side fetches a handle ----------------------------------------------------
    def fetch(self, request_id: str, now: float) -> tuple[str, HeldKv | None, list[Effect]]:
        """Hand over a pinned handle's KV and release it (the same statuses as `release`)."""
        effects = self.advance_to(now)
        held = self._held_kv.get(request_id) if request_id in self.handles else None
        status, more = self.release(request_id, now)
        return status, held if status == EngineStatus.OK else None, effects + more

    def stats(self) -> dict[str, Any]:
        return {
            "engine": "hf",
            "computed_tokens": self.computed_tokens,
            "cached_tokens_total": self.cached_tokens_total,
            "forward_passes": self.forward_passes,
            "compute_ms_total": round(self.compute_ms_total, 3),
            "kv_blocks_stored": len(self._blocks),
            "kv_handles_held": len(self._held_kv),
        }

    # ---- time: compute the started batch, then let the core complete it ------------------------
    def next_event_time(self) -> float | None:
        if not self._advancing and not self.faults.hang:
            # Due times are when the event became due, so the driver's lag_ms stays honest.
            if self._pending is not None and self._inflight is None:
                return float(self._pending.start_ms)  # a started batch waits for its compute
            if self._inflight is not None and self._inflight[2].done():
                return self._done_at  # its compute ended: complete it now
        return super().next_event_time()

    def _advance(self, t: float, *, early: bool) -> list[Effect]:
        """Both entry points come here (`advance_to`, and `advance_early`, which the worker's
        engine thread calls): an ended compute gives its batch the measured end, a started batch
        gets its forward pass, then the core completes what is due. Settled first, so a batch
        that the previous completion's deferred work starts is computed in this same call."""
        effects = self._settle()
        if not self.faults.hang:
            if self._inflight is not None and self._inflight[2].done():
                effects.extend(self._finish_compute())
                t = max(t, self.clock())
            if self._pending is not None and self._inflight is None:
                b, self._pending = self._pending, None
                effects.extend(self._start_compute(b))
        self._advancing = True
        try:
            effects.extend(super()._advance(t, early=early))
        finally:
            self._advancing = False
        return effects

    def _pump(self) -> list[Effect]:
        # A batch whose uncached tokens exceed the whole budget can never fit, so the simulated
        # rule (wait for room) would stall this worker for good. When nothing is held (no running
        # batch, no pinned handle), memory is really there: let it run over the budget, once.
        over = self._oversized_head()
        saved = self.capacity
        if over:
            self.capacity = over
        try:
            effects = super()._pump()
        finally:
            self.capacity = saved
        for e in effects:
            if isinstance(e, BatchStarted) and self._running is not None:
                self._running.end_ms = INF  # known once computed
                self._pending = self._running
        return effects

    def _oversized_head(self) -> int:
        """The head batch's footprint (its uncached tokens plus the cached blocks it pins) when it
        exceeds the budget and the engine holds nothing, else 0."""
        if self._running is not None or not self._queue or self._held or self.cache.pinned_tokens:
            return 0
        bs = self.block_size
        need, hits = 0, set()
        for m in self._queue[0].members.values():
            if m.done:
                continue
            h = min(self.cache.match_prefix(m.req.block_keys), hit_blocks_cap(m.req.input_tokens, bs))
            hits.update(m.req.block_keys[:h])
            need += m.req.input_tokens - h * bs
        footprint = need + len(hits) * bs
        return footprint if footprint > self.capacity else 0

    def _start_compute(self, b: Any) -> list[Effect]:
        """Hand the batch's forward pass to the compute thread. The engine thread stays free for
        status polls, claims and cancels meanwhile: a long prefill must not read as a dead worker."""
        live = [m for m in b.members.values() if not m.done]
        if not live:
            b.end_ms = self.now
            return []
        items: list[tuple[torch.Tensor | None, list[int]]] = []
        try:
            for m in live:
                req = m.req
                assert isinstance(req, HfPrefillRequest)
                prefix = torch.cat([self._blocks[k] for k in m.hit_keys], dim=3) if m.hit_keys else None
                items.append((prefix, list(req.tokens[m.cached_tokens :])))
        except Exception as exc:  # a missing block fails its batch, never the engine thread
            log.exception("prefill inputs failed")
            return self._fail_batch(b, f"prefill inputs failed: {type(exc).__name__}: {exc}"[:300])
        fut = self._executor.submit(self.model.prefill, items)
        fut.add_done_callback(self._computed)
        self._inflight = (b, live, fut, self.clock())
        return []

    def _computed(self, _fut: Future[Any]) -> None:
        """Compute thread: note when it ended (one float write) and wake the driver."""
        self._done_at = self.clock()
        if self.wake is not None:
            self.wake()

    def _finish_compute(self) -> list[Effect]:
        assert self._inflight is not None
        b, live, fut, t0 = self._inflight
        self._inflight = None
        t1 = self.clock()
        if b.phase == "done":  # cancelled (or reset) while it computed: nothing to deliver
            return []
        exc = fut.exception()
        if exc is not None:
            log.error("prefill forward pass failed: %r", exc)
            return self._fail_batch(b, f"forward pass failed: {type(exc).__name__}: {exc}"[:300])
        self.forward_passes += 1
        self.compute_ms_total += t1 - t0
        for m, (logits, kv) in zip(live, fut.result(), strict=True):
            req = m.req
            assert isinstance(req, HfPrefillRequest)
            self.computed_tokens += req.input_tokens - m.cached_tokens
            self.cached_tokens_total += m.cached_tokens
            if m.done:  # cancelled while it computed
                continue
            sampling = req.sampling
            if sampling.temperature > 0 and sampling.seed < 0:
                sampling = Sampling(sampling.temperature, sampling.top_p, self._request_seed(req.request_id))
            self._out[req.request_id] = (sample_token(logits, sampling, 0), kv, sampling)
        b.end_ms = t1 + self.faults.extra_latency_ms
        b.predicted_ms = b.end_ms - b.start_ms
        return []

    def _request_seed(self, request_id: str) -> int:
        """A request sampled without a seed gets one from (engine seed, request id)."""
        return zlib.crc32(f"{self.seed}:{request_id}".encode()) & 0x7FFF_FFFF

    def _fail_batch(self, b: Any, error: str) -> list[Effect]:
        effects: list[Effect] = []
        for rid, m in b.members.items():
            if m.done:
                continue
            m.done = True
            self._req_batch.pop(rid, None)
            self.cache.unpin(m.hit_keys)
            effects.append(
                self._finish(
                    b.batch_id, rid, EngineStatus.ENGINE_ERROR, m.req.input_tokens, error, 0, b.start_ms
                )
            )
        b.end_ms = self.clock()
        return effects

    def _complete(self, b: Any) -> list[Effect]:
        """The results, each OK one's KV held for its handle. Which blocks the cache takes is
        known only after the core's cache work (`_cache_work`, deferred by `advance_early`)."""
        effects = super()._complete(b)
        for e in effects:
            if not isinstance(e, PrefillResult):
                continue
            out = self._out.pop(e.request_id, None)
            if out is None or e.status != EngineStatus.OK:
                continue
            first, kv, sampling = out
            self._held_kv[e.request_id] = HeldKv(e.request_id, kv, first, sampling)
        return effects

    def _cache_work(self) -> None:
        """The core's cache work, then the block store follows it: each new handle's blocks that
        the cache took get their KV slice (a key already stored keeps its tensor), and evicted
        keys lose theirs. Part of the deferred work: the results leave before these copies."""
        done = [rid for _, work in self._unsettled for rid, _, expiry in work if expiry >= 0]
        super()._cache_work()
        bs = self.block_size
        for rid in done:
            held, pinned = self._held_kv.get(rid), self.handles.pinned.get(rid)
            if held is None or pinned is None:
                continue
            for i, key in enumerate(pinned.keys):
                if key not in self._blocks:
                    self._blocks[key] = held.kv[:, :, :, i * bs : (i + 1) * bs].clone()
        self._sync_blocks()

    def _finish(
        self,
        batch_id: str,
        rid: str,
        status: str,
        input_tokens: int,
        error: str,
        cached: int = 0,
        start: float | None = None,
        expiry: float = 0.0,
    ) -> PrefillResult:
        """As the simulated engine's, with the computed first token instead of a hashed one."""
        r = super()._finish(batch_id, rid, status, input_tokens, error, cached, start, expiry)
        out = self._out.get(rid)
        if status != EngineStatus.OK or out is None:
            return r if status != EngineStatus.OK else _with_first(self, r, 0)
        return _with_first(self, r, out[0])

    # ---- memory follows the cache --------------------------------------------------------------
    def _unpin(self, rid: str, reason: str) -> Any:
        ev = super()._unpin(rid, reason)
        self._held_kv.pop(rid, None)
        return ev

    def _cancel_member(self, b: Any, rid: str) -> list[Effect]:
        self._out.pop(rid, None)
        effects = super()._cancel_member(b, rid)
        if self._pending is b and b.phase == "done":
            self._pending = None  # the whole started batch was cancelled before its compute
        return effects

    def configure(self, now: float, **kw: Any) -> list[Effect]:
        effects = super().configure(now, **kw)
        self._sync_blocks()
        return effects

    def reset(self, now: float) -> list[Effect]:
        effects = super().reset(now)
        self._pending = None
        self._inflight = None  # a compute still running is dropped when it ends
        self._out.clear()
        self._sync_blocks()
        return effects

    def _sync_blocks(self) -> None:
        """Drop the tensors of keys the cache evicted since the last sync."""
        d = self.cache.diff_since(self._synced)
        if d.full:
            keep = set(d.added)
            for k in [k for k in self._blocks if k not in keep]:
                del self._blocks[k]
        else:
            for k in d.removed:
                self._blocks.pop(k, None)
        self._synced = d.version


def _with_first(engine: HfPrefillEngine, r: PrefillResult, first: int) -> PrefillResult:
    """Replace the record's first token, in the history too (the record was just appended)."""
    if r.first_token == first:
        return r
    fixed = PrefillResult(
        r.batch_id,
        r.request_id,
        r.status,
        first,
        r.input_tokens,
        r.cached_tokens,
        r.start_ms,
        r.end_ms,
        r.kv_expiry_ms,
        r.seq,
        r.error,
    )
    if engine.history and engine.history[-1] is r:
        engine.history[-1] = fixed
    return fixed
