"""``prefill_load_ms``: how soon each prefill worker could start a new prompt (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register


@register("scorer", "prefill_load_ms", roles=("prefill",))
class PrefillLoad(Plugin):
    """owed_ms + queued_ms (committed work left plus what waits), lower is better; cache-blind."""

    sense = "min"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        return [w.owed_ms + w.queued_ms for w in c.workers]
