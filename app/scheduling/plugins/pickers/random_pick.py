"""``random``: a uniform draw over the candidates (see README.md)."""

from __future__ import annotations

import random
from typing import Any

from app.scheduling.plugins.registry import Candidates, Plugin, register


@register("picker", "random")
class RandomPick(Plugin):
    """One candidate drawn uniformly with ``rng``, in the order given (sorting a 1,000-worker fleet
    per request would cost more than the draw). The floor every other policy must beat."""

    __slots__ = ()

    def pick(
        self, q: Any, c: Candidates, utils: list[float] | None, sign: float, rng: random.Random
    ) -> tuple[int, bool]:
        return rng.randrange(len(c.workers)), False
