"""One finished (or failed) request as a benchmark or simulation saw it: the shared unit of results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RequestRecord"]


@dataclass
class RequestRecord:
    """Times are milliseconds (modelled in the simulator, measured wall time live); ``arrival_ms`` is
    relative to the start of the run. A failed request keeps its arrival and error code and has no
    latency (``None``), so error counts and latency percentiles never mix."""

    request_id: str
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    error: str | None = None  # stable error code, e.g. "worker_error", "timeout"
    cached_tokens: int = 0
    prefill_worker: str | None = None
    decode_worker: str | None = None
    batch_size: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar, so a shallow copy is what asdict() would build, at a fraction of
        # its cost (results files hold one line per request, 100K+ in cluster-scale runs).
        return dict(self.__dict__)
