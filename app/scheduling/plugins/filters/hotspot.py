"""``hotspot``: drop prefill workers whose queue is longer than a bound (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, Plugin, register
from app.scheduling.routing import NoWorker, check_hotspot_queue_len


@register("filter", "hotspot", roles=("prefill",))
class Hotspot(Plugin):
    """Keep prefill workers with ``queue_len <= hotspot_queue_len``; None (the default) keeps all.

    A hard bound on queued batches, for deployments that prefer a refusal to an unbounded wait."""

    __slots__ = ("hotspot_queue_len",)

    def __init__(self, ctx: BuildContext, *, hotspot_queue_len: int | None = None) -> None:
        del ctx
        self.hotspot_queue_len = check_hotspot_queue_len(hotspot_queue_len)

    def apply(self, q: Any, c: Candidates) -> Candidates:
        bound = self.hotspot_queue_len
        if bound is None:
            return c
        idx = [i for i, w in enumerate(c.workers) if w.queue_len <= bound]
        if not idx:
            raise NoWorker(f"every prefill worker that fits is a hotspot (queue_len > {bound})")
        return c if len(idx) == len(c.workers) else c.keep(idx)
