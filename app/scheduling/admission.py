"""SLO-aware admission (DESIGN §1 item 3, §7): refuse at once what cannot meet its deadline.

Pure: no I/O, no clock. The live origin (app/request/pipeline.py) and the simulator
(app/sim/cluster.py) both call `decide` with the chosen worker's view, the request's own
predicted prefill and its remaining time budget, and act on the answer.

Why at the origin and before the hand-off: once a request is queued on a worker whose backlog
already exceeds the request's deadline, every millisecond that worker spends on it is wasted
(it misses its SLO anyway) and delays the requests behind it, which then miss theirs too. That
is the overload collapse: past capacity the queues grow without bound and goodput falls to ~0.
Answering 429 `slo_unattainable` at once instead keeps each worker's backlog bounded by the SLO
(a per-worker queue bound in predicted ms, enforced cluster-wide because every origin reads the
same owed + queued time), so the cluster keeps serving its capacity within the SLO and tells the
rest to come back later, fast.

The predicted time to first token on worker w:

    owed_ms(w)       predicted time left of batches committed to w (ledger, from their start)
  + queued_ms(w)     predicted time of hand-offs waiting in w's queue
  + batch_wait_ms    what the batcher may hold the request before dispatching it
  + prefill_ms       the request's own prefill on w (with w's cached prefix)

all in the worker's modelled ms, times the worker's time scale (wall ms per modelled ms).
The request is refused when that exceeds its budget (deadline minus time already spent) by more
than `slack` × budget. `slack` > 0 admits borderline requests (predictions err both ways);
< 0 keeps headroom for bursts.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.scheduling.routing import WorkerView

__all__ = [
    "ADMISSION_MODES",
    "DROP_LATE",
    "IDLE_EPS_MS",
    "REJECT_REASONS",
    "AdmissionConfig",
    "Verdict",
    "decide",
    "fits_on_live",
    "max_backlog_ms",
    "pick_within",
    "predicted_ttft_ms",
]

ADMISSION_MODES = ("slo", "off")
DROP_LATE = ("explicit", "always")
#: Every reason a request may be refused or ended for its deadline (pre-registered metric labels).
REJECT_REASONS = ("slo_unattainable", "deadline_passed_in_queue", "deadline_too_short")
#: Live queued + owed ms (modelled) at or below which a worker counts as idle for a prompt
#: admitted on `Verdict.require_idle`: the queued counter is kept as 6-decimal text, so sums of
#: 3-decimal predictions may leave a residue of a few micro-ms on an empty queue.
IDLE_EPS_MS = 0.01


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    mode: str = "slo"
    # Fraction of the budget a prediction may exceed it by and still be admitted; the default
    # keeps 15 % headroom for prediction error (measured: +1.7 to +7 points of goodput at 1-1.5x
    # load on trace_30min, -0.8 to 0 on the conversation slice; docs/benchmarks.md).
    slack: float = -0.15
    retry_after_s: float = 1.0
    # Which admitted requests the owner ends once their deadline passes in its queue: only those
    # whose client set one (`explicit`), or also those held to the cluster SLO (`always`). A
    # client that named no deadline is served late rather than not at all, unless told otherwise.
    drop_late: str = "explicit"

    def validate(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"admission mode must be one of {ADMISSION_MODES}")
        if not -0.9 <= self.slack <= 10.0:
            raise ValueError("admission slack must be in [-0.9, 10]")
        if self.drop_late not in DROP_LATE:
            raise ValueError(f"admission drop_late must be one of {DROP_LATE}")
        if self.retry_after_s <= 0:
            raise ValueError("admission retry_after_s must be > 0")


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    predicted_ms: float  # predicted TTFT in the caller's clock (wall ms live, sim ms simulated)
    budget_ms: float
    reason: str = ""  # one of REJECT_REASONS when refused
    retry_after_s: float = 0.0
    # Admitted only if the worker is idle on the live shared state (`max_backlog_ms` is
    # `IDLE_EPS_MS`). Set for a prompt whose own prefill exceeds the cluster SLO.
    require_idle: bool = False
    # The largest live backlog (the worker's modelled queued + owed ms, without this request) at
    # which the request still fits its budget; None: no check (admission off, or refused). The
    # verdict read a snapshot up to a poll old plus this origin's overlays: other replicas' hand-
    # offs since are not in it, so several replicas bursting at one worker would each admit up to
    # the whole budget. The hand-off script checks it on the live state in the step that queues
    # the request (`fits_on_live`; live: `HANDOFF`'s `max_backlog`, sim: the cluster's state).
    max_backlog_ms: float | None = None


def predicted_ttft_ms(
    view: WorkerView, prefill_ms: float, batch_wait_ms: float = 0.0, time_scale: float = 1.0
) -> float:
    """The request's predicted TTFT on `view`'s worker, in the caller's clock (see module doc)."""
    return (view.owed_ms + view.queued_ms + batch_wait_ms + prefill_ms) * time_scale


