"""``decode_held_tokens``: the request's prompt tokens a decode worker already holds (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register
from app.scheduling.routing import DecodeQuery


@register("scorer", "decode_held_tokens", roles=("decode",))
class DecodeHeld(Plugin):
    """Tokens of the request's prompt that the origin's holds on the worker already name
    (`DecodeQuery.held`, at most its shareable part), higher is better. The built-in
    ``kv_headroom`` breaks its near-ties with it: among workers whose headroom for this request is
    within the band of the best, the one holding the prompt keeps it, so an application's or a
    session's requests share their blocks there instead of being drawn apart; a worker outside the
    band is never preferred for what it holds."""

    sense = "max"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        held = q.held if isinstance(q, DecodeQuery) else None
        if not held:
            return [0.0] * len(c.workers)
        cap = q.shareable_tokens
        return [float(min(held.get(w.id, 0), cap)) for w in c.workers]
