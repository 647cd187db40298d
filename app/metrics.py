"""Prometheus metrics of the gateway (DESIGN §9): bounded labels, values pre-registered where the
set is known, per-worker series removed with their worker."""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

REDIS_COMMANDS = Counter(
    "flexlb_redis_commands_total",
    "Client-issued Redis commands (an EVALSHA counts as one)",
    registry=REGISTRY,
)
REDIS_LATENCY = Histogram(
    "flexlb_redis_latency_seconds",
    "Latency of the replica's Redis health ping",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)
REDIS_UP = Gauge("flexlb_redis_up", "1 while Redis answers, 0 otherwise", registry=REGISTRY)
LEASE_CHANGES = Counter(
    "flexlb_lease_changes_total",
    "Owner and master lease acquisitions and losses",
    ["kind", "change"],
    registry=REGISTRY,
)
for _kind in ("master", "owner"):
    for _change in ("acquired", "lost", "released"):
        LEASE_CHANGES.labels(_kind, _change)
IS_MASTER = Gauge("flexlb_is_master", "1 on the replica holding the master lease", registry=REGISTRY)
OWNED_WORKERS = Gauge("flexlb_owned_workers", "Workers this replica owns", registry=REGISTRY)
LIVE_REPLICAS = Gauge("flexlb_live_replicas", "Live gateway replicas seen by this replica", registry=REGISTRY)
WORKER_UP = Gauge(
    "flexlb_worker_up", "1 when the worker is healthy (owner's view)", ["worker"], registry=REGISTRY
)
WORKER_KV_FREE = Gauge(
    "flexlb_worker_kv_free_tokens", "Free KV tokens on the worker", ["worker"], registry=REGISTRY
)
WORKER_EPOCH_CHANGES = Counter(
    "flexlb_worker_epoch_changes_total", "Worker restarts seen (new epoch)", ["worker"], registry=REGISTRY
)
# How the owner's polls of a worker missed (app/cluster/health.py): a failed one takes it out of
# routing at once, slow ones only after FLEXLB_DOWN_AFTER_SLOW_POLLS in a row.
WORKER_POLLS_SLOW = Counter(
    "flexlb_worker_polls_slow_total", "Owner polls past their deadline", ["worker"], registry=REGISTRY
)
WORKER_POLLS_FAILED = Counter(
    "flexlb_worker_polls_failed_total", "Owner polls refused or broken", ["worker"], registry=REGISTRY
)
REAPED_REPLICAS = Counter(
    "flexlb_reaped_replicas_total", "Dead replicas reaped by the master", registry=REGISTRY
)
CACHE_MIRROR_BLOCKS = Gauge(
    "flexlb_cache_mirror_blocks", "Block keys in this replica's cache mirror", ["worker"], registry=REGISTRY
)


def remove_worker_series(worker: str) -> None:
    """Drop every series labelled with ``worker``: a removed worker must not linger on dashboards as
    a frozen value, and the label set stays bounded by the registry, not by history."""
    for m in _per_worker():
        with contextlib.suppress(KeyError):
            m.remove(worker)


def retain_workers(current: Iterable[str]) -> None:
    """Remove the series of every worker not in ``current`` (the registry just read). Called on each
    registry refresh, so a worker removed through any replica, or while this replica was away,
    loses its series here too — not only on the replica whose admin call removed it."""
    keep = set(current)
    for m in _per_worker():
        seen = {s.labels.get("worker") for fam in m.collect() for s in fam.samples}
        for w in seen - keep - {None}:
            with contextlib.suppress(KeyError):
                m.remove(w)


