"""``round_robin``: each eligible worker in turn, by id, for prefill and for decode.

The state is the id chosen last, not a counter modulo the field size: the next choice is the
smallest eligible id after it (wrapping to the smallest). When workers come, go or are filtered out
between requests, a counter would skip or repeat workers; "next id after the last" keeps the cycle
fair and needs no sorting, one pass per call. Uses no randomness. State is per instance, so each
replica (or simulated replica) cycles on its own, as independent round-robin routers do.
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


class PrefillRoundRobin:
    """Prefill workers in turn by id; see the module docstring."""

    name = "round_robin"
    __slots__ = ("formula", "hotspot_queue_len", "last")

    def __init__(self, formula: Formula | None = None, hotspot_queue_len: int | None = None) -> None:
        self.formula = formula
        self.hotspot_queue_len = check_hotspot_queue_len(hotspot_queue_len)
        self.last: str | None = None

    def choose(self, q: PrefillQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, hits = eligible_prefill(q, workers, self.hotspot_queue_len)
        i = next_after(ws, self.last)
        w = ws[i]
        self.last = w.id
        hit = hits[i]
        predicted = self.formula.predict_one(q.input_tokens, hit) if self.formula is not None else 0.0
        return Choice(w.id, hit_tokens=hit, predicted_ms=predicted, reason="round_robin")


class DecodeRoundRobin:
    """Decode workers with room, in turn by id; see the module docstring."""

    name = "round_robin"
    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: str | None = None

    def choose(self, q: DecodeQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, heads = eligible_decode(q, workers)
        i = next_after(ws, self.last)
        self.last = ws[i].id
        return Choice(ws[i].id, score=float(heads[i]), reason="round_robin")
