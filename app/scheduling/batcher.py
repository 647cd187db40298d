"""The owner's batching decisions for one prefill worker (DESIGN §7), as pure code.

No I/O, no clock, no asyncio: the live dispatcher and the simulator feed it items and the current
time (ms on one consistent clock) and ask `decide()`; it answers which items to send now and why,
or when to ask again. Knobs are *modelled* milliseconds; `BatcherConfig.scaled(time_scale)`
converts them for a driver whose clock runs at the worker's time scale.

- `fixed_window` (work-conserving): an idle worker gets what is waiting at once (`idle`); a busy
  one accumulates until `max_size` (`full`), the oldest item has waited `wait_ms` (`timeout`), or
  the predicted batch time reaches `predict_threshold_ms` (`predict_threshold`).
- `slo`: items ordered by deadline (arrival + SLO − predicted time); the batch is filled while
  the head still meets its deadline, and dispatched when the head's slack reaches the guard
  (`deadline`); an item whose SLO has already passed fails typed.
- `window` (work-conserving, the predicted-time window): whenever fewer than
  `max_inflight_batches` of ours are on the worker, what waits goes at once (`idle` to an idle
  worker, `window` behind a busy one), as one batch only as far as batching pays: the members'
  summed predicted finish times are no later than if each went alone (every member gets its
  first token when the whole batch ends), the first member is delayed by at most `wait_ms`, and
  the batch's predicted end (from the end of ours ahead of it) still meets its members'
  deadlines (the SLO cap). So batches form from what accumulates while the worker is full, and
  only where they shorten TTFT; nothing is ever held back for a window (holding items until the
  predicted end of the running batch measured ~1.5 points of goodput worse than `direct` on the
  shipped traces: predictions err, and an engine left idle for them is lost time).
- Every algorithm: an item marked `drop_late` whose deadline (`Pending.deadline_ms`, 0 = none)
  has passed while it waited fails typed (`deadline_exceeded`) instead of taking engine time
  from the others.
- Priorities and fairness (`fixed_window`, `window`, `direct`; `slo` keeps the classes and the
  promotion but orders each class by deadline instead of by tenant shares): what
  waits is taken highest class first (`Pending.priority`, 0 bulk … 3 system); an item that has
  waited `starvation_ms` counts in the highest class waiting, where it is its tenant's oldest
  (so a `bulk` one behind a stream of `interactive` ones waits about that long, then goes with
  the next batch its tenant gets: fairness between tenants holds); within a class, tenants take
  turns by the slots they were given (start-time fair queueing: the tenant served least goes
  next, one that joins starts level with the least-served waiting one, so nobody banks credit
  while idle). One class and one tenant keep arrival order.
- Never more than `max_inflight_batches` dispatched and unfinished. Packing skips what does not
  fit the token/KV budget (no head-of-line blocking); what can never fit fails at once.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from app.scheduling.formula import BatchItem

ALGORITHMS = ("fixed_window", "slo", "window")
MODES = ("batch", "direct")
REASONS = ("idle", "full", "timeout", "predict_threshold", "deadline", "direct", "window")
DEFAULT_PRIORITY = 1  # `default` among bulk (0), default, interactive, system (3)


@dataclass(frozen=True)
class BatcherConfig:
    algorithm: str = "window"
    mode: str = "batch"
    max_size: int = 16
    wait_ms: float = 30.0
    max_inflight_batches: int = 2
    predict_threshold_ms: float = 0.0  # 0 = off
    max_batch_tokens: int = 131_072
    slo_ttft_ms: float = 3000.0
    guard_ms: float = 5.0
    starvation_ms: float = 2000.0  # a waiting item joins the top waiting class after this; 0 = never

    @property
    def holds_window(self) -> bool:
        """A busy worker's requests may wait up to `wait_ms` before dispatch (a fixed window in
        batch mode): the batch wait that admission adds, live and in the simulator alike."""
        return self.mode == "batch" and self.algorithm == "fixed_window"

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if not 1 <= self.max_size <= 1024:
            raise ValueError("max_size must be in [1, 1024]")
        if not 0 <= self.wait_ms <= 60_000:
            raise ValueError("wait_ms must be in [0, 60000]")
        if not 1 <= self.max_inflight_batches <= 64:
            raise ValueError("max_inflight_batches must be in [1, 64]")
        if self.predict_threshold_ms < 0:
            raise ValueError("predict_threshold_ms must be >= 0")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if self.slo_ttft_ms <= 0 or self.guard_ms < 0:
            raise ValueError("slo_ttft_ms must be > 0 and guard_ms >= 0")
        if not 0 <= self.starvation_ms <= 3_600_000:
            raise ValueError("starvation_ms must be in [0, 3600000]")

    def scaled(self, time_scale: float) -> BatcherConfig:
        """Knobs in the driver's clock: modelled ms × time_scale."""
        return replace(
            self,
            wait_ms=self.wait_ms * time_scale,
            predict_threshold_ms=self.predict_threshold_ms * time_scale,
            slo_ttft_ms=self.slo_ttft_ms * time_scale,
            guard_ms=self.guard_ms * time_scale,
            starvation_ms=self.starvation_ms * time_scale,
        )


