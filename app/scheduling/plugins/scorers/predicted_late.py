"""``predicted_late_ms``: how far past a latency budget a prompt would finish (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, register
from app.scheduling.plugins.scorers import FormulaScorer


@register("scorer", "predicted_late_ms", roles=("prefill",))
class PredictedLate(FormulaScorer):
    """max(0, predicted_finish_ms − budget_ms), lower is better: 0 on every worker that would
    finish the prompt within ``budget_ms``.

    Added to a down-weighted ``predicted_finish_ms`` it makes the latency cost piecewise linear:
    cheap while a worker would still answer well inside the SLO, full price past the budget. Goodput
    counts a request that meets its SLO the same however early it does, while the prefill a cached
    prefix saves is capacity for every later request; so below the budget a cache holder keeps its
    prefix against a backlog several times the saving, and above it the finish time decides again.
    """

    sense = "min"
    __slots__ = ("budget_ms",)

    def __init__(self, ctx: BuildContext, *, budget_ms: float = 1000.0) -> None:
        super().__init__(ctx)
        if not budget_ms >= 0:
            raise ValueError(f"budget_ms must be >= 0, got {budget_ms}")
        self.budget_ms = float(budget_ms)

    def score(self, q: Any, c: Candidates) -> list[float]:
        predict = self.formula.predict_one
        size = q.input_tokens
        cold = predict(size, 0)
        budget = self.budget_ms
        out = []
        for w, hit in zip(c.workers, c.hits, strict=True):
            late = (predict(size, hit) if hit else cold) + w.owed_ms + w.queued_ms - budget
            out.append(late if late > 0 else 0.0)
        return out
