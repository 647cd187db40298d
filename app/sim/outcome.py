"""What a simulation run produces: per-request state and records, the run's outcome, and the
trace's capacity estimate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.report.records import RequestRecord
from app.scheduling.formula import BatchItem
from app.sim.config import SimConfig
from app.traces.model import Trace

__all__ = ["ReqState", "SimOutcome", "build_records", "mean_cold_prefill_ms"]


@dataclass(slots=True)
class ReqState:
    """Where one simulated request stands: its workers, reservation, timestamps and outcome."""

    origin: int = 0
    prefill: int = -1
    decode: int = -1
    predicted_ms: float = 0.0
    reserved: int = 0
    t_first: float | None = None
    t_end: float | None = None
    cached: int = 0
    batch_size: int | None = None
    error: str | None = None
    done: bool = False


@dataclass
class SimOutcome:
    records: list[RequestRecord]
    flush_reasons: dict[str, int]
    rejections: dict[str, int]
    batches: int
    events: int
    end_ms: float
    extra: dict[str, Any] = field(default_factory=dict)


def mean_cold_prefill_ms(trace: Trace, cfg: SimConfig) -> float:
    """Mean modelled time of each request's prefill alone, with no cache hit: the denominator of the
    capacity estimate behind ``--load``."""
    prof = cfg.engine_profile()
    limit = min(prof.kv_capacity_tokens, prof.max_context_tokens)
    vals = [
        prof.prefill_batch_ms([BatchItem(r.input_len, 0)]) for r in trace.requests if 0 < r.input_len <= limit
    ]
    return sum(vals) / len(vals) if vals else 0.0


def build_records(
    trace: Trace, reqs: list[ReqState], pids: list[str], dids: list[str]
) -> list[RequestRecord]:
    """One record per trace request, in trace order; a request still running at the end is `unfinished`."""
    out: list[RequestRecord] = []
    for tr, st in zip(trace.requests, reqs, strict=True):
        max_new = max(1, tr.output_len)
        ttft = e2e = tpot = None
        if st.error is None and st.t_first is not None and st.t_end is not None:
            ttft = st.t_first - tr.arrival_ms
            e2e = st.t_end - tr.arrival_ms
            if max_new > 1:
                tpot = (st.t_end - st.t_first) / (max_new - 1)
        elif st.error is None:
            st.error = "unfinished"
        out.append(
            RequestRecord(
                request_id=f"r{tr.index}",
                arrival_ms=tr.arrival_ms,
                input_tokens=tr.input_len,
                output_tokens=max_new,
                ttft_ms=ttft,
                tpot_ms=tpot,
                e2e_ms=e2e,
                error=st.error,
                cached_tokens=st.cached if st.error is None else 0,
                prefill_worker=pids[st.prefill] if st.prefill >= 0 else None,
                decode_worker=dids[st.decode] if st.decode >= 0 else None,
                batch_size=st.batch_size,
            )
        )
    return out
