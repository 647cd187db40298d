"""``decode_fit``: the decode fit filter every decode policy runs first (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register
from app.scheduling.routing import DecodeQuery, eligible_decode


@register("filter", "decode_fit", roles=("decode",))
class DecodeFit(Plugin):
    """Role decode, up, not draining, and KV headroom for input + max_new tokens; measures headroom.

    A decode worker that runs out of KV mid-stream must preempt or fail, which costs far more than
    any balancing gain, so every decode policy fits the request first (`routing.eligible_decode`)."""

    __slots__ = ()

    def apply(self, q: Any, c: Candidates) -> Candidates:
        assert isinstance(q, DecodeQuery)
        ws, heads = eligible_decode(q, c.workers)
        return Candidates(ws, heads=heads)
