"""Request traces (loading, slicing, time scaling, replication, synthetic load) and hit-ratio bounds."""

from app.traces.bounds import (
    pooled_lru_hit_ratio,
    pooled_lru_token_hit_ratio,
    theoretical_hit_ratio,
    theoretical_token_hit_ratio,
    trace_bounds,
)
from app.traces.model import (
    FORMATS,
    Trace,
    TraceError,
    TraceRequest,
    load_trace,
    parse_slice,
    replicate,
    save_trace,
    scale_time,
    slice_trace,
    synthetic_trace,
)

__all__ = [
    "FORMATS",
    "Trace",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "parse_slice",
    "pooled_lru_hit_ratio",
    "pooled_lru_token_hit_ratio",
    "replicate",
    "save_trace",
    "scale_time",
    "slice_trace",
    "synthetic_trace",
    "theoretical_hit_ratio",
    "theoretical_token_hit_ratio",
    "trace_bounds",
]
