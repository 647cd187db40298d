"""Per-request status codes the engines report. Stable strings: they travel over gRPC, are stored in
Redis and mapped by the gateway onto its HTTP error model."""

from __future__ import annotations

from enum import StrEnum


class EngineStatus(StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"
    ENGINE_ERROR = "engine_error"  # injected fault or engine failure; retryable elsewhere
    INVALID = "invalid_request"  # malformed input; never retryable
    TOO_LONG = "too_long"  # prompt (or prompt + output) can never fit this engine's KV
    EPOCH_MISMATCH = "epoch_mismatch"  # caller expected another process incarnation
    KV_EXPIRED = "kv_expired"  # the prefill KV handle expired or was released
    DUPLICATE = "duplicate"  # same request id already known to this engine
    UNKNOWN = "unknown_request"


FINISH_LENGTH = "length"
FINISH_STOP = "stop"  # decode met an end-of-sequence token (real engines only)
