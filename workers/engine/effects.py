"""What the engine core tells its driver. Plain dataclasses: the Triton adapter turns them into
stream events, the simulator into metrics. All times are modelled milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """One request's prefill outcome; also the body of a finished record in `status`."""

    batch_id: str
    request_id: str
    status: str
    first_token: int
    input_tokens: int
    cached_tokens: int
    start_ms: float
    end_ms: float
    kv_expiry_ms: float
    seq: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class BatchStarted:
    batch_id: str
    t_ms: float
    predicted_ms: float


@dataclass(frozen=True, slots=True)
class BatchDone:
    """The batch will produce no more results: its stream's final event."""

    batch_id: str
    t_ms: float


@dataclass(frozen=True, slots=True)
class KvReleased:
    request_id: str
    reason: str  # released | expired | cancelled | reset
    t_ms: float


@dataclass(frozen=True, slots=True)
class DecodeChunk:
    request_id: str
    first_index: int  # index in the output stream of tokens[0]
    tokens: list[int] = field(default_factory=list)
    t_first_ms: float = 0.0
    t_last_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeFinished:
    request_id: str
    reason: str  # length | cancelled | error code
    generated: int
    t_ms: float
    error: str = ""


@dataclass(frozen=True, slots=True)
class ExitRequested:
    """Fault `exit_after_batches` reached: the driver must die abruptly."""

    t_ms: float


Effect = PrefillResult | BatchStarted | BatchDone | KvReleased | DecodeChunk | DecodeFinished | ExitRequested
