"""``cache_hit_tokens``: the cached prefix each prefill worker would reuse (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register


@register("scorer", "cache_hit_tokens", roles=("prefill",))
class CacheHit(Plugin):
    """Tokens of the prompt's leading full blocks the worker holds (capped as in `prefill_fit`),
    higher is better: cache affinity, e.g. as a tie-breaker keeping a conversation on one worker."""

    sense = "max"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        return [float(h) for h in c.hits]
