"""Scorers: one raw value per candidate with a declared sense (min or max). See README.md."""

from __future__ import annotations

from app.scheduling.formula import Formula
from app.scheduling.plugins.registry import BuildContext, Plugin


class FormulaScorer(Plugin):
    """A scorer that predicts prefill time with the gateway's compiled formula. A context without
    one is a configuration bug, refused when the policy is built rather than routed around."""

    __slots__ = ("formula",)

    def __init__(self, ctx: BuildContext) -> None:
        if not isinstance(ctx.formula, Formula):
            raise TypeError(
                f"scorer {self.name!r} needs a compiled Formula, not {type(ctx.formula).__name__}"
            )
        self.formula = ctx.formula
