"""Pure discrete-event model of one prefill GPU: a FIFO of batches run one at a time.

No asyncio, threads or wall clock: the driver passes modelled time in (`advance_to`) and gets
effects out, so the live Triton worker and the cluster simulator run exactly this code.

KV accounting: capacity = cached blocks (evictable or pinned) + `held` tokens outside the cache
(the compute of the running batch, and the uncached tail of prefilled requests whose KV still
waits for the decode side). A batch starts only when its compute fits; it never fails for lack
of room that expiring handles will free.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from app.protocol.blocks import hit_blocks_cap
from app.protocol.codes import EngineStatus
from app.scheduling.formula import BatchItem

from .effects import BatchDone, BatchStarted, Effect, ExitRequested, KvReleased, PrefillResult
from .faults import Faults
from .kv_handles import KvHandles
from .prefill_state import INF, Batch, Member, Pinned, PrefillRequest, SubmitOutcome
from .prefix_cache import CacheDiff, PrefixCache
from .profiles import EngineProfile
from .tokens import output_tokens


class PrefillEngine:
    def __init__(
        self,
        profile: EngineProfile,
        *,
        block_size: int = 64,
        seed: int = 0,
        kv_capacity_tokens: int | None = None,
        kv_handle_ttl_ms: float = 30_000.0,
        tombstone_ttl_ms: float = 60_000.0,
        history_limit: int = 4096,
        faults: Faults | None = None,
    ) -> None:
        self.profile = profile
        self.block_size = block_size
        self.seed = seed
        self.capacity = kv_capacity_tokens or profile.kv_capacity_tokens
        self.kv_handle_ttl_ms = kv_handle_ttl_ms
        self.tombstone_ttl_ms = tombstone_ttl_ms
        self.history_limit = history_limit
        self.faults = faults or Faults()
        self.cache = PrefixCache(self.capacity, block_size)
        self.now = 0.0
        self.seq = 0
        self.batches_done = 0
        # The most batches held at once (running + queued) since start or `reset`: an owner's
        # in-flight cap is proved on the worker by this high-water mark, which a poller sampling
        # `live` every few ms can miss when two batches overlap only briefly.
        self.max_live_batches = 0
        self._rng = random.Random(seed)
        self._queue: deque[Batch] = deque()
        self._running: Batch | None = None
        self._batches: OrderedDict[str, Batch] = OrderedDict()  # every known batch id (bounded)
        self._req_batch: dict[str, str] = {}  # live request id -> batch id
        self._held = 0  # tokens outside the cache: the running batch's compute and pinned tails
        self.handles = KvHandles(self.cache, history_limit)
        self._tombstones: OrderedDict[str, float] = OrderedDict()  # id -> expiry
        self.history: deque[PrefillResult] = deque()
        self._exit_sent = False
        # A completed batch's cache work (blocks inserted and pinned for its KV handles, its
        # compute released) when `advance_early` left it for the next call; see `_settle`.
        self._unsettled: list[tuple[Batch, list[tuple[str, Member, float]]]] = []

    # ---- inputs --------------------------------------------------------------------------
    def submit(self, batch_id: str, requests: Sequence[PrefillRequest], now: float) -> SubmitOutcome:
        """Queue a batch. Idempotent by batch id; bad members fail alone with a typed status."""
        effects = self.advance_to(now)
        if batch_id in self._batches:
            b = self._batches[batch_id]
            return SubmitOutcome(True, True, self._position(b), effects)
        if self._tombstoned(batch_id):
            res = [
                self._finish(
                    batch_id, r.request_id, EngineStatus.CANCELLED, r.input_tokens, "batch cancelled"
                )
                for r in requests
            ]
            return SubmitOutcome(
                False, False, -1, [*effects, *res, BatchDone(batch_id, now)], EngineStatus.CANCELLED
            )
        if not requests:
            return SubmitOutcome(False, False, -1, effects, EngineStatus.INVALID)
        members: dict[str, Member] = {}
        limit = min(self.capacity, self.profile.max_context_tokens)
        for r in requests:
            status, err = EngineStatus.OK, ""
            if r.input_tokens <= 0:
                status, err = EngineStatus.INVALID, "empty prompt"
            elif r.input_tokens > limit:
                status, err = EngineStatus.TOO_LONG, f"{r.input_tokens} tokens exceed capacity {limit}"
            elif len(r.block_keys) != r.input_tokens // self.block_size:
                status, err = EngineStatus.INVALID, "block_keys do not match input length"
            elif r.request_id in members or r.request_id in self._req_batch or r.request_id in self.handles:
                status, err = EngineStatus.DUPLICATE, "request id already live on this engine"
            elif self._tombstoned(r.request_id):
                status, err = EngineStatus.CANCELLED, "cancelled before arrival"
            if status is EngineStatus.OK:
                members[r.request_id] = Member(r)
            else:
                effects.append(self._finish(batch_id, r.request_id, status, r.input_tokens, err))
        b = Batch(batch_id, members, now)
        self._remember_batch(b)
        if not members:
            b.phase = "done"
            effects.append(BatchDone(batch_id, now))
            return SubmitOutcome(True, False, 0, effects)
        for rid in members:
            self._req_batch[rid] = batch_id
        self._queue.append(b)
        held = len(self._queue) + (self._running is not None)
        self.max_live_batches = max(self.max_live_batches, held)
        pos = self._position(b)
        effects.extend(self._pump())
        return SubmitOutcome(True, False, pos, effects)

    def cancel(self, some_id: str, now: float) -> tuple[str, list[Effect]]:
        """Cancel a batch or request id in any state; unknown ids become tombstones so a late
        arrival is refused. Returns (what happened, effects)."""
        effects = self.advance_to(now)
        if some_id in self._batches:
            b = self._batches[some_id]
            if b.phase == "done":
                return "finished", effects
            for rid in list(b.members):
                effects.extend(self._cancel_member(b, rid))
            return "cancelled", effects
        bid = self._req_batch.get(some_id)
        if bid is not None:
            effects.extend(self._cancel_member(self._batches[bid], some_id))
            return "cancelled", effects
        if some_id in self.handles:
            effects.append(self._unpin(some_id, "cancelled"))
            effects.extend(self._pump())
            return "released", effects
        self._tombstones[some_id] = now + self.tombstone_ttl_ms
        self._tombstones.move_to_end(some_id)
        return "tombstoned", effects

    def release(self, request_id: str, now: float) -> tuple[str, list[Effect]]:
        """Decode fetched the KV: unpin it. Answers kv_expired if the handle already lapsed."""
        effects = self.advance_to(now)
        if request_id in self.handles:
            effects.append(self._unpin(request_id, "released"))
            effects.extend(self._pump())
            return EngineStatus.OK, effects
        if self.handles.expired(request_id):
            return EngineStatus.KV_EXPIRED, effects
        return EngineStatus.UNKNOWN, effects

    def configure(
        self,
        now: float,
        *,
        faults: Faults | None = None,
        profile: EngineProfile | None = None,
        kv_capacity_tokens: int | None = None,
        kv_handle_ttl_ms: float | None = None,
    ) -> list[Effect]:
        effects = self.advance_to(now)
        if faults is not None:
            was_hung = self.faults.hang
            self.faults = faults
            if was_hung and not faults.hang and self._running is not None:
                self._running.end_ms = max(self._running.end_ms, now)
        if profile is not None:
            self.profile = profile
        if kv_capacity_tokens is not None:
            self.capacity = kv_capacity_tokens
            self.cache.capacity_tokens = kv_capacity_tokens
            self.cache.shrink_to(self.capacity - self._held)
        if kv_handle_ttl_ms is not None:
            self.kv_handle_ttl_ms = kv_handle_ttl_ms
        effects.extend(self._pump())
        return effects

    def reset(self, now: float) -> list[Effect]:
        """Forget all work and cache (tests reuse one worker); seq and cache version keep
        increasing so pollers never see a number twice."""
        effects: list[Effect] = self._settle()
        for b in [*([self._running] if self._running else []), *self._queue]:
            for rid in list(b.members):
                effects.extend(self._cancel_member(b, rid))
        for rid in list(self.handles.pinned):
            effects.append(self._unpin(rid, "reset"))
        self.cache.clear()
        self._queue.clear()
        self._running = None
        self._held = 0
        self.handles.clear()
        self._tombstones.clear()
        self._exit_sent = False
        self.batches_done = 0
        self.max_live_batches = 0
        self.faults = Faults()
        self._rng = random.Random(self.seed)
        self.now = max(self.now, now)
        return effects

    # ---- time ----------------------------------------------------------------------------
    def next_event_time(self) -> float | None:
        if self.faults.hang:
            return None
        t = INF
        if self._running is not None:
            t = self._running.end_ms
        exp = self.handles.next_expiry()
        if exp is not None and exp < t:
            t = exp
        return None if t == INF else t

    def advance_to(self, t: float) -> list[Effect]:
        return self._advance(t, early=False)

    def advance_early(self, t: float) -> list[Effect]:
        """`advance_to`, but it returns right after a batch completes with none queued, before
        the batch's cache work (~0.5-1 ms for 8 x 8K here): the driver routes the results first.
        The next mutator or `advance_*` does the work at the completion's modelled time (the
        same outcome as `advance_to`); until then `unsettled` is True and views do not show it."""
        return self._advance(t, early=True)

    @property
    def unsettled(self) -> bool:
        """A completed batch's cache work is still to be done (`advance_early`)."""
        return bool(self._unsettled)

    def _advance(self, t: float, *, early: bool) -> list[Effect]:
        effects = self._settle()
        if self.faults.hang:
            self.now = max(self.now, t)
            return effects
        while True:
            nxt = self.next_event_time()
            if nxt is None or nxt > t:
                break
            self.now = max(self.now, nxt)
            if self._running is not None and self._running.end_ms <= nxt:
                effects.extend(self._complete(self._running))
                if early and not self._queue:  # a queued batch waits for the work: no deferral
                    return effects  # self.now stays at the completion: `_settle` works there
                self._cache_work()
            while (rid := self.handles.pop_due(self.now)) is not None:
                effects.append(self._unpin(rid, "expired"))
            effects.extend(self._pump())
        self.now = max(self.now, t)
        return effects

    def _settle(self) -> list[Effect]:
        """The cache work `advance_early` left, then the rest of the completion's instant as
        `_advance` would have done it: handles due by then expire, the next batch starts."""
        if not self._unsettled:
            return []
        self._cache_work()
        effects: list[Effect] = []
        while (rid := self.handles.pop_due(self.now)) is not None:
            effects.append(self._unpin(rid, "expired"))
        effects.extend(self._pump())
        return effects

    # ---- views ---------------------------------------------------------------------------
    def kv_view(self) -> dict[str, int]:
        used = self.cache.used_tokens + self._held
        pinned = self.cache.pinned_tokens + self.handles.outside_tokens
        return {
            "kv_total_tokens": self.capacity,
            "kv_free_tokens": max(0, self.capacity - used),
            "kv_evictable_tokens": self.cache.evictable_tokens,
            "kv_pinned_tokens": pinned,
        }

    def live_view(self) -> list[dict[str, Any]]:
        out = []
        for b in [*([self._running] if self._running else []), *self._queue]:
            out.append(
                {
                    "batch_id": b.batch_id,
                    "phase": b.phase,
                    "request_ids": [rid for rid, m in b.members.items() if not m.done],
                    "start_ms": b.start_ms if b.phase == "running" else None,
                    "predicted_ms": b.predicted_ms,
                }
            )
        return out

    def records_since(self, since_seq: int, limit: int = 1000) -> tuple[bool, list[PrefillResult]]:
        """Finished records after `since_seq`; resync=True when some were already dropped."""
        oldest = self.history[0].seq if self.history else self.seq + 1
        resync = since_seq < oldest - 1
        out: list[PrefillResult] = []
        for r in self.history:  # bounded deque; scanning from the left is cheap enough
            if r.seq > since_seq:
                out.append(r)
                if len(out) >= limit:
                    break
        return resync, out

    def cache_diff(self, since_version: int | None) -> CacheDiff:
        return self.cache.diff_since(since_version)

    def queued_predicted_ms(self) -> float:
        total = sum(self._predict(b) for b in self._queue)
        if self._running is not None:
            total += max(0.0, self._running.end_ms - self.now)
        return total

    def pinned_ids(self) -> list[str]:
        return list(self.handles.pinned)

    # ---- internals -----------------------------------------------------------------------
    def _position(self, b: Batch) -> int:
        if b is self._running:
            return 0
        for i, q in enumerate(self._queue):
            if q is b:
                return i + (1 if self._running else 0)
        return -1

    def _remember_batch(self, b: Batch) -> None:
        self._batches[b.batch_id] = b
        while len(self._batches) > self.history_limit * 2:
            old_id, old = next(iter(self._batches.items()))
            if old.phase != "done":
                break
            del self._batches[old_id]

    def _tombstoned(self, some_id: str) -> bool:
        exp = self._tombstones.get(some_id)
        while self._tombstones:
            k, e = next(iter(self._tombstones.items()))
            if e > self.now:
                break
            del self._tombstones[k]
        return exp is not None and exp > self.now

    def _predict(self, b: Batch) -> float:
        items = []
        for m in b.members.values():
            if m.done:
                continue
            hit = min(
                self.cache.match_prefix(m.req.block_keys), hit_blocks_cap(m.req.input_tokens, self.block_size)
            )
            items.append(BatchItem(m.req.input_tokens, hit * self.block_size))
        return self.profile.prefill_batch_ms(items) + self.faults.extra_latency_ms if items else 0.0

    def _pump(self) -> list[Effect]:
        """Start the next queued batch when the engine is free and its compute fits in KV."""
        effects: list[Effect] = []
        while self._running is None and self._queue and not self.faults.hang:
            b = self._queue[0]
            live = [m for m in b.members.values() if not m.done]
            if not live:
                self._queue.popleft()
                b.phase = "done"
                effects.append(BatchDone(b.batch_id, self.now))
                continue
            items = []
            need = 0
            for m in live:
                cap = hit_blocks_cap(m.req.input_tokens, self.block_size)
                hit = min(self.cache.match_prefix(m.req.block_keys), cap)
                m.hit_keys = m.req.block_keys[:hit]
                m.cached_tokens = hit * self.block_size
                items.append(BatchItem(m.req.input_tokens, m.cached_tokens))
                need += m.req.input_tokens - m.cached_tokens
            for m in live:
                self.cache.pin(m.hit_keys)
            room = self.capacity - self._held - self.cache.used_tokens + self.cache.evictable_tokens
            if need > room:
                for m in live:
                    self.cache.unpin(m.hit_keys)
                break  # waits for handles to be released or to expire
            self._queue.popleft()
            self.cache.shrink_to(self.capacity - self._held - need)
            self._held += need
            b.compute_tokens = need
            b.phase = "running"
            b.start_ms = self.now
            b.predicted_ms = self.profile.prefill_batch_ms(items) + self.faults.extra_latency_ms
            b.end_ms = self.now + b.predicted_ms
            self._running = b
            effects.append(BatchStarted(b.batch_id, self.now, b.predicted_ms))
        return effects

    def _complete(self, b: Batch) -> list[Effect]:
        """The batch's results; its cache work is queued for `_cache_work` (the results do not
        depend on it, and the fault draws and the insert order are the same either way)."""
        effects: list[Effect] = []
        self._running = None
        b.phase = "done"
        work: list[tuple[str, Member, float]] = []  # expiry < 0: a failed member (unpin only)
        for rid, m in b.members.items():
            if m.done:
                continue
            m.done = True
            self._req_batch.pop(rid, None)
            if self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate:
                work.append((rid, m, -1.0))
                effects.append(
                    self._finish(
                        b.batch_id,
                        rid,
                        EngineStatus.ENGINE_ERROR,
                        m.req.input_tokens,
                        "injected engine fault",
                        m.cached_tokens,
                        b.start_ms,
                    )
                )
                continue
            expiry = self.now + self.kv_handle_ttl_ms
            work.append((rid, m, expiry))
            effects.append(
                self._finish(
                    b.batch_id,
                    rid,
                    EngineStatus.OK,
                    m.req.input_tokens,
                    "",
                    m.cached_tokens,
                    b.start_ms,
                    expiry,
                )
            )
        self._unsettled.append((b, work))
        effects.append(BatchDone(b.batch_id, self.now))
        self.batches_done += 1
        if (
            self.faults.exit_after_batches
            and self.batches_done >= self.faults.exit_after_batches
            and not self._exit_sent
        ):
            self._exit_sent = True
            effects.append(ExitRequested(self.now))
        return effects

    def _cache_work(self) -> None:
        """Completed batches' KV: their compute is released, each finished member's blocks are
        inserted (pinned for its KV handle; what does not fit stays held outside the cache) and
        its prefix hits unpinned."""
        pending, self._unsettled = self._unsettled, []
        for b, work in pending:
            self._held -= b.compute_tokens
            for rid, m, expiry in work:
                if expiry < 0:
                    self.cache.unpin(m.hit_keys)
                    continue
                present = self.cache.insert(
                    m.req.block_keys, pin=True, budget_tokens=self.capacity - self._held
                )
                self.cache.unpin(m.hit_keys)
                outside = m.req.input_tokens - len(present) * self.block_size
                self._held += outside
                self.handles.pin(rid, Pinned(present, outside, expiry))

    def _cancel_member(self, b: Batch, rid: str) -> list[Effect]:
        m = b.members.get(rid)
        if m is None or m.done:
            return []
        m.done = True
        self._req_batch.pop(rid, None)
        effects: list[Effect] = [
            self._finish(
                b.batch_id,
                rid,
                EngineStatus.CANCELLED,
                m.req.input_tokens,
                "cancelled",
                0,
                b.start_ms if b.phase == "running" else self.now,
            )
        ]
        if b.phase == "running":
            self.cache.unpin(m.hit_keys)
            if all(x.done for x in b.members.values()):
                # Whole running batch cancelled: the engine stops it and moves on.
                self._running = None
                self._held -= b.compute_tokens
                b.phase = "done"
                effects.append(BatchDone(b.batch_id, self.now))
                effects.extend(self._pump())
        elif b.phase == "queued" and all(x.done for x in b.members.values()):
            self._queue.remove(b)
            b.phase = "done"
            effects.append(BatchDone(b.batch_id, self.now))
        return effects

    def _unpin(self, rid: str, reason: str) -> KvReleased:
        self._held -= self.handles.unpin(rid, reason, self.now).outside_tokens
        return KvReleased(rid, reason, self.now)

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
        self.seq += 1
        first = output_tokens(self.seed, rid, 0, 1)[0] if status == EngineStatus.OK else 0
        r = PrefillResult(
            batch_id,
            rid,
            str(status),
            first,
            input_tokens,
            cached,
            self.now if start is None else start,
            self.now,
            expiry,
            self.seq,
            error,
        )
        self.history.append(r)
        if len(self.history) > self.history_limit:
            self.history.popleft()
        return r
