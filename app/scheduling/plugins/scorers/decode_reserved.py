"""``decode_reserved_tokens``: KV reserved on each decode worker (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register


@register("scorer", "decode_reserved_tokens", roles=("decode",))
class DecodeReserved(Plugin):
    """KV every replica has reserved there for routed-but-unfinished requests, lower is better.

    Updated at each routing decision (one Lua call), unlike the snapshot's running count, so a burst
    between two polls does not all land on one worker; weighting by tokens makes a long request count
    for more. Capacity-blind (the request must still fit: `decode_fit`)."""

    sense = "min"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        return [float(w.reserved_tokens) for w in c.workers]