def decide(
    cfg: AdmissionConfig,
    view: WorkerView,
    prefill_ms: float,
    budget_ms: float,
    *,
    batch_wait_ms: float = 0.0,
    time_scale: float = 1.0,
    explicit: bool = True,
    window_ms: float | None = None,
) -> Verdict:
    """Admit or refuse one request on its chosen worker. `budget_ms` is what is left of its
    deadline (deadline − time already spent), in the caller's clock; ≤ 0 means it is already late.
    `explicit`: the client set the deadline itself (else it is the cluster SLO).

    The cluster SLO cannot hold a request whose own prefill alone exceeds it (a 100K-token
    prompt is ~7.8 s on an idle H100 against 3 s): refused on that, it was refused on every
    retry, even on an idle cluster. Its own prefill counts as the whole budget instead: it is
    admitted when nothing waits ahead of it on the worker (an idle worker), and refused while
    one does, with Retry-After the time that backlog needs to drain. Admitting it behind a
    backlog as well (up to the budget) cost the short requests queued behind it: in the
    simulator (conversation trace, 8P+8D, load 1.0) TTFT p50 230 → 527 ms. A client's own
    deadline is held as it is: shorter than its own prefill, it is refused `deadline_too_short`
    (no retry can meet it). "Nothing waits ahead" judged on `view` alone is a snapshot's
    word: with several replicas it is stale, so such an admission says `require_idle` and the
    hand-off confirms it on the live state (`fits_on_live`) in the step that queues the request.
    Every admission carries its `max_backlog_ms` for that check (``window_ms``: the batcher's
    window on a busy worker, default ``batch_wait_ms``; see `max_backlog_ms`).

    `retry_after_s` on a refusal is the time the worker's predicted backlog needs to fall back
    within the budget, at least the configured floor: a client that honours it comes back when
    the request could be admitted, not into the same overload."""
    pred = predicted_ttft_ms(view, prefill_ms, batch_wait_ms, time_scale)
    own = prefill_ms * time_scale
    if cfg.mode != "off" and budget_ms > 0 and own > budget_ms * (1.0 + cfg.slack):
        if explicit:
            # The client's own deadline is shorter than this prompt's prefill alone on an idle
            # worker: no retry meets it, so it is a bad request, not a 429 that invites the
            # client's retries (the openai SDK makes two by default) into the same refusal.
            return Verdict(False, pred, budget_ms, "deadline_too_short")
        wait = pred - own
        if wait <= 0.0:
            return Verdict(True, pred, budget_ms, require_idle=True, max_backlog_ms=IDLE_EPS_MS)
        return Verdict(False, pred, budget_ms, "slo_unattainable", max(cfg.retry_after_s, wait / 1000.0))
    if cfg.mode == "off":
        return Verdict(True, pred, budget_ms)
    if pred <= budget_ms * (1.0 + cfg.slack) and budget_ms > 0:
        window = batch_wait_ms if window_ms is None else window_ms
        allow = max_backlog_ms(cfg, prefill_ms, budget_ms, window_ms=window, time_scale=time_scale)
        return Verdict(True, pred, budget_ms, max_backlog_ms=allow)
    excess_s = max(0.0, pred - max(budget_ms, 0.0)) / 1000.0
    return Verdict(False, pred, budget_ms, "slo_unattainable", max(cfg.retry_after_s, excess_s))


