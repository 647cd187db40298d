"""The prefill engine's records: a submitted request, its batch and members, and the KV a
prefilled request keeps pinned until the decode side fetches it.

Split out of `workers.engine.prefill` (issue #18: modules <= ~500 lines), which re-exports
`INF`, `PrefillRequest` and `SubmitOutcome` for its callers; pure data, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .effects import Effect

INF = float("inf")


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    input_tokens: int
    block_keys: tuple[int, ...] = ()  # keys of the prompt's full blocks, in order


@dataclass(slots=True)
class Member:
    req: PrefillRequest
    cached_tokens: int = 0
    hit_keys: tuple[int, ...] = ()
    done: bool = False


@dataclass(slots=True)
class Batch:
    batch_id: str
    members: dict[str, Member]
    submitted_ms: float
    phase: str = "queued"  # queued | running | done
    start_ms: float = 0.0
    end_ms: float = INF
    predicted_ms: float = 0.0
    compute_tokens: int = 0


@dataclass(slots=True)
class Pinned:
    """KV of a prefilled request kept until the decode side fetched it or the handle expired."""

    keys: list[int]
    outside_tokens: int
    expiry_ms: float


@dataclass(frozen=True)
class SubmitOutcome:
    accepted: bool
    duplicate: bool
    queue_position: int
    effects: list[Effect] = field(default_factory=list)
    error: str = ""