_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ORIGIN_OVERHEAD = Histogram(
    "flexlb_origin_overhead_seconds",
    "Origin work: HTTP request arrival (before its body is read) to hand-off appended",
    buckets=_FAST,
    registry=REGISTRY,
)
HANDOFF_LATENCY = Histogram(
    "flexlb_handoff_latency_seconds",
    "Hand-off appended to the owner writing the gRPC prefill request",
    buckets=_FAST,
    registry=REGISTRY,
)
TTFT = Histogram(
    "flexlb_ttft_seconds", "Time to first token seen by the gateway", buckets=_SLOW, registry=REGISTRY
)
E2E = Histogram("flexlb_e2e_seconds", "Request arrival to last token", buckets=_SLOW, registry=REGISTRY)
TPOT = Histogram(
    "flexlb_tpot_seconds", "Mean time per output token after the first", buckets=_FAST, registry=REGISTRY
)
REQUESTS = Counter(
    "flexlb_requests_total",
    "Finished requests by endpoint and outcome code",
    ["endpoint", "code"],
    registry=REGISTRY,
)
for _ep in ("completions", "chat", "generate"):
    for _code in (
        "ok",
        "cancelled",
        "deadline_exceeded",
        "worker_error",
        "overloaded",
        "no_worker",
        "state_unavailable",
        "draining",
        "invalid_request",
        "internal",
        "duplicate_request",
    ):
        REQUESTS.labels(_ep, _code)


class _Floats(array):
    """array('d') with list's `clear()`: 8 bytes a sample, where a list of floats takes 32."""

    def clear(self) -> None:
        del self[:]


class SampleRing:
    """Last N samples of a latency, for exact percentiles in benchmarks (histograms bucket them).
    Packed doubles: as a list of float objects the two rings filled to 1.3 MB over the first
    ~20 minutes of a gateway's life (issue 14 soak); packed, they stop at 320 KB."""

    def __init__(self, n: int = 20_000) -> None:
        self.n = n
        self.values: _Floats = _Floats("d")

    def add(self, v: float) -> None:
        self.values.append(v)
        if len(self.values) > self.n:
            del self.values[: len(self.values) - self.n]


SAMPLES: dict[str, SampleRing] = {"origin_overhead_s": SampleRing(), "handoff_latency_s": SampleRing()}

BATCH_FLUSHES = Counter(
    "flexlb_batch_flushes_total", "Prefill batches dispatched by flush reason", ["reason"], registry=REGISTRY
)
for _r in ("idle", "full", "timeout", "predict_threshold", "deadline", "direct"):
    BATCH_FLUSHES.labels(_r)
BATCH_FAILED = Counter(
    "flexlb_batch_refused_total",
    "Items the batcher failed (never fit, SLO passed)",
    ["code"],
    registry=REGISTRY,
)
for _c in ("too_long", "deadline_exceeded"):
    BATCH_FAILED.labels(_c)
BATCH_SIZE = Histogram(
    "flexlb_batch_size",
    "Requests per dispatched prefill batch",
    buckets=(1, 2, 4, 8, 16, 32, 64),
    registry=REGISTRY,
)
BATCH_WAIT = Histogram(
    "flexlb_batch_wait_seconds",
    "Time an item waited in the owner's batcher",
    buckets=_FAST,
    registry=REGISTRY,
)
HANDOFF_IN_PROCESS = Counter(
    "flexlb_handoff_in_process_total",
    "Hand-offs that skipped a Redis hop because origin and owner are the same replica, by step: "
    "`entry` (the origin's hand-off delivered it to the owner's consumer) and `reply`",
    ["step"],
    registry=REGISTRY,
)
for _s in ("entry", "reply"):
    HANDOFF_IN_PROCESS.labels(_s)

CLAIMED = Counter(
    "flexlb_owner_claimed_total",
    "Pending hand-offs taken over from a dead owner, by outcome",
    ["outcome"],
    registry=REGISTRY,
)
# `rerun`: an adopted request run again, once, because its worker restarted (a new epoch) before
# it finished there (app/dispatch/adopt.py); it is also counted `adopted`.
for _o in ("delivered", "adopted", "redispatched", "rerun"):
    CLAIMED.labels(_o)
DISPATCH_EPOCH_RETRIES = Counter(
    "flexlb_dispatch_epoch_retries_total",
    "Prefill batches sent once more under the worker's new epoch after it refused them epoch_mismatch",
    registry=REGISTRY,
)

PREFILL_RETRIES = Counter(
    "flexlb_prefill_retries_total",
    "Requests re-routed once because their prefill batch failed before the worker accepted it",
    registry=REGISTRY,
)
FRESH_PICK_MOVED = Counter(
    "flexlb_fresh_pick_moved_total",
    "Hand-offs that went to the policy's runner-up, ranked above its pick on live load (FLEXLB_FRESH_PICK)",
    registry=REGISTRY,
)

