"""One `flexlb simulate` invocation: prepare the trace, simulate each policy, summarise, write results.

Load (``--load X``): the offered arrival rate is X × the estimated cluster prefill capacity, where
capacity = prefill workers × 1000 / (mean modelled prefill ms of the trace's prompts, each alone and
with no cache hit). The trace's arrivals are compressed or stretched by one factor to get there, so
its burstiness and prefix reuse order are kept. The estimate is deliberately cache- and batching-blind:
it is a property of the trace and the hardware, the same for every policy; a policy that reuses
cache or batches well has headroom beyond it, one that does not runs hotter.

Large clusters (``--copies``, default ``max(1, prefill // 8)``): the trace is replicated with one block
namespace per copy (`app.traces.replicate`), so 1,000 workers see many tenants with the trace's own
reuse pattern instead of one tenant compressed 125-fold; ``--max-requests`` then keeps the first N
arrivals of the merged trace.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.report import RequestRecord, summarize, write_results
from app.scheduling.batcher import BatcherConfig
from app.sim.cluster import ClusterSim, SimOutcome, mean_cold_prefill_ms
from app.sim.config import SimConfig, batcher_config
from app.traces import Trace, replicate, scale_time, slice_trace, trace_bounds

__all__ = ["PolicySpec", "SimRun", "prepare_trace", "run_simulation"]


@dataclass(frozen=True)
class PolicySpec:
    """One row of the comparison: a prefill strategy and the owner's batching mode."""

    name: str  # as shown in the results ("cost", "cost@direct", ...)
    strategy: str
    batching: str


@dataclass
class SimRun:
    policies: dict[str, dict[str, Any]]
    records: dict[str, list[RequestRecord]]
    meta: dict[str, Any]
    outcomes: dict[str, SimOutcome] = field(default_factory=dict)


def prepare_trace(
    trace: Trace,
    cfg: SimConfig,
    *,
    load: float | None,
    copies: int | None,
    max_requests: int | None,
    slice_: tuple[int, int | None] | None,
) -> tuple[Trace, dict[str, Any]]:
    """Slice, replicate, cap and time-scale ``trace`` as the module docstring says; returns it with
    the numbers behind the scaling (for results.json's meta)."""
    info: dict[str, Any] = {"trace_requests": len(trace), "trace_rate_rps": round(trace.mean_rate_rps, 4)}
    if slice_ is not None:
        trace = slice_trace(trace, slice_[0], slice_[1])
    n_copies = copies if copies is not None else max(1, cfg.prefill // 8)
    if n_copies > 1:
        trace = replicate(trace, n_copies, seed=cfg.seed, max_requests=max_requests)
    elif max_requests is not None and len(trace) > max_requests:
        trace = slice_trace(trace, 0, max_requests)
    mean_ms = mean_cold_prefill_ms(trace, cfg)
    capacity = cfg.prefill * 1000.0 / mean_ms if mean_ms > 0 else 0.0
    rate = trace.mean_rate_rps
    speed = 1.0
    if load is not None and rate > 0 and capacity > 0:
        speed = load * capacity / rate
        trace = scale_time(trace, speed)
    info.update(
        {
            "copies": n_copies,
            "requests": len(trace),
            "mean_cold_prefill_ms": round(mean_ms, 3),
            "capacity_rps_estimate": round(capacity, 4),
            "speed": round(speed, 6),
            "offered_rate_rps": round(trace.mean_rate_rps, 4),
            "offered_load": round(trace.mean_rate_rps / capacity, 4) if capacity else None,
            "span_s": round(trace.span_ms / 1000.0, 3),
            "prefill_only_requests": sum(1 for r in trace.requests if r.output_len <= 1),
        }
    )
    return trace, info


def run_simulation(
    trace: Trace,
    cfg: SimConfig,
    policies: list[PolicySpec],
    *,
    base_batcher: BatcherConfig | None = None,
    meta: dict[str, Any] | None = None,
    progress: Any = None,
) -> SimRun:
    """Simulate each policy on the same (prepared) trace and summarise it with both hit-ratio bounds.

    ``progress`` (optional) is called with (policy name, index, count) before each policy.
    """
    cfg.validate()
    pooled = cfg.prefill * cfg.engine_profile().kv_capacity_tokens
    t0 = time.perf_counter()
    bounds = trace_bounds(trace, pooled)
    bounds_s = time.perf_counter() - t0
    out: dict[str, dict[str, Any]] = {}
    records: dict[str, list[RequestRecord]] = {}
    outcomes: dict[str, SimOutcome] = {}
    timing: dict[str, float] = {"bounds_s": round(bounds_s, 3)}
    for k, spec in enumerate(policies):
        if progress is not None:
            progress(spec.name, k, len(policies))
        bcfg = batcher_config(spec.batching, cfg.slo_ttft_ms, base_batcher)
        t1 = time.perf_counter()
        sim = ClusterSim(trace, cfg, spec.strategy, bcfg)
        res = sim.run()
        timing[spec.name] = round(time.perf_counter() - t1, 3)
        duration_s = _prefill_window_s(trace, res)
        m = summarize(res.records, slo_ttft_ms=cfg.slo_ttft_ms, duration_s=duration_s)
        m.update(bounds)
        m["strategy"] = spec.strategy
        m["batching"] = spec.batching
        m["batches"] = res.batches
        m["flush_reasons"] = res.flush_reasons
        m["rejections"] = res.rejections
        m["events"] = res.events
        m.update(res.extra)
        out[spec.name] = m
        records[spec.name] = res.records
        outcomes[spec.name] = res
    full_meta: dict[str, Any] = {
        "tool": "simulate",
        "trace": trace.name,
        "trace_format": trace.format,
        "block_size": trace.block_size,
        "prefill": cfg.prefill,
        "decode": cfg.decode,
        "replicas": cfg.replicas,
        "seed": cfg.seed,
        "profile": cfg.profile,
        "formula": cfg.gateway_formula().source,
        "decode_strategy": cfg.decode_strategy,
        "slo_ttft_ms": cfg.slo_ttft_ms,
        "poll_interval_ms": cfg.poll_interval_ms,
        "speculative_ttl_ms": cfg.speculative_ttl_ms,
        "handoff_latency_ms": cfg.handoff_latency_ms,
        "reply_latency_ms": cfg.reply_latency_ms,
        "kv_handle_ttl_ms": cfg.kv_handle_ttl_ms,
        "pooled_kv_capacity_tokens": pooled,
        "notes": [
            "times are modelled ms on a virtual clock (engine profile above), not wall time",
            "rows with output 0 (flexlb trace) run prefill only (max_tokens 1): TTFT = e2e, no TPOT",
            "hit ratios are token-weighted; *_blocks keys give the block ratios",
        ],
        **(meta or {}),
        "timing_s": timing,
        "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
    }
    return SimRun(out, records, full_meta, outcomes)


def _prefill_window_s(trace: Trace, res: SimOutcome) -> float:
    """Seconds from the first arrival to the later of the last arrival and the last first token.

    Throughput and goodput are per second of this window: it stretches when prefill falls behind
    the arrivals, but not by the decode tail (a 20,000-token answer streams for minutes after the
    last arrival and would make every policy look equally idle).
    """
    last = trace.span_ms
    for r in res.records:
        if r.ttft_ms is not None:
            t = r.arrival_ms + r.ttft_ms
            if t > last:
                last = t
    return last / 1000.0


def write_run(run: SimRun, output: Path) -> None:
    write_results(output, run.policies, run.records, run.meta)
