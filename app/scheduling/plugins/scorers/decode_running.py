"""``decode_running``: sequences running on each decode worker (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register


@register("scorer", "decode_running", roles=("decode",))
class DecodeRunning(Plugin):
    """Running sequences at the owner's last poll, lower is better (stale between polls: best as a
    tie-breaker after ``decode_reserved_tokens``)."""

    sense = "min"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        return [float(w.running) for w in c.workers]
