"""``best``: the highest utility, near-ties within a band drawn at random (see README.md)."""

from __future__ import annotations

import random
from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, Plugin, Scorer, register
from app.scheduling.routing import pick_tied


@register("picker", "best")
class Best(Plugin):
    """The candidates within ``max(tie_pct × |best|, tie_abs)`` of the best utility are tied; each
    ``tie_break`` scorer in turn keeps only the tied candidates it rates best; one of the rest is
    drawn with ``rng`` (in id order; a single one draws nothing).

    The band is in the first scorer's unit (ms for ``predicted_finish_ms``, tokens for
    ``kv_headroom_tokens``). Why a band: the scores are estimates, and replicas rank from the same
    snapshot, so always taking the exact best would herd every replica's requests onto one worker
    between two polls."""

    __slots__ = ("banded", "tie_abs", "tie_break", "tie_pct")

    def __init__(
        self,
        ctx: BuildContext,
        *,
        tie_pct: float = 0.0,
        tie_abs: float = 0.0,
        tie_break: tuple[str, ...] = (),
    ) -> None:
        if not 0 <= tie_pct < 1:
            raise ValueError(f"tie_pct must be in [0, 1), got {tie_pct}")
        if tie_abs < 0:
            raise ValueError(f"tie_abs must be >= 0, got {tie_abs}")
        self.tie_pct = tie_pct
        self.tie_abs = tie_abs
        self.banded = tie_pct > 0 or tie_abs > 0
        self.tie_break: tuple[Scorer, ...] = tuple(ctx.scorer(n) for n in tie_break)

    def pick(
        self, q: Any, c: Candidates, utils: list[float] | None, sign: float, rng: random.Random
    ) -> tuple[int, bool]:
        if utils is None:
            raise ValueError("picker 'best' needs at least one scorer")
        best = max(utils)
        slack = sign * best * self.tie_pct
        if slack < self.tie_abs:
            slack = self.tie_abs
        limit = best - slack
        tied = [i for i, u in enumerate(utils) if u >= limit]
        for scorer in self.tie_break:
            if len(tied) <= 1:
                break
            vals = scorer.score(q, c.keep(tied))
            top = max(vals) if scorer.sense == "max" else min(vals)
            tied = [i for i, v in zip(tied, vals, strict=True) if v == top]
        return pick_tied(tied, c.workers, rng), self.banded and len(tied) > 1