SHARED_SPECULATIVE = Counter(
    "flexlb_shared_speculative_records_total",
    "Speculative-entry records on the workers' spec streams (FLEXLB_SHARED_SPECULATIVE): published by "
    "this replica's owners, failed to publish, applied to this replica's mirror, skipped (own or stale)",
    ["event"],
    registry=REGISTRY,
)
for _e in ("published", "failed", "applied", "skipped"):
    SHARED_SPECULATIVE.labels(_e)


def count_shared_spec(replies: list[object]) -> None:
    """The owner's XADD replies for its speculative records: an error reply is a record lost (a
    hint with a TTL: counted, not retried)."""
    for r in replies:
        SHARED_SPECULATIVE.labels("failed" if isinstance(r, Exception) else "published").inc()


LEDGER_LATE_SETTLED = Counter(
    "flexlb_ledger_late_settled_total",
    "Ledger members settled by the owner's audit, not by their reply (record, missed, ttl)",
    ["path"],
    registry=REGISTRY,
)
for _path in ("record", "missed", "ttl"):
    LEDGER_LATE_SETTLED.labels(_path)

ADMISSION_REJECTIONS = Counter(
    "flexlb_admission_rejections_total",
    "Requests refused or ended for their TTFT deadline, by reason (slo_unattainable and "
    "deadline_too_short at the origin, deadline_passed_in_queue at the owner)",
    ["reason"],
    registry=REGISTRY,
)
for _reason in ("slo_unattainable", "deadline_passed_in_queue", "deadline_too_short"):
    ADMISSION_REJECTIONS.labels(_reason)

LEDGER_ANCHOR_FAILED = Counter(
    "flexlb_ledger_anchor_failed_total",
    "Ledger batches whose start could not be moved to the engine's real start (owed stays estimated)",
    registry=REGISTRY,
)


# ---- per-worker load, exported from the shared snapshots ---------------------------------------
# Every replica reads the snapshot each worker's owner publishes in Redis and exports the same
# values, so one scrape of any replica shows the whole cluster; dashboards take `max by (worker)`.
WORKER_QUEUE_LEN = Gauge(
    "flexlb_worker_queue_len",
    "Work waiting on the worker: queued batches (prefill) or waiting sequences (decode)",
    ["worker"],
    registry=REGISTRY,
)
WORKER_QUEUED = Gauge(
    "flexlb_worker_queued_seconds",
    "Predicted prefill time (modelled) waiting in the worker's hand-off queue",
    ["worker"],
    registry=REGISTRY,
)
WORKER_OWED = Gauge(
    "flexlb_worker_owed_seconds",
    "Predicted time (modelled) still owed by batches committed to the worker",
    ["worker"],
    registry=REGISTRY,
)
WORKER_INFLIGHT_BATCHES = Gauge(
    "flexlb_worker_inflight_batches",
    "Prefill batches committed to the worker and not yet settled",
    ["worker"],
    registry=REGISTRY,
)
WORKER_RUNNING = Gauge(
    "flexlb_worker_running", "Sequences decoding on the worker (decode)", ["worker"], registry=REGISTRY
)
WORKER_RESERVED = Gauge(
    "flexlb_worker_reserved_tokens",
    "Decode KV tokens reserved by routed, unfinished requests",
    ["worker"],
    registry=REGISTRY,
)
WORKER_KV_TOTAL = Gauge(
    "flexlb_worker_kv_total_tokens", "KV capacity of the worker in tokens", ["worker"], registry=REGISTRY
)

_SNAPSHOT_GAUGES: tuple[tuple[Gauge, str, float], ...] = (
    (WORKER_KV_FREE, "kv_free_tokens", 1.0),
    (WORKER_KV_TOTAL, "kv_total_tokens", 1.0),
    (WORKER_QUEUE_LEN, "queue_len", 1.0),
    (WORKER_QUEUED, "queued_ms", 0.001),
    (WORKER_OWED, "owed_ms", 0.001),
    (WORKER_INFLIGHT_BATCHES, "inflight_batches", 1.0),
    (WORKER_RUNNING, "running", 1.0),
    (WORKER_RESERVED, "reserved_tokens", 1.0),
)


