"""``kv_headroom_tokens``: unreserved KV on each decode worker (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register


@register("scorer", "kv_headroom_tokens", roles=("decode",))
class KvHeadroom(Plugin):
    """min(kv_free, kv_total − reserved) (`routing.decode_headroom`, measured by `decode_fit`), higher
    is better: counts what every replica has already promised the worker, so a burst between two
    polls spreads out instead of overfilling the worker that looked emptiest."""

    sense = "max"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        return [float(h) for h in c.heads]
