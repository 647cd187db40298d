"""``decode_running``: sequences running on each decode worker (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, register


@register("scorer", "decode_running", roles=("decode",))
class DecodeRunning:
    """Running sequences at the owner's last poll, lower is better (stale between polls: best as a
    tie-breaker after ``decode_reserved_tokens``)."""

    name = "decode_running"
    sense = "min"
    __slots__ = ()

    def __init__(self, ctx: BuildContext) -> None:
        del ctx

    def score(self, q: Any, c: Candidates) -> list[float]:
        return [float(w.running) for w in c.workers]
