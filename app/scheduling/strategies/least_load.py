"""``least_load``: the cache-blind baseline, for prefill and for decode.

Prefill: the lowest ``owed_ms + queued_ms``, i.e. the worker that could start a new prompt soonest,
ignoring what it has cached; it shows how much the cache-aware strategies gain.

Decode: the fewest ``reserved_tokens``, then the fewest ``running`` sequences. Reserved tokens are
the KV every replica has reserved for routed-but-unfinished requests on that worker, updated at each
routing decision (one Lua call), while ``running`` is only as fresh as the owner's last poll:
ranking by the snapshot's running count alone would send every request of a burst between two polls
to the same worker. Weighting by tokens rather than requests makes a long request count for more.
Capacity is deliberately ignored (the request must still fit); ``kv_headroom`` is the capacity-aware
choice.

Exact ties are drawn with ``rng`` (in id order), so an idle fleet is spread evenly.
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
    pick_tied,
)


def least_loaded(ws: Sequence[WorkerView], rng: random.Random) -> tuple[int, float]:
    """Index of a prefill worker with the lowest load (exact ties drawn with ``rng``), and that load.

    Shared with ``prefix``, which falls back to it."""
    best = float("inf")
    tied: list[int] = []
    for i, w in enumerate(ws):
        load = w.owed_ms + w.queued_ms
        if load < best:
            best = load
            tied = [i]
        elif load == best:
            tied.append(i)
    return pick_tied(tied, ws, rng), best


class PrefillLeastLoad:
    """Prefill worker that could start soonest, cache ignored; see the module docstring."""

    name = "least_load"
    __slots__ = ("formula", "hotspot_queue_len")

    def __init__(self, formula: Formula | None = None, hotspot_queue_len: int | None = None) -> None:
        self.formula = formula
        self.hotspot_queue_len = check_hotspot_queue_len(hotspot_queue_len)

    def choose(self, q: PrefillQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, hits = eligible_prefill(q, workers, self.hotspot_queue_len)
        i, load = least_loaded(ws, rng)
        hit = hits[i]
        predicted = self.formula.predict_one(q.input_tokens, hit) if self.formula is not None else 0.0
        return Choice(ws[i].id, hit_tokens=hit, predicted_ms=predicted, score=load, reason="least_load")


class DecodeLeastLoad:
    """Decode worker with the least reserved KV, then fewest running; see the module docstring."""

    name = "least_load"
    __slots__ = ()

    def choose(self, q: DecodeQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, _ = eligible_decode(q, workers)
        best: tuple[int, int] | None = None
        tied: list[int] = []
        for i, w in enumerate(ws):
            key = (w.reserved_tokens, w.running)
            if best is None or key < best:
                best = key
                tied = [i]
            elif key == best:
                tied.append(i)
        i = pick_tied(tied, ws, rng)
        return Choice(ws[i].id, score=float(ws[i].reserved_tokens), reason="least_load")
