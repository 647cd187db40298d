"""``round_robin``: each candidate in turn, by id (see README.md)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, Plugin, register
from app.scheduling.routing import WorkerView


def next_after(ws: Sequence[WorkerView], last: str | None) -> int:
    """Index of the worker with the smallest id greater than ``last``, else of the smallest id."""
    first = nxt = -1
    for i, w in enumerate(ws):
        wid = w.id
        if first < 0 or wid < ws[first].id:
            first = i
        if last is not None and wid > last and (nxt < 0 or wid < ws[nxt].id):
            nxt = i
    return nxt if nxt >= 0 else first


@register("picker", "round_robin")
class RoundRobin(Plugin):
    """The smallest candidate id after the one chosen last (wrapping to the smallest).

    The state is the id chosen last, not a counter modulo the field size: when workers come, go or
    are filtered out between requests, a counter would skip or repeat workers. No randomness; state
    per instance, so each replica (or simulated replica) cycles on its own."""

    __slots__ = ("last",)

    def __init__(self, ctx: BuildContext) -> None:
        del ctx
        self.last: str | None = None

    def pick(
        self, q: Any, c: Candidates, utils: list[float] | None, sign: float, rng: random.Random
    ) -> tuple[int, bool]:
        i = next_after(c.workers, self.last)
        self.last = c.workers[i].id
        return i, False
