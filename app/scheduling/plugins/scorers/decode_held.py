"""``decode_held_tokens``: the request's prompt tokens a decode worker already holds (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register
from app.scheduling.routing import DecodeQuery


@register("scorer", "decode_held_tokens", roles=("decode",))
class DecodeHeld(Plugin):
    """Tokens of the request's prompt that the origin's holds on the worker already name
    (`DecodeQuery.held`, at most its shareable part), higher is better. For declared policies, e.g.
    as ``best``'s tie-break: among workers within the band of the best headroom the holder keeps
    the prompt. Not in the built-in ``kv_headroom``: there it piled an application's sequences onto
    one worker (chat_agents, 1 replica: TPOT p99 +6-8 ms at loads 4-5, docs/benchmarks.md), while
    the headroom for this request (`eligible_decode`) already sends a request to its holder
    whenever that leaves the most room by more than the band."""

    sense = "max"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        held = q.held if isinstance(q, DecodeQuery) else None
        if not held:
            return [0.0] * len(c.workers)
        cap = q.shareable_tokens
        return [float(min(held.get(w.id, 0), cap)) for w in c.workers]
