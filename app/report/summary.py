"""Flat metrics of one run (one policy): what results.json, the markdown table and the stdout table show.

Flat on purpose: every key is a number (or the error histogram), so two runs, or a live replay and a
simulation, compare by key without knowing either tool.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from app.report.records import RequestRecord

__all__ = ["METRIC_KEYS", "percentile", "summarize"]

# Every key `summarize` returns, in display order.
METRIC_KEYS = (
    "n_requests",
    "n_ok",
    "n_errors",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "ttft_mean_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "throughput_rps",
    "goodput_rps",
    "goodput_ratio",
    "slo_ttft_ms",
    "duration_s",
    "hit_ratio_routed",
    "mean_batch_size",
    "errors",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]; None for no values.

    Written out rather than calling numpy so the result is a plain float with no dtype surprises in
    JSON, and identical for identical inputs whatever numpy version is installed.
    """
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    frac = pos - lo
    return float(s[lo] + (s[hi] - s[lo]) * frac)


def summarize(records: list[RequestRecord], *, slo_ttft_ms: float, duration_s: float) -> dict[str, Any]:
    """Flat metrics over ``records``.

    Latency percentiles are over successful requests; TPOT over those that produced more than one
    token. ``throughput_rps`` counts successful requests per second of ``duration_s`` (the run's
    span, chosen by the caller: arrivals span plus drain, or wall time live); ``goodput_rps`` counts
    those whose TTFT met ``slo_ttft_ms``. ``hit_ratio_routed`` is cached input tokens / input tokens
    of the successful requests; ``errors`` maps each error code to its count (sorted by code).
    """
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    good = sum(1 for r in ok if r.ttft_ms is not None and r.ttft_ms <= slo_ttft_ms)
    inp = sum(r.input_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    sizes = [r.batch_size for r in ok if r.batch_size is not None]
    errors = Counter(r.error for r in records if r.error is not None)
    dur = duration_s if duration_s > 0 else 0.0
    return {
        "n_requests": len(records),
        "n_ok": len(ok),
        "n_errors": len(records) - len(ok),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None,
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "throughput_rps": len(ok) / dur if dur else 0.0,
        "goodput_rps": good / dur if dur else 0.0,
        "goodput_ratio": good / len(records) if records else 0.0,
        "slo_ttft_ms": slo_ttft_ms,
        "duration_s": duration_s,
        "hit_ratio_routed": cached / inp if inp else 0.0,
        "mean_batch_size": sum(sizes) / len(sizes) if sizes else None,
        "errors": dict(sorted(errors.items())),
    }