def export_worker_snapshot(worker: str, snap: Mapping[str, Any], mirror_blocks: int) -> None:
    """Set the worker's gauges from its published snapshot (fields missing until its owner's first
    poll are left unset rather than exported as a misleading 0)."""
    for gauge, field, scale in _SNAPSHOT_GAUGES:
        v = snap.get(field)
        if v is None or v == "":
            continue
        try:
            gauge.labels(worker).set(float(v) * scale)
        except ValueError:
            continue
    if snap.get("health"):
        WORKER_UP.labels(worker).set(1 if snap["health"] == "up" else 0)
    CACHE_MIRROR_BLOCKS.labels(worker).set(mirror_blocks)
    # 0 series from the start, so increase() sees the first restart or missed poll
    WORKER_EPOCH_CHANGES.labels(worker)
    WORKER_POLLS_SLOW.labels(worker)
    WORKER_POLLS_FAILED.labels(worker)


# ---- rejections, batch prediction, cache hits ---------------------------------------------------
REJECTIONS = Counter(
    "flexlb_rejections_total",
    "Error responses sent to clients before any streaming, by error code",
    ["reason"],
    registry=REGISTRY,
)  # label values pre-registered from the error model in app/gateway/errors.py
_BATCH_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATE_LIMITED = Counter(
    "flexlb_rate_limited_total",
    "Requests refused by a tenant's cluster-wide limit, by the limit that refused them",
    ["limit"],
    registry=REGISTRY,
)
for _limit in ("requests", "tokens", "tokens_above_limit", "concurrent"):  # bounded, pre-registered
    RATE_LIMITED.labels(_limit)
BATCH_PREDICTED = Histogram(
    "flexlb_batch_predicted_seconds",
    "The owner's predicted prefill time of each dispatched batch (modelled seconds)",
    buckets=_BATCH_S,
    registry=REGISTRY,
)
BATCH_ACTUAL = Histogram(
    "flexlb_batch_actual_seconds",
    "Prefill time the worker reported for each batch (modelled seconds)",
    buckets=_BATCH_S,
    registry=REGISTRY,
)
BATCH_TIME_RATIO = Histogram(
    "flexlb_batch_time_ratio",
    "Actual ÷ predicted prefill time per batch (1 = the formula is exact)",
    buckets=(0.25, 0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0),
    registry=REGISTRY,
)
ROUTED_PROMPT_TOKENS = Counter(
    "flexlb_routed_prompt_tokens_total",
    "Prompt tokens dispatched to prefill workers",
    registry=REGISTRY,
)
ROUTED_HIT_TOKENS = Counter(
    "flexlb_routed_cache_hit_tokens_total",
    "Prompt tokens the router expected to be cached on the chosen worker (its mirror's view)",
    registry=REGISTRY,
)
PREFILL_INPUT_TOKENS = Counter(
    "flexlb_prefill_input_tokens_total",
    "Prompt tokens of prefills the workers finished",
    registry=REGISTRY,
)
PREFILL_CACHED_TOKENS = Counter(
    "flexlb_prefill_cached_tokens_total",
    "Prompt tokens the workers served from their prefix cache (the actual hits)",
    registry=REGISTRY,
)


def observe_dispatch(items: Iterable[tuple[int, int]]) -> None:
    """``(prompt_tokens, expected_hit_tokens)`` of each request of a batch being dispatched."""
    for n, hit in items:
        ROUTED_PROMPT_TOKENS.inc(n)
        ROUTED_HIT_TOKENS.inc(max(0, hit))


WORKER_PREFILL_INPUT = Counter(
    "flexlb_worker_prefill_input_tokens_total",
    "Prompt tokens of a worker's finished prefills, counted by the worker's owner",
    ["worker"],
    registry=REGISTRY,
)
WORKER_PREFILL_CACHED = Counter(
    "flexlb_worker_prefill_cached_tokens_total",
    "Of those, tokens the worker's prefix cache served (cached / input = its hit ratio; `flexlb status`)",
    ["worker"],
    registry=REGISTRY,
)