def max_backlog_ms(
    cfg: AdmissionConfig,
    prefill_ms: float,
    budget_ms: float,
    *,
    window_ms: float = 0.0,
    time_scale: float = 1.0,
    explicit: bool = False,
) -> float:
    """The largest live backlog (modelled queued + owed ms, without this request) at which a
    request of ``prefill_ms`` (modelled) still fits ``budget_ms`` (the caller's clock) on a worker
    of ``time_scale``: ``budget × (1 + slack) / time_scale − window_ms − prefill_ms``, the
    inverse of `decide`'s test. ``window_ms`` is what the batcher holds a request on a busy
    worker; an idle one dispatches at once, so a request that fits only without the window still
    fits an idle worker (`IDLE_EPS_MS`). A prompt whose own prefill exceeds the budget fits only
    an idle worker (`IDLE_EPS_MS`), or none (-1) when the deadline is the client's own or
    already spent: the pair's runner-up of `HANDOFF_PICK` is judged by this too, and may differ
    from the policy's pick in its cached prefix."""
    room = budget_ms * (1.0 + cfg.slack) / time_scale - prefill_ms
    if budget_ms <= 0 or room < 0.0:
        return -1.0 if explicit or budget_ms <= 0 else IDLE_EPS_MS
    return max(room - window_ms, IDLE_EPS_MS)


def fits_on_live(
    cfg: AdmissionConfig, verdict: Verdict, queued_ms: float, owed_ms: float, time_scale: float = 1.0
) -> Verdict:
    """The second half of an admission, on the worker's live load (modelled queued ms and owed
    ms, without this request) as the hand-off reads it: `verdict` stands while that backlog is at
    most its `max_backlog_ms`, else the request is refused `slo_unattainable` with Retry-After the
    time the live backlog needs to fall back within it (at least the configured floor). The live
    hand-off script applies the same threshold atomically with adding the request's own queued
    ms, so replicas that each admitted on a snapshot lacking the others' hand-offs can no longer
    together queue more onto a worker than its deadline allows."""
    if not verdict.admit or verdict.max_backlog_ms is None:
        return verdict
    backlog = max(0.0, queued_ms) + max(0.0, owed_ms)
    if backlog <= verdict.max_backlog_ms:
        return verdict
    # an idle-only allowance (`IDLE_EPS_MS`) waits for the whole backlog to drain
    over = backlog - (verdict.max_backlog_ms if verdict.max_backlog_ms > IDLE_EPS_MS else 0.0)
    wait_s = over * time_scale / 1000.0
    pred = verdict.predicted_ms + backlog * time_scale
    return Verdict(False, pred, verdict.budget_ms, "slo_unattainable", max(cfg.retry_after_s, wait_s))


def pick_within(
    winner: int,
    loads: tuple[float, float],
    limits: tuple[float | None, float | None],
    full: tuple[bool, bool],
) -> int | None:
    """`HANDOFF_PICK`'s choice once the policy's ranking on live load chose ``winner`` (0 or 1)
    between two workers with live backlogs ``loads`` (queued + owed ms) and allowances
    ``limits`` (`max_backlog_ms`; None: no check), ``full`` those whose queue is at its bound:
    the winner when it fits, else the other when it fits and is not full (the request is served
    within its deadline there rather than refused), else None (429 slo_unattainable, nothing
    written). The script does exactly this in Lua, the simulator calls it."""

    def fits(i: int) -> bool:
        lim = limits[i]
        return not full[i] and (lim is None or loads[i] <= lim)

    if fits(winner):
        return winner
    if fits(1 - winner):
        return 1 - winner
    return None


def expected_batch_wait_ms(view: WorkerView, wait_ms: float, batching: bool) -> float:
    """What the batcher may add before dispatch: its window when the worker is busy (work-
    conserving batchers dispatch at once to an idle worker), nothing in direct mode."""
    if not batching or view.owed_ms + view.queued_ms <= 0.0:
        return 0.0
    return wait_ms
