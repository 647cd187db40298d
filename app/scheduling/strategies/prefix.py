"""``prefix``: longest cached prefix, unless that worker is overloaded (the approximate routers' rule).

This approximates sglang's cache-aware router, the strategy most deployments compare against: go
where the most leading blocks are cached, because reuse is the biggest single saving, but guard
against the hot-prefix pile-up that pure prefix routing causes (one popular system prompt sends all
traffic to one worker). The guard fires when the holder's load (owed + queued ms) exceeds the least
loaded worker's by more than ``balance_abs_ms`` *and* by a ratio above ``balance_rel``; both must
hold, so small absolute gaps at low load and proportionally small gaps at high load both keep the
cache. When it fires, or no worker holds any block, the request goes to the least loaded worker.
Unlike ``cost`` it never weighs how much the hit saves against how long the queue is; that
difference is what the comparison measures.

Several workers with the same longest hit: the least loaded of them (exact ties drawn with rng).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from app.scheduling.formula import Formula
from app.scheduling.routing import (
    Choice,
    PrefillQuery,
    WorkerView,
    check_hotspot_queue_len,
    eligible_prefill,
    pick_tied,
)
from app.scheduling.strategies.least_load import least_loaded


class PrefixStrategy:
    """Longest prefix match with a load guard; see the module docstring."""

    name = "prefix"
    __slots__ = ("balance_abs_ms", "balance_rel", "formula", "hotspot_queue_len")

    def __init__(
        self,
        formula: Formula | None = None,
        balance_abs_ms: float = 200.0,
        balance_rel: float = 1.5,
        hotspot_queue_len: int | None = None,
    ) -> None:
        if balance_abs_ms < 0:
            raise ValueError(f"balance_abs_ms must be >= 0, got {balance_abs_ms}")
        if balance_rel < 1:
            raise ValueError(f"balance_rel must be >= 1 (a ratio of loads), got {balance_rel}")
        self.formula = formula
        self.balance_abs_ms = balance_abs_ms
        self.balance_rel = balance_rel
        self.hotspot_queue_len = check_hotspot_queue_len(hotspot_queue_len)

    def choose(self, q: PrefillQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, hits = eligible_prefill(q, workers, self.hotspot_queue_len)
        best_hit = 0
        min_load = float("inf")
        holders: list[int] = []
        holder_load = float("inf")
        for i, (w, hit) in enumerate(zip(ws, hits, strict=True)):
            load = w.owed_ms + w.queued_ms
            if load < min_load:
                min_load = load
            if hit <= 0 or hit < best_hit:
                continue
            if hit > best_hit:
                best_hit = hit
                holders = [i]
                holder_load = load
            elif load < holder_load:
                holders = [i]
                holder_load = load
            elif load == holder_load:
                holders.append(i)
        if holders and not (
            holder_load - min_load > self.balance_abs_ms and holder_load > min_load * self.balance_rel
        ):
            i = pick_tied(holders, ws, rng)
            reason = "prefix"
        else:
            i, _ = least_loaded(ws, rng)
            reason = "load_guard" if holders else "no_hit"
        hit = hits[i]
        w = ws[i]
        predicted = self.formula.predict_one(q.input_tokens, hit) if self.formula is not None else 0.0
        return Choice(
            w.id, hit_tokens=hit, predicted_ms=predicted, score=w.owed_ms + w.queued_ms, reason=reason
        )