def observe_worker_prefills(wid: str, finished: list[dict[str, Any]]) -> None:
    """The finished records of one status poll (each is reported once, after the owner's last
    seq; a resync after a worker restart may count a few twice, which a ratio tolerates)."""
    inp = cached = 0
    for r in finished:
        if r.get("status") == "ok":
            inp += max(0, int(r.get("input_tokens", 0)))
            cached += max(0, int(r.get("cached_tokens", 0)))
    if inp:
        WORKER_PREFILL_INPUT.labels(wid).inc(inp)
        WORKER_PREFILL_CACHED.labels(wid).inc(cached)


def observe_batch_results(predicted_ms: float, results: list[dict[str, Any]]) -> None:
    """The worker's results of one batch: its run time (all members share the batch's modelled
    start and end) against the prediction, and the cache hits it actually found."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return
    for r in ok:
        PREFILL_INPUT_TOKENS.inc(max(0, int(r.get("input_tokens", 0))))
        PREFILL_CACHED_TOKENS.inc(max(0, int(r.get("cached_tokens", 0))))
    actual_ms = max(float(r["end_ms"]) for r in ok) - min(float(r["start_ms"]) for r in ok)
    if actual_ms < 0 or predicted_ms <= 0:
        return
    BATCH_PREDICTED.observe(predicted_ms / 1000)
    BATCH_ACTUAL.observe(actual_ms / 1000)
    BATCH_TIME_RATIO.observe(actual_ms / predicted_ms)


def _per_worker() -> tuple[Any, ...]:
    return (
        WORKER_UP,
        WORKER_KV_FREE,
        CACHE_MIRROR_BLOCKS,
        WORKER_EPOCH_CHANGES,
        WORKER_POLLS_SLOW,
        WORKER_POLLS_FAILED,
        WORKER_PREFILL_INPUT,
        WORKER_PREFILL_CACHED,
        *(g for g, _, _ in _SNAPSHOT_GAUGES if g is not WORKER_KV_FREE),
    )


REQUEST_ID_REUSED = Counter(
    "flexlb_request_id_reused_total",
    "Client request ids sent again after their request ended: a new attempt (retry) or the stored "
    "outcome (replay)",
    ["result"],
    registry=REGISTRY,
)
for _result in ("retry", "replay"):
    REQUEST_ID_REUSED.labels(result=_result)

DECODE_RESERVE_RETRIES = Counter(
    "flexlb_decode_reserve_retries_total",
    "Decode reservations retried on another worker after the first choice refused (stale snapshot)",
    registry=REGISTRY,
)

# ---- reliability (issue 14): every loop error, every reconciler correction, every retried write
LOOP_ERRORS = Counter(
    "flexlb_loop_errors_total",
    "Failed iterations of a background loop (retried with backoff); 0 in a healthy cluster",
    ["loop"],
    registry=REGISTRY,
)
for _loop in (
    "membership",
    "leases",
    "poller",
    "owner_read",
    "owner_decide",
    "owner_claim",
    "owner_dispatch",
    "cache_follower",
    "replies",
    "notify",
    "refresh",
    "redis_watch",
    "master",
    "reconciler",
    "sweep",
    "terminal_writes",
):
    LOOP_ERRORS.labels(_loop)
RECONCILED = Counter(
    "flexlb_reconciled_total",
    "Corrections made by the master's reconciler, by kind; 0 in a healthy cluster",
    ["kind"],
    registry=REGISTRY,
)
for _kind in (
    "hold_released",
    "record_owner_lost",
    "queued_tombstoned",
    "queued_ms_corrected",
    "reply_stream_deleted",
    "consumer_deleted",
    "origin_set_deleted",
    "record_failed",
):
    RECONCILED.labels(_kind)
TERMINAL_WRITES = Counter(
    "flexlb_terminal_write_retries_total",
    "Terminal writes (transition, release, settle, reply) queued locally after Redis failed, by result",
    ["result"],
    registry=REGISTRY,
)
for _r in ("queued", "applied", "expired", "failed", "dropped_full"):
    TERMINAL_WRITES.labels(_r)
