"""The request path's shared types: the request, its progress, and the exits every stage raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.gateway.errors import ApiError

#: Wall ms the gateway itself needs between admission and a first token (hand-off, the owner's
#: read, the reply) on a loaded host, on top of the worker's predicted time (SLO admission).
GATEWAY_FLOOR_MS = 20.0

TERMINAL = {"completed", "failed", "cancelled", "timed_out", "owner_lost"}
ENGINE_TO_API = {
    "cancelled": "cancelled",
    "too_long": "invalid_request",
    "invalid_request": "invalid_request",
    "duplicate": "duplicate_request",
    "deadline_exceeded": "deadline_exceeded",  # the owner ended it: its TTFT deadline passed queued
}


class LimitCheck(Protocol):
    async def run(
        self, rid: str, cmds: Sequence[Sequence[Any]], on_last: Callable[[Any], None] | None = None
    ) -> list[Any]:
        """The tenant's check, then `cmds` (one round trip) when it passed: their replies; raises
        ApiError `rate_limited` when refused, with nothing written. `on_last`: the last command's
        reply as it arrives (`StateStore.hooked`)."""
        ...


@dataclass
class GenRequest:
    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    timeout_ms: int
    trace_id: str = ""
    endpoint: str = "generate"
    # The gateway made the id up (a fresh UUID): it cannot collide with a live or finished one,
    # so recording the request and handing it off may share one round trip.
    fresh_id: bool = False
    # OpenAI `stop`: fed each output chunk in order, returns how many of its ids to keep when a
    # stop string completed in it (app/api/stop.py). Decoding then ends with finish_reason "stop".
    stop: Callable[[Sequence[int]], int | None] | None = None
    user: str = ""  # OpenAI `user`: only logged
    # TTFT deadline in wall ms from arrival (`deadline_ms` / `x-flexlb-slo-ms`); 0 = the
    # cluster SLO. SLO admission refuses what cannot meet it; the owner ends it if it passes.
    deadline_ms: float = 0.0
    # temperature / top_p / seed (those given): they travel in the hand-off to the prefill batch,
    # and on in the KV to decode. The simulated engines ignore them; a real one samples by them.
    sampling: dict[str, float | int] | None = None
    priority: int = 1  # level of its x-flexlb-priority class (app/dispatch/items.py); `pr` if not 1
    # perf_counter() when its HTTP request arrived (app/api/arrival.py); 0 = when the pipeline starts
    t_arrival: float = 0.0
    # The tenant's limit check (app/security/tenants.LimitCheck) when it has limits: the first
    # round trip that records the request runs through it, so a refused request writes nothing.
    limit: LimitCheck | None = None
    # Called once the request is admitted and queued on its prefill worker with its decode KV
    # held: no typed HTTP refusal is left, so a stream may send its 200 before the first token
    # (app/api/streaming.py, FLEXLB_SSE_KEEPALIVE_S). None: nobody waits for it.
    on_admitted: Callable[[], None] | None = None


@dataclass
class Progress:
    """What the clean-up needs to know about how far the request got."""

    stage: str = "new"  # new | recorded | reserved | handed_off | prefilled | decoding | done
    prefill_worker: str = ""
    decode_worker: str = ""
    batch_id: str = ""
    batch_size: int = 1
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    t0: float = 0.0
    t_handoff: float = 0.0
    t_first: float = 0.0
    prefill_ms: float = 0.0
    queue_ms: float = 0.0
    handoffs: int = 0  # hand-offs made so far; each reply names the one it answers
    packed: bytes = b""  # the prompt as little-endian int32, converted once for keys and hand-off
    block_size: int = 0  # of `keys`: 0 until the prompt's block keys are computed (once)
    keys: list[int] = field(default_factory=list)  # the prompt's full-block keys (routing, decode holds)


class StoredOutcome(Exception):
    """The request id already finished: the stored outcome is the answer (idempotent retry)."""

    def __init__(self, outcome: dict[str, Any]) -> None:
        super().__init__("stored outcome")
        self.outcome = outcome


class NotStarted(Exception):
    """A prefill hand-off whose batch failed before the worker accepted it."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error
