"""The decode engine with a real model: continuous batching of real sequences.

It answers the driver and the Triton adapter exactly as the simulated `DecodeEngine` does (submit,
cancel, configure, reset, advance_to, next_event_time and the views), so the decode model's stream
code is shared. What it does instead of modelling:

- A sequence arrives with its KV already fetched (`HfDecodeRequest.kv`, from the prefill worker's
  frame) and waits until its whole KV (`input_tokens + max_new_tokens`) fits the budget.
- Every `advance_to` runs **one** batched forward pass: each running sequence gets one token. The
  driver calls it again at once while sequences run, and runs its queued commands in between, so
  sequences join and leave (finish, cancel) between steps, never inside one.
- The running set is one left-padded batch (`DecodeBatch`); it is rebuilt only when membership
  changes, otherwise every step appends one column to every row.
- A sequence stops after `max_new_tokens` (`length`) or on an end-of-sequence token (`stop`).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.protocol.codes import FINISH_LENGTH, FINISH_STOP, EngineStatus

from .decode import DecodeRequest
from .effects import DecodeChunk, DecodeFinished, Effect
from .faults import Faults
from .hf_model import GREEDY, DecodeBatch, HfModel, Sampling, sample_token
from .profiles import EngineProfile

log = logging.getLogger("flexlb.worker.hf")


@dataclass(frozen=True, slots=True)
class HfDecodeRequest(DecodeRequest):
    """A decode request with its fetched KV and the token that continues the stream."""

    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, input_tokens, head_dim]
    first_token: int = 0  # token first_index - 1 (prefill's), the first step's input
    sampling: Sampling = GREEDY


@dataclass(slots=True)
class _Seq:
    req: HfDecodeRequest
    need_kv: int
    generated: int = 0
    last: int = 0
    kv: torch.Tensor | None = None  # held while waiting / between rebuilds
    phase: str = "waiting"  # waiting | running
    tokens: list[int] = field(default_factory=list)


class HfDecodeEngine:
    def __init__(
        self,
        model: HfModel,
        profile: EngineProfile,
        *,
        clock: Callable[[], float],
        seed: int = 0,
        kv_capacity_tokens: int | None = None,
        max_running: int = 64,
        faults: Faults | None = None,
    ) -> None:
        self.model = model
        self.profile = profile
        self.clock = clock
        self.seed = seed
        self.capacity = kv_capacity_tokens or profile.kv_capacity_tokens
        self.max_running = max_running
        self.faults = faults or Faults()
        self.now = 0.0
        self._rng = random.Random(seed)
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._batch: DecodeBatch | None = None
        self._dirty = False
        self._used = 0
        self._last_step_ms = 0.0
        self._last_step_at = 0.0  # modelled time the last step ended
        self.steps_total = 0
        self.step_ms_sum = 0.0
        self.tokens_total = 0
        self.batched_rows_total = 0  # sum of batch sizes over steps (mean batch = this / steps)

    # ---- inputs --------------------------------------------------------------------------
    def submit(self, req: DecodeRequest, now: float) -> list[Effect]:
        self.now = max(self.now, now)
        need = req.input_tokens + req.max_new_tokens
        err, code = "", ""
        kv = req.kv if isinstance(req, HfDecodeRequest) else None
        if req.max_new_tokens <= 0 or req.input_tokens <= 0:
            err, code = "input_tokens and max_new_tokens must be > 0", EngineStatus.INVALID
        elif kv is None or not isinstance(req, HfDecodeRequest):
            err, code = "a real decode needs the prefill KV (kv_worker)", EngineStatus.INVALID
        elif int(kv.shape[3]) != req.input_tokens:
            err, code = f"KV holds {int(kv.shape[3])} tokens, not {req.input_tokens}", EngineStatus.INVALID
        elif need > min(self.capacity, self.model.max_context):
            err, code = f"{need} tokens exceed capacity", EngineStatus.TOO_LONG
        elif req.request_id in self._seqs:
            err, code = "request id already live", EngineStatus.DUPLICATE
        if err:
            return [DecodeFinished(req.request_id, str(code), 0, now, err)]
        assert isinstance(req, HfDecodeRequest)
        if self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate:
            err = "injected engine fault"
            return [DecodeFinished(req.request_id, EngineStatus.ENGINE_ERROR, 0, now, err)]
        if req.first_token in self.model.eos_ids:  # prefill's token already ended the text
            return [DecodeFinished(req.request_id, FINISH_STOP, 0, now)]
        self._seqs[req.request_id] = _Seq(req, need, last=req.first_token, kv=kv)
        self._waiting.append(req.request_id)
        return []

    def cancel(
        self, request_id: str, now: float, reason: str = EngineStatus.CANCELLED, error: str = ""
    ) -> list[Effect]:
        self.now = max(self.now, now)
        s = self._seqs.pop(request_id, None)
        if s is None:
            return []
        if s.phase == "running":
            self._running.remove(request_id)
            self._used -= s.need_kv
            self._dirty = True
        else:
            self._waiting.remove(request_id)
        s.kv = None
        return [DecodeFinished(request_id, str(reason), s.generated, self.now, error)]

    def configure(
        self,
        now: float,
        *,
        faults: Faults | None = None,
        profile: EngineProfile | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> list[Effect]:
        self.now = max(self.now, now)
        if faults is not None:
            self.faults = faults
        if profile is not None:
            self.profile = profile
        if kv_capacity_tokens is not None:
            self.capacity = kv_capacity_tokens
        return []

    def reset(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for rid in list(self._seqs):
            effects.extend(self.cancel(rid, now))
        self._batch = None
        self._dirty = False
        self.faults = Faults()
        self._rng = random.Random(self.seed)
        return effects

    # ---- time: one step per advance -------------------------------------------------------
    def next_event_time(self) -> float | None:
        """Now while sequences run; fault `extra_latency_ms` spaces the steps (a slower device)."""
        if self.faults.hang or not (self._running or self._admissible()):
            return None
        return max(self.now, self._last_step_at + self.faults.extra_latency_ms)

    def advance_to(self, t: float) -> list[Effect]:
        self.now = max(self.now, t)
        if self.faults.hang:
            return []
        self._admit()
        if not self._running or t < self._last_step_at + self.faults.extra_latency_ms:
            return []
        try:
            return self._step()
        except Exception as exc:  # a failed step ends its sequences, never the engine thread
            log.exception("decode step failed")
            err = f"decode step failed: {type(exc).__name__}: {exc}"[:300]
            out: list[Effect] = []
            for rid in list(self._running):
                out.extend(self.cancel(rid, self.now, EngineStatus.ENGINE_ERROR, err))
            self._batch = None
            return out

    def _admissible(self) -> bool:
        if not self._waiting or len(self._running) >= self.max_running:
            return False
        return self._used + self._seqs[self._waiting[0]].need_kv <= self.capacity

    def _admit(self) -> None:
        while self._admissible():
            s = self._seqs[self._waiting.popleft()]
            s.phase = "running"
            self._used += s.need_kv
            self._running.append(s.req.request_id)
            self._dirty = True

    def _rebuild(self) -> None:
        """Membership changed: pull the staying rows' KV out of the old batch, pad a new one."""
        if self._batch is not None:
            for rid, kv in self.model.rows_kv(self._batch).items():
                s = self._seqs.get(rid)
                if s is not None:
                    s.kv = kv
        seqs = [self._seqs[rid] for rid in self._running]
        kvs = [s.kv for s in seqs]
        assert all(kv is not None for kv in kvs)
        self._batch = self.model.new_decode_batch(
            list(self._running), [kv for kv in kvs if kv is not None], [s.last for s in seqs]
        )
        for s in seqs:
            s.kv = None  # the batch holds it now
        self._dirty = False

    def _step(self) -> list[Effect]:
        if self._dirty or self._batch is None:
            self._rebuild()
        batch = self._batch
        assert batch is not None
        t0 = self.clock()
        logits = self.model.decode_step(batch)
        effects: list[Effect] = []
        nxt: list[int] = []
        t1 = self.clock()
        self.now = max(self.now, t1)
        for i, rid in enumerate(batch.rows):
            s = self._seqs[rid]
            idx = s.req.first_index + s.generated
            tok = sample_token(logits[i], s.req.sampling, idx)
            s.generated += 1
            s.last = tok
            nxt.append(tok)
            effects.append(DecodeChunk(rid, idx, [tok], self.now, self.now))
            reason = ""
            if tok in self.model.eos_ids:
                reason = FINISH_STOP
            elif s.generated >= s.req.max_new_tokens:
                reason = FINISH_LENGTH
            if reason:
                del self._seqs[rid]
                self._running.remove(rid)
                self._used -= s.need_kv
                self._dirty = True
                effects.append(DecodeFinished(rid, reason, s.generated, self.now))
        batch.last = nxt
        self._last_step_at = t1
        self.steps_total += 1
        self._last_step_ms = t1 - t0
        self.step_ms_sum += self._last_step_ms
        self.tokens_total += len(batch.rows)
        self.batched_rows_total += len(batch.rows)
        if not self._running:
            self._batch = None
        return effects

    # ---- views ---------------------------------------------------------------------------
    def kv_view(self) -> dict[str, int]:
        return {
            "kv_total_tokens": self.capacity,
            "kv_free_tokens": max(0, self.capacity - self._used),
            "kv_evictable_tokens": 0,
            "kv_pinned_tokens": self._used,
        }

    def live_view(self) -> dict[str, list[str]]:
        return {"running": list(self._running), "waiting": list(self._waiting), "fetching": []}

    def has_running(self) -> bool:
        return bool(self._running)

    @property
    def step_ms(self) -> float:
        return self._last_step_ms if self._running else 0.0

    def avg_step_ms(self) -> float:
        return self.step_ms_sum / self.steps_total if self.steps_total else 0.0

    def stats(self) -> dict[str, float | int | str]:
        return {
            "engine": "hf",
            "steps_total": self.steps_total,
            "mean_batch": round(self.batched_rows_total / self.steps_total, 3) if self.steps_total else 0.0,
        }
