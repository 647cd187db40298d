"""Injectable faults, so later tests can cause engine failures for real (not mock them)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class Faults:
    error_rate: float = 0.0  # probability that a request ends engine_error (seeded RNG)
    extra_latency_ms: float = 0.0  # added to every prefill batch and decode fetch (modelled)
    hang: bool = False  # engine makes no progress; the driver stops answering status too
    exit_after_batches: int = 0  # >0: process exits abruptly after this many finished batches
    kv_frame: str = (
        ""  # real engine, prefill: "corrupt" (a flipped byte) or "truncate" the KV frames it sends
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Faults:
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise ValueError(f"unknown fault option(s): {sorted(bad)}")
        f = cls(**d)
        if not 0.0 <= f.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if f.kv_frame not in ("", "corrupt", "truncate"):
            raise ValueError("kv_frame must be '', 'corrupt' or 'truncate'")
        if f.extra_latency_ms < 0 or f.exit_after_batches < 0:
            raise ValueError("extra_latency_ms and exit_after_batches must be >= 0")
        return f
