"""``predicted_finish_ms``: when a prompt would finish on each prefill worker (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import Candidates, register
from app.scheduling.plugins.scorers import FormulaScorer


@register("scorer", "predicted_finish_ms", roles=("prefill",))
class PredictedFinish(FormulaScorer):
    """predict_ms(L, h_w) + owed_ms(w) + queued_ms(w), lower is better (DESIGN §7).

    A long cached prefix makes ``predict_ms`` small, so the cache holder wins until the work already
    committed to it outweighs what the cache saves. Needs the gateway's compiled formula; one that
    cannot be evaluated raises FormulaEvalError (a configuration bug, not something to route around)."""

    sense = "min"
    __slots__ = ()

    def score(self, q: Any, c: Candidates) -> list[float]:
        predict = self.formula.predict_one
        size = q.input_tokens
        cold = predict(size, 0)  # most workers hold no part of the prompt: predict that once
        return [
            (predict(size, hit) if hit else cold) + w.owed_ms + w.queued_ms
            for w, hit in zip(c.workers, c.hits, strict=True)
        ]
