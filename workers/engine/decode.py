"""Pure discrete-event model of one decode GPU with continuous batching.

Tokens accrue analytically: between changes of the running batch every sequence advances one
token per step of a fixed duration (recomputed from batch size and context at each change, and at
least every `REBASE_STEPS` steps so growing context slows steps down), so simulating an hour of
traffic costs events per *change*, not per token. Changes (admissions) take effect at the next
step boundary, as in a real engine; cancels free their KV at once.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass

from app.protocol.codes import FINISH_LENGTH, EngineStatus
from app.scheduling.formula import BatchItem

from .effects import DecodeChunk, DecodeFinished, Effect
from .faults import Faults
from .profiles import EngineProfile
from .tokens import output_tokens

REBASE_STEPS = 64
EPS = 1e-9


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    request_id: str
    input_tokens: int
    max_new_tokens: int  # tokens this engine generates
    first_index: int = 1  # index of the first generated token in the request's output stream
    kv_tokens: int = 0  # tokens fetched from prefill (defaults to input_tokens)
    # Ids of the prompt's full KV blocks of `block_size` tokens (chained: an id names its whole
    # prefix). Running sequences on this engine share a block they both name, as vLLM's and
    # SGLang's paged KV do on the decode side: it is held once. Empty: nothing shared.
    block_keys: tuple[int, ...] = ()
    block_size: int = 0


@dataclass(slots=True)
class _Seq:
    req: DecodeRequest
    need_kv: int
    gen_base: int = 0  # tokens generated at the current segment start
    emitted: int = 0  # tokens already handed to the driver
    phase: str = "fetching"  # fetching | waiting | running
    resume: int = 0  # tokens generated before a preemption (kept; recomputed, not regenerated)


#: How the engine admits a waiting sequence: `reserve` holds prompt + max_new_tokens of KV for it
#: from admission to its end (never preempts); `expected` admits on the KV it uses now (prompt +
#: generated) and, when the running batch's growth would overflow the KV, preempts the most
#: recently admitted sequence (vLLM's recompute policy): its KV is freed, it waits again, and on
#: readmission recomputes prompt + generated tokens (a prefill of that length) before going on.
ADMISSIONS = ("reserve", "expected")


class DecodeEngine:
    def __init__(
        self,
        profile: EngineProfile,
        *,
        seed: int = 0,
        kv_capacity_tokens: int | None = None,
        max_running: int = 256,
        faults: Faults | None = None,
        admission: str = "reserve",
    ) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}")
        self.admission = admission
        self.preemptions = 0
        self.profile = profile
        self.seed = seed
        self.capacity = kv_capacity_tokens or profile.kv_capacity_tokens
        self.max_running = max_running
        self.faults = faults or Faults()
        self.now = 0.0
        self._rng = random.Random(seed)
        self._seqs: dict[str, _Seq] = {}
        self._fetch_heap: list[tuple[float, int, str]] = []
        self._fetch_n = 0
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._used = 0
        # Shared prompt blocks of the running sequences: block id -> how many hold it. `_used`
        # (reserve) and `_usage` (expected) count each once.
        self._blocks: dict[int, int] = {}
        self._shared_tokens = 0  # tokens the running sequences' block ids name more than once
        self._seg_start = 0.0
        self._step_ms = 0.0
        self._seg_end = float("inf")
        self._dirty = False  # membership changed: rebase at the next step boundary
        self.steps_total = 0.0
        self.step_ms_sum = 0.0
        self.tokens_total = 0

    # ---- inputs --------------------------------------------------------------------------
    def transfer_ms(self, kv_tokens: int) -> float:
        return kv_tokens * self.profile.kv_bytes_per_token / self.profile.kv_transfer_bytes_per_s * 1000.0

    def submit(self, req: DecodeRequest, now: float) -> list[Effect]:
        effects = self.advance_to(now)
        need = req.input_tokens + req.max_new_tokens
        err = ""
        if req.max_new_tokens <= 0 or req.input_tokens <= 0:
            err, code = "input_tokens and max_new_tokens must be > 0", EngineStatus.INVALID
        elif req.block_keys and (
            req.block_size <= 0 or req.block_size * len(req.block_keys) > req.input_tokens
        ):
            err, code = (
                "block_keys must be full blocks of block_size > 0 within the prompt",
                EngineStatus.INVALID,
            )
        elif need > min(self.capacity, self.profile.max_context_tokens):
            err, code = f"{need} tokens exceed capacity", EngineStatus.TOO_LONG
        elif req.request_id in self._seqs:
            err, code = "request id already live", EngineStatus.DUPLICATE
        if err:
            effects.append(DecodeFinished(req.request_id, str(code), 0, now, err))
            return effects
        s = _Seq(req, need)
        self._seqs[req.request_id] = s
        kv = req.kv_tokens or req.input_tokens
        ready = now + self.transfer_ms(kv) + self.faults.extra_latency_ms
        self._fetch_n += 1
        heapq.heappush(self._fetch_heap, (ready, self._fetch_n, req.request_id))
        return effects

    def cancel(
        self, request_id: str, now: float, reason: str = EngineStatus.CANCELLED, error: str = ""
    ) -> list[Effect]:
        effects = self.advance_to(now)
        s = self._seqs.get(request_id)
        if s is None:
            return effects
        if s.phase == "running":
            gen = self._gen_at(s, self.now)
            effects.extend(self._emit(s, gen))
            self._running.remove(request_id)
            self._used -= self._held(s) - self._unshare(s)
            if self._running:
                self._mark_dirty()
            else:
                self._new_segment()
        elif s.phase == "waiting":
            self._waiting.remove(request_id)
        del self._seqs[request_id]
        effects.append(DecodeFinished(request_id, str(reason), s.emitted, self.now, error))
        effects.extend(self._admit())
        return effects

    def configure(
        self,
        now: float,
        *,
        faults: Faults | None = None,
        profile: EngineProfile | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> list[Effect]:
        effects = self.advance_to(now)
        if faults is not None:
            self.faults = faults
        if profile is not None:
            self.profile = profile
            self._mark_dirty()
        if kv_capacity_tokens is not None:
            self.capacity = kv_capacity_tokens
        effects.extend(self._admit())
        return effects

    def set_admission(self, mode: str) -> None:
        """Switch `reserve` <-> `expected` (ADMISSIONS). Only while no sequence is in flight: the
        modes count KV differently (`reserve` holds each sequence's need in `_used`, `expected`
        computes use from the tokens generated), so a switch mid-run would corrupt the count."""
        if mode not in ADMISSIONS:
            raise ValueError(f"decode_admission must be one of {ADMISSIONS}")
        if mode != self.admission and self._seqs:
            raise ValueError(
                f"decode_admission can change only while the engine is idle ({len(self._seqs)} in flight)"
            )
        self.admission = mode

    def reset(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for rid in list(self._seqs):
            effects.extend(self.cancel(rid, now))
        self._fetch_heap.clear()
        self.faults = Faults()
        self._rng = random.Random(self.seed)
        return effects

    # ---- time ----------------------------------------------------------------------------
    def next_event_time(self) -> float | None:
        if self.faults.hang:
            return None
        t = self._fetch_heap[0][0] if self._fetch_heap else float("inf")
        if self._running:
            t = min(t, self._seg_end)
        return None if t == float("inf") else t

    def next_token_time(self) -> float | None:
        """When the next token of any running sequence appears (drivers use it to coalesce)."""
        if not self._running or self.faults.hang:
            return None
        s = self._seqs[self._running[0]]
        steps_done = s.emitted - s.gen_base
        return self._seg_start + (steps_done + 1) * self._step_ms

    def advance_to(self, t: float) -> list[Effect]:
        effects: list[Effect] = []
        if self.faults.hang:
            self.now = max(self.now, t)
            return effects
        while True:
            nxt = self.next_event_time()
            if nxt is None or nxt > t + EPS:
                break
            self.now = max(self.now, nxt)
            if self._running and self._seg_end <= nxt + EPS:
                effects.extend(self._rebase(self._seg_end))
            while self._fetch_heap and self._fetch_heap[0][0] <= self.now + EPS:
                _, _, rid = heapq.heappop(self._fetch_heap)
                s = self._seqs.get(rid)
                if s is None or s.phase != "fetching":
                    continue
                if self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate:
                    del self._seqs[rid]
                    effects.append(
                        DecodeFinished(rid, EngineStatus.ENGINE_ERROR, 0, self.now, "injected engine fault")
                    )
                    continue
                s.phase = "waiting"
                self._waiting.append(rid)
            effects.extend(self._admit())
        self.now = max(self.now, t)
        for rid in self._running:
            s = self._seqs[rid]
            effects.extend(self._emit(s, self._gen_at(s, self.now)))
        return effects

    # ---- views ---------------------------------------------------------------------------
    def kv_view(self) -> dict[str, int]:
        used = self._used if self.admission == "reserve" else self._usage(self.now)
        return {
            "kv_total_tokens": self.capacity,
            "kv_free_tokens": max(0, self.capacity - used),
            "kv_evictable_tokens": 0,
            "kv_pinned_tokens": used,
        }

    def live_view(self) -> dict[str, list[str]]:
        return {
            "running": list(self._running),
            "waiting": list(self._waiting),
            "fetching": [rid for rid, s in self._seqs.items() if s.phase == "fetching"],
        }

    def has_running(self) -> bool:
        return bool(self._running)

    @property
    def step_ms(self) -> float:
        return self._step_ms

    def avg_step_ms(self) -> float:
        return self.step_ms_sum / self.steps_total if self.steps_total else 0.0

    # ---- internals -----------------------------------------------------------------------
    def _gen_at(self, s: _Seq, t: float) -> int:
        if self._step_ms <= 0:
            return s.gen_base
        steps = int((t - self._seg_start) / self._step_ms + EPS)
        return min(s.req.max_new_tokens, s.gen_base + max(0, steps))

    def _emit(self, s: _Seq, gen: int) -> list[Effect]:
        if gen <= s.emitted:
            return []
        first = s.emitted
        toks = output_tokens(self.seed, s.req.request_id, s.req.first_index + first, gen - first)
        t_first = self._seg_start + (first + 1 - s.gen_base) * self._step_ms
        t_last = self._seg_start + (gen - s.gen_base) * self._step_ms
        s.emitted = gen
        self.tokens_total += len(toks)
        return [DecodeChunk(s.req.request_id, s.req.first_index + first, toks, t_first, t_last)]

    def _mark_dirty(self) -> None:
        """Membership changed: end the segment at the next step boundary."""
        if not self._running:
            return
        if self._step_ms <= 0:
            self._seg_end = self.now
            return
        k = int((self.now - self._seg_start) / self._step_ms + EPS)
        boundary = self._seg_start + k * self._step_ms
        if boundary < self.now - EPS:
            boundary += self._step_ms
        self._seg_end = min(self._seg_end, boundary)
        self._dirty = True

    def _rebase(self, t: float) -> list[Effect]:
        effects: list[Effect] = []
        steps = int((t - self._seg_start) / self._step_ms + EPS) if self._step_ms > 0 else 0
        if steps > 0:
            self.steps_total += steps
            self.step_ms_sum += steps * self._step_ms
        finished: list[str] = []
        for rid in self._running:
            s = self._seqs[rid]
            gen = min(s.req.max_new_tokens, s.gen_base + steps)
            effects.extend(self._emit(s, gen))
            s.gen_base = gen
            if gen >= s.req.max_new_tokens:
                finished.append(rid)
        for rid in finished:
            s = self._seqs.pop(rid)
            self._running.remove(rid)
            self._used -= self._held(s) - self._unshare(s)
            effects.append(DecodeFinished(rid, FINISH_LENGTH, s.emitted, t))
        self._seg_start = t
        self._dirty = False
        effects.extend(self._admit(rebased=True))
        self._preempt_for_growth()
        self._new_segment()
        return effects

    # ---- expected-use admission ----------------------------------------------------------
    def _held(self, s: _Seq) -> int:
        """KV counted in `_used` for a running sequence (reserve mode; 0 in expected mode,
        where usage is computed from the tokens generated)."""
        return s.need_kv if self.admission == "reserve" else 0

    def _usage(self, t: float) -> int:
        """KV the running sequences hold at `t`: prompt + tokens generated so far, shared prompt
        blocks once."""
        return (
            sum(
                self._seqs[r].req.input_tokens + max(0, self._gen_at(self._seqs[r], t)) for r in self._running
            )
            - self._shared_tokens
        )

    def _new_blocks(self, s: _Seq) -> int:
        """Tokens of `s`'s prompt blocks no running sequence holds yet."""
        return s.req.block_size * sum(1 for k in s.req.block_keys if k not in self._blocks)

    def _share(self, s: _Seq) -> int:
        """`s` runs: count its prompt blocks; returns the tokens it finds already held."""
        found = 0
        for k in s.req.block_keys:
            n = self._blocks.get(k, 0)
            found += n > 0
            self._blocks[k] = n + 1
        tokens = found * s.req.block_size
        self._shared_tokens += tokens
        return tokens

    def _unshare(self, s: _Seq) -> int:
        """`s` stops running: returns the tokens of its blocks another running sequence still holds."""
        kept = 0
        for k in s.req.block_keys:
            n = self._blocks[k] - 1
            if n:
                self._blocks[k] = n
                kept += 1
            else:
                del self._blocks[k]
        tokens = kept * s.req.block_size
        self._shared_tokens -= tokens
        return tokens if self.admission == "reserve" else 0

    def _preempt_for_growth(self) -> None:
        """At a segment start: while the next step's tokens would not fit, preempt the most
        recently admitted running sequence (it recomputes later; nothing it emitted is lost)."""
        if self.admission == "reserve":
            return
        while len(self._running) > 1 and self._usage(self._seg_start) + len(self._running) > self.capacity:
            rid = self._running.pop()
            s = self._seqs[rid]
            self._unshare(s)
            s.resume = max(0, s.gen_base)
            s.phase = "fetching"
            self.preemptions += 1
            ctx = s.req.input_tokens + s.resume
            ready = self.now + self.profile.prefill_batch_ms([BatchItem(ctx, 0)])
            self._fetch_n += 1
            heapq.heappush(self._fetch_heap, (ready, self._fetch_n, rid))

    def _admit(self, rebased: bool = False) -> list[Effect]:
        was_idle = not self._running
        admitted = False
        expected = self.admission == "expected"
        used = self._usage(self.now) if expected and self._running else self._used
        while self._waiting and len(self._running) < self.max_running:
            s = self._seqs[self._waiting[0]]
            # expected: what it holds now plus one step's growth of every running sequence and its own
            held = s.req.block_size * len(s.req.block_keys) - self._new_blocks(s)  # shared, not charged
            need = (s.req.input_tokens + s.resume + len(self._running) + 1 if expected else s.need_kv) - held
            if used + need > self.capacity:
                break  # waits (does not fail) until running sequences free KV
            self._waiting.popleft()
            self._share(s)
            if expected:
                used += s.req.input_tokens + s.resume - held
            else:
                self._used += s.need_kv - held
                used = self._used
            s.phase = "running"
            admitted = True
            # An idle engine starts a segment now; otherwise the sequence joins at the next step
            # boundary (a negative base makes it reach its resume point exactly there).
            s.gen_base = s.resume if (was_idle or rebased) else s.resume - self._pending_offset()
            self._running.append(s.req.request_id)
        if admitted and not rebased:
            if was_idle:
                self._seg_start = self.now
                self._new_segment()
            else:
                self._mark_dirty()
        return []

    def _pending_offset(self) -> int:
        """Steps between the segment start and the next boundary: a newly admitted sequence's
        gen_base is set negative by this much, so it has generated 0 tokens at that boundary."""
        if self._step_ms <= 0:
            return 0
        k = int((self.now - self._seg_start) / self._step_ms + EPS)
        boundary = self._seg_start + k * self._step_ms
        if boundary < self.now - EPS:
            k += 1
        return k

    def _new_segment(self) -> None:
        if not self._running:
            self._step_ms = 0.0
            self._seg_end = float("inf")
            return
        ctx = 0
        remaining = []
        for rid in self._running:
            s = self._seqs[rid]
            ctx += s.req.input_tokens + s.gen_base
            remaining.append(s.req.max_new_tokens - s.gen_base)
        self._step_ms = max(EPS, self.profile.decode_step_ms(len(self._running), ctx))
        steps = min(min(remaining), REBASE_STEPS)
        if self.admission == "expected":
            # end the segment where the batch's growth fills the KV: preemption happens there
            room = (self.capacity - self._usage(self._seg_start)) // len(self._running)
            steps = max(1, min(steps, room))
        self._seg_end = self._seg_start + steps * self._step_ms
