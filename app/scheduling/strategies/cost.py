"""``cost`` (the default prefill strategy): send the prompt where it is predicted to finish first.

cost(w) = predict_ms(L, h_w) + owed_ms(w) + queued_ms(w) (DESIGN §7). A long cached prefix makes
``predict_ms`` small, so the cache holder wins until the work already committed to it outweighs what
the cache saves; then a colder but idler worker finishes sooner and gets the prompt. Costs within
max(tie_pct × best, tie_ms) of the best are treated as equal: among them the longest cached prefix
wins (cache affinity keeps a conversation's blocks on one worker), and workers equal on that are
drawn at random: the predictor is only an estimate, and always picking the exact minimum would herd
every replica's requests onto the same worker between two snapshots.

A formula that cannot be evaluated for some prompt raises FormulaEvalError out of ``choose``: that is
a configuration bug, and routing on a made-up cost would hide it.
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


class CostStrategy:
    """Lowest predicted finish time, with near-ties randomised; see the module docstring."""

    name = "cost"
    __slots__ = ("formula", "hotspot_queue_len", "tie_ms", "tie_pct")

    def __init__(
        self,
        formula: Formula,
        tie_pct: float = 0.10,
        tie_ms: float = 20.0,
        hotspot_queue_len: int | None = None,
    ) -> None:
        if not isinstance(formula, Formula):
            raise TypeError(f"formula must be a compiled Formula, not {type(formula).__name__}")
        if tie_pct < 0 or tie_ms < 0:
            raise ValueError(f"tie_pct and tie_ms must be >= 0, got {tie_pct} and {tie_ms}")
        self.formula = formula
        self.tie_pct = tie_pct
        self.tie_ms = tie_ms
        self.hotspot_queue_len = check_hotspot_queue_len(hotspot_queue_len)

    def choose(self, q: PrefillQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, hits = eligible_prefill(q, workers, self.hotspot_queue_len)
        predict = self.formula.predict_one
        size = q.input_tokens
        # Most workers hold no part of the prompt: predict that case once, not once per worker.
        cold = predict(size, 0)
        # One comprehension and the builtin min: the cheapest way through 1,000 workers in Python.
        costs = [
            (predict(size, hit) if hit else cold) + w.owed_ms + w.queued_ms
            for w, hit in zip(ws, hits, strict=True)
        ]
        best = min(costs)
        slack = best * self.tie_pct
        if slack < self.tie_ms:
            slack = self.tie_ms
        limit = best + slack
        tied = [i for i, c in enumerate(costs) if c <= limit]
        if len(tied) > 1:
            # Within the band, cache affinity first: the worker already holding the longest prefix
            # keeps it (and the blocks this prompt adds) warm; randomise only among equal hits.
            top = max(hits[i] for i in tied)
            tied = [i for i in tied if hits[i] == top]
        i = pick_tied(tied, ws, rng)
        hit = hits[i]
        return Choice(
            worker_id=ws[i].id,
            hit_tokens=hit,
            predicted_ms=predict(size, hit) if hit else cold,
            score=costs[i],
            reason="cost" if len(tied) == 1 else "near_tie",
        )
