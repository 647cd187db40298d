"""``prefill_saved_ms``: the prefill time a worker's cached prefix saves (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, register
from app.scheduling.plugins.scorers import FormulaScorer


@register("scorer", "prefill_saved_ms", roles=("prefill",))
class PrefillSaved(FormulaScorer):
    """predict_ms(L, 0) − predict_ms(L, h_w): what the cached prefix saves on this prompt, higher is
    better (0 on a worker without a hit).

    Added to ``predicted_finish_ms`` it values a cache hit beyond this request's own gain: the
    next request of the same conversation or tenant wants that prefix too, and a cold copy on
    another worker evicts someone else's prefix there. ``predicted_finish_ms`` alone is greedy:
    it trades the cache away for a few ms of load, and the follow-ups pay the full prefill.
    Formula-relative (ms saved, not tokens), so one weight fits any engine profile."""

    sense = "max"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        predict = self.formula.predict_one
        size = q.input_tokens
        cold = predict(size, 0)
        return [cold - predict(size, hit) if hit else 0.0 for hit in c.hits]
