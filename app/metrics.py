"""Prometheus metrics of the gateway (DESIGN §9): bounded labels, values pre-registered where the
set is known, per-worker series removed with their worker."""

from __future__ import annotations

import contextlib

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
REAPED_REPLICAS = Counter(
    "flexlb_reaped_replicas_total", "Dead replicas reaped by the master", registry=REGISTRY
)
CACHE_MIRROR_BLOCKS = Gauge(
    "flexlb_cache_mirror_blocks", "Block keys in this replica's cache mirror", ["worker"], registry=REGISTRY
)


def remove_worker_series(worker: str) -> None:
    for g in (WORKER_UP, WORKER_KV_FREE, CACHE_MIRROR_BLOCKS):
        with contextlib.suppress(KeyError):
            g.remove(worker)
    with contextlib.suppress(KeyError):
        WORKER_EPOCH_CHANGES.remove(worker)


_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ORIGIN_OVERHEAD = Histogram(
    "flexlb_origin_overhead_seconds",
    "Origin scheduling work: request arrival to hand-off appended",
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
        "invalid_request",
        "internal",
        "duplicate_request",
    ):
        REQUESTS.labels(_ep, _code)


class SampleRing:
    """Last N samples of a latency, for exact percentiles in benchmarks (histograms bucket them)."""

    def __init__(self, n: int = 20_000) -> None:
        self.n = n
        self.values: list[float] = []

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
CLAIMED = Counter(
    "flexlb_owner_claimed_total",
    "Pending hand-offs taken over from a dead owner, by outcome",
    ["outcome"],
    registry=REGISTRY,
)
for _o in ("delivered", "adopted", "redispatched"):
    CLAIMED.labels(_o)
