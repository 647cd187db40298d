"""``random``: a uniform draw over the eligible workers, for prefill and for decode.

The floor every other strategy must beat, and the usual baseline in routing studies. The draw is
over the eligible workers in the order given (sorting a 1,000-worker fleet per request would cost
more than the draw), so it is reproducible for the same worker sequence and ``rng`` state. (Named
``random_pick`` so the module does not read like the standard library's ``random``.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from app.scheduling.formula import Formula
from app.scheduling.routing import (
    Choice,
    DecodeQuery,
    PrefillQuery,
    WorkerView,
    check_hotspot_queue_len,
    eligible_decode,
    eligible_prefill,
)


class PrefillRandom:
    """A uniformly random eligible prefill worker."""

    name = "random"
    __slots__ = ("formula", "hotspot_queue_len")

    def __init__(self, formula: Formula | None = None, hotspot_queue_len: int | None = None) -> None:
        self.formula = formula
        self.hotspot_queue_len = check_hotspot_queue_len(hotspot_queue_len)

    def choose(self, q: PrefillQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, hits = eligible_prefill(q, workers, self.hotspot_queue_len)
        i = rng.randrange(len(ws))
        hit = hits[i]
        predicted = self.formula.predict_one(q.input_tokens, hit) if self.formula is not None else 0.0
        return Choice(ws[i].id, hit_tokens=hit, predicted_ms=predicted, reason="random")


class DecodeRandom:
    """A uniformly random decode worker among those with room for the request."""

    name = "random"
    __slots__ = ()

    def choose(self, q: DecodeQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, heads = eligible_decode(q, workers)
        i = rng.randrange(len(ws))
        return Choice(ws[i].id, score=float(heads[i]), reason="random")
