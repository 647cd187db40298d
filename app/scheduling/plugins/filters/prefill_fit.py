"""``prefill_fit``: the prefill fit filter every prefill policy runs first (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register
from app.scheduling.routing import PrefillQuery, eligible_prefill


@register("filter", "prefill_fit", roles=("prefill",))
class PrefillFit(Plugin):
    """Role prefill, up, not draining, and its KV can hold the prompt; measures each one's cache hit.

    The one definition of a prefill worker that may take a prompt (`routing.eligible_prefill`), so
    every policy, the simulator's shortlist and the hand-off agree on it."""

    __slots__ = ()

    def apply(self, q: Any, c: Candidates) -> Candidates:
        assert isinstance(q, PrefillQuery)
        ws, hits = eligible_prefill(q, c.workers)
        return Candidates(ws, hits)