@dataclass
class Pending:
    id: str
    input_tokens: int
    hit_tokens: int
    arrival_ms: float
    predicted_ms: float = 0.0  # this item alone, in the driver's clock
    payload: object = None
    deadline_ms: float = 0.0  # when its TTFT deadline passes, in the driver's clock; 0 = none
    drop_late: bool = False  # end it typed once the deadline passes (else it only caps batches)
    priority: int = DEFAULT_PRIORITY  # class: 0 bulk, 1 default, 2 interactive, 3 system
    tenant: str = ""  # fair shares are kept between tenants ("" without API keys: one tenant)

    @property
    def item(self) -> BatchItem:
        return BatchItem(self.input_tokens, self.hit_tokens)


@dataclass
class Decision:
    items: list[Pending] = field(default_factory=list)
    reason: str = ""
    failed: list[tuple[Pending, str]] = field(default_factory=list)  # (item, error code)
    wake_at_ms: float | None = None  # ask again then (a timer), if nothing else happens first


PredictFn = Callable[[Sequence[BatchItem]], float]


class Batcher:
    def __init__(self, config: BatcherConfig, predict: PredictFn, kv_budget_tokens: int = 1 << 62) -> None:
        config.validate()
        self.config = config
        self.predict = predict  # batch ms in the driver's clock
        self.kv_budget_tokens = kv_budget_tokens
        self.pending: list[Pending] = []
        self.inflight = 0
        # Predicted durations of our batches on the worker, oldest (running) first, and when the
        # running one started: the predicted end of the worker's backlog (`window`).
        self._durations: list[float] = []
        self._busy_from = 0.0
        # Slots each tenant with waiting items was given (fair sharing); see `fair_order`.
        self.served: dict[str, float] = {}

    def add(self, p: Pending) -> None:
        self.pending.append(p)

    def remove(self, item_id: str) -> bool:
        for i, p in enumerate(self.pending):
            if p.id == item_id:
                del self.pending[i]
                return True
        return False

    def batch_started(self, items: Sequence[Pending] = (), now_ms: float | None = None) -> None:
        self.inflight += 1
        if now_ms is not None:
            if not self._durations:
                self._busy_from = now_ms
            self._durations.append(self.predict([p.item for p in items]) if items else 0.0)

    def batch_finished(self, now_ms: float | None = None) -> None:
        self.inflight = max(0, self.inflight - 1)
        if self._durations:
            self._durations.pop(0)
            if now_ms is not None:
                self._busy_from = now_ms  # the next batch starts when this one ends

    def busy_until(self, now_ms: float) -> float:
        """Predicted end of our batches on the worker (`now_ms` when none are known)."""
        if not self._durations:
            return now_ms
        return max(now_ms, self._busy_from + sum(self._durations))

    # ---- the decision ---------------------------------------------------------------------
    def decide(self, now_ms: float, worker_busy: bool | None = None) -> Decision:
        """What to dispatch now. `worker_busy` defaults to "a batch of ours is in flight"."""
        d = self._decide(now_ms, worker_busy)
        for p in d.items:  # the slots given: what the fair order compares tenants by
            self.served[p.tenant] = self.served.get(p.tenant, 0.0) + 1.0
        return d

    def _decide(self, now_ms: float, worker_busy: bool | None) -> Decision:
        c = self.config
        d = Decision()
        self._fail_impossible(d)
        self._fail_late(now_ms, d)
        if c.algorithm == "slo":
            self._fail_expired(now_ms, d)
        if not self.pending or self.inflight >= c.max_inflight_batches:
            # ask again when the first droppable item's deadline passes, to end it then
            late = [p.deadline_ms for p in self.pending if p.drop_late and p.deadline_ms]
            if late:
                d.wake_at_ms = min(late)
            return d
        busy = self.inflight > 0 if worker_busy is None else worker_busy
        if c.algorithm != "slo" or c.mode == "direct":
            self.pending = self.ordered(now_ms)
        if c.mode == "direct":
            d.items = [self.pending.pop(0)]
            d.reason = "direct"
            return d
        if c.algorithm == "slo":
            return self._decide_slo(now_ms, d)
        if c.algorithm == "window":
            return self._decide_window(now_ms, busy, d)
        if not busy:
            d.items, d.reason = self._pack(self.pending), "idle"
        else:
            oldest = min(p.arrival_ms for p in self.pending)
            packed = self._pack(self.pending, take=False)
            pred = self.predict([p.item for p in packed]) if packed else 0.0
            if len(packed) >= c.max_size:
                d.reason = "full"
            elif c.predict_threshold_ms and pred >= c.predict_threshold_ms:
                d.reason = "predict_threshold"
            elif now_ms >= oldest + c.wait_ms:  # the same sum as the wake time (float-exact)
                d.reason = "timeout"
            else:
                d.wake_at_ms = oldest + c.wait_ms
                return d
            d.items = self._pack(self.pending)
        return d

    def ordered(self, now_ms: float) -> list[Pending]:
        """The waiting items in the order batches take them: class high to low, an item that has
        waited `starvation_ms` counted in the highest class waiting (where, the oldest of its
        tenant's, it goes next for that tenant); within a class the tenants' fair order, each
        tenant's items by arrival. One class and one tenant: as queued."""
        pend = self.pending
        tenants = {p.tenant for p in pend}
        self._level(tenants)
        if len({p.priority for p in pend}) <= 1 and len(tenants) <= 1:
            return pend
        classes = self._classes(now_ms)
        out: list[Pending] = []
        for cls in sorted(set(classes), reverse=True):
            out += fair_order([p for p, k in zip(pend, classes, strict=True) if k == cls], self.served)
        return out

    def _classes(self, now_ms: float) -> list[int]:
        """Each waiting item's class for ordering: its own, or the highest class waiting once it
        has waited `starvation_ms` (the promotion)."""
        top, bound = (
            max((p.priority for p in self.pending), default=DEFAULT_PRIORITY),
            self.config.starvation_ms,
        )
        return [top if bound and now_ms - p.arrival_ms >= bound else p.priority for p in self.pending]

    def _level(self, waiting: set[str]) -> None:
        """Forget tenants with nothing waiting; one that (re)joins starts at the least-served
        waiting tenant's count, so slots it did not ask for are not owed to it later."""
        for t in [t for t in self.served if t not in waiting]:
            del self.served[t]
        floor = min(self.served.values(), default=0.0)
        for t in waiting:
            self.served.setdefault(t, floor)

    def _pack(self, candidates: list[Pending], take: bool = True) -> list[Pending]:
        """First-come order, skipping what does not fit the remaining budget (skip-not-block)."""
        c = self.config
        out: list[Pending] = []
        tokens = kv = 0
        for p in list(candidates):
            if len(out) >= c.max_size:
                break
            compute = p.input_tokens - p.hit_tokens
            if tokens + compute > c.max_batch_tokens or kv + p.input_tokens > self.kv_budget_tokens:
                continue
            out.append(p)
            tokens += compute
            kv += p.input_tokens
        if take:
            ids = {id(p) for p in out}
            self.pending = [p for p in self.pending if id(p) not in ids]
        return out

    def _decide_window(self, now_ms: float, busy: bool, d: Decision) -> Decision:
        c = self.config
        start = self.busy_until(now_ms) if busy else now_ms
        d.items = self._pack_by_deadline(start)
        d.reason = ("full" if len(d.items) >= c.max_size else "window") if busy else "idle"
        return d

    def _pack_by_deadline(self, start_ms: float) -> list[Pending]:
        """`_pack` in arrival order, cut to the longest prefix that pays, then trimmed from the
        end while the batch's predicted end (from `start_ms`) would miss the earliest deadline
        among its members (the SLO cap); the first item always goes.

        A batch pays when its members' summed predicted finish times are no later than if each
        went alone in the same order: every member of a batch gets its first token when the
        whole batch ends, so batching long prompts (compute-bound, little per-batch cost to
        share) only delays the first ones, while short prompts share the fixed cost and all gain.
        """
        out = self._pack(self.pending, take=False)
        out = out[: self._paying_prefix(out)]
        while len(out) > 1:
            end = start_ms + self.predict([p.item for p in out])
            first = min((p.deadline_ms for p in out if p.deadline_ms), default=0.0)
            if not first or end <= first:
                break
            out.pop()
        ids = {id(p) for p in out}
        self.pending = [p for p in self.pending if id(p) not in ids]
        return out

    def _paying_prefix(self, items: list[Pending]) -> int:
        """Largest m such that m × predict(first m) ≤ Σ_k (Σ_{j≤k} predict(item j alone)), and
        the batch delays its first member by at most `wait_ms` over going alone: the mean gain
        must not come out of the first members' deadlines (predictions err, and a TTFT SLO is a
        threshold, not a mean)."""
        best = 1
        finish = total = 0.0
        first = 0.0
        for m in range(1, len(items) + 1):
            one = self.predict([items[m - 1].item])
            if m == 1:
                first = one
            finish += one
            total += finish
            if m == 1:
                continue
            batch = self.predict([p.item for p in items[:m]])
            if batch - first > self.config.wait_ms:
                break
            if m * batch <= total:
                best = m
        return best

    def _fail_late(self, now_ms: float, d: Decision) -> None:
        """Items whose own deadline passed while they waited end typed, not run."""
        if not any(p.drop_late and p.deadline_ms and now_ms > p.deadline_ms for p in self.pending):
            return
        keep = []
        for p in self.pending:
            if p.drop_late and p.deadline_ms and now_ms > p.deadline_ms:
                d.failed.append((p, "deadline_exceeded"))
            else:
                keep.append(p)
        self.pending = keep

    def _fail_impossible(self, d: Decision) -> None:
        c = self.config
        keep = []
        for p in self.pending:
            if p.input_tokens - p.hit_tokens > c.max_batch_tokens or p.input_tokens > self.kv_budget_tokens:
                d.failed.append((p, "too_long"))
            else:
                keep.append(p)
        self.pending = keep

    def _deadline(self, p: Pending) -> float:
        return p.arrival_ms + self.config.slo_ttft_ms - p.predicted_ms

    def _fail_expired(self, now_ms: float, d: Decision) -> None:
        keep = []
        for p in self.pending:
            if now_ms > p.arrival_ms + self.config.slo_ttft_ms:
                d.failed.append((p, "deadline_exceeded"))
            else:
                keep.append(p)
        self.pending = keep

    def _decide_slo(self, now_ms: float, d: Decision) -> Decision:
        """Deadline order within a class, classes high to low (starvation promotion as in
        `ordered`): the head is the most urgent item of the highest class waiting, so under
        overload the lower classes wait, pass their SLO and fail first."""
        c = self.config
        classes = self._classes(now_ms)
        ranked = sorted(zip(classes, self.pending, strict=True), key=lambda x: (-x[0], self._deadline(x[1])))
        order = [p for _, p in ranked]
        head = order[0]
        # Fill in deadline order while the head still finishes within its SLO.
        chosen: list[Pending] = []
        for p in order:
            if len(chosen) >= c.max_size:
                break
            trial = [*chosen, p]
            if (
                now_ms + self.predict([x.item for x in trial]) <= head.arrival_ms + c.slo_ttft_ms
                or not chosen
            ):
                chosen = trial
        slack = self._deadline(head) - now_ms
        busy = self.inflight > 0
        if busy and slack > c.guard_ms and len(chosen) < c.max_size:
            d.wake_at_ms = now_ms + slack - c.guard_ms
            return d
        packed = self._pack(chosen, take=False)
        ids = {id(p) for p in packed}
        self.pending = [p for p in self.pending if id(p) not in ids]
        d.items = packed
        d.reason = "deadline" if busy else "idle"
        return d


def fair_order(items: Iterable[Pending], served: dict[str, float]) -> list[Pending]:
    """Items of one class in the order that shares slots fairly between tenants: repeatedly the
    next item of the tenant with the fewest slots so far (`served`, plus those ordered ahead
    here), ties to the earlier arrival; each tenant's items in arrival order."""
    queues: dict[str, deque[Pending]] = {}
    for p in sorted(items, key=lambda p: p.arrival_ms):
        queues.setdefault(p.tenant, deque()).append(p)
    if len(queues) <= 1:
        return [p for q in queues.values() for p in q]
    heap = [(served.get(t, 0.0), q[0].arrival_ms, t) for t, q in queues.items()]
    heapq.heapify(heap)
    out: list[Pending] = []
    while heap:  # O(n log tenants)
        given, _, t = heapq.heappop(heap)
        q = queues[t]
        out.append(q.popleft())
        if q:
            heapq.heappush(heap, (given + 1.0, q[0].arrival_ms, t))
    return out
