"""``prefix_affinity``: narrow to the longest-prefix holders unless they are overloaded (see README.md)."""

from __future__ import annotations

from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, Plugin, register


@register("filter", "prefix_affinity", roles=("prefill",))
class PrefixAffinity(Plugin):
    """Keep only the workers holding the longest cached prefix, unless their least loaded one is
    overloaded against the least loaded worker overall; then keep all (sglang's cache-aware rule).

    Overloaded means both: its load (owed + queued ms) exceeds the minimum by more than
    ``balance_abs_ms`` and by a ratio above ``balance_rel``, so small absolute gaps at low load and
    proportionally small gaps at high load both keep the cache. Sets the reason ``prefix`` (narrowed),
    ``load_guard`` (the guard fired) or ``no_hit`` (nobody holds a block)."""

    __slots__ = ("balance_abs_ms", "balance_rel")

    def __init__(self, ctx: BuildContext, *, balance_abs_ms: float = 200.0, balance_rel: float = 1.5) -> None:
        del ctx
        if balance_abs_ms < 0:
            raise ValueError(f"balance_abs_ms must be >= 0, got {balance_abs_ms}")
        if balance_rel < 1:
            raise ValueError(f"balance_rel must be >= 1 (a ratio of loads), got {balance_rel}")
        self.balance_abs_ms = balance_abs_ms
        self.balance_rel = balance_rel

    def apply(self, q: Any, c: Candidates) -> Candidates:
        best_hit = 0
        min_load = float("inf")
        holders: list[int] = []
        holder_load = float("inf")
        for i, (w, hit) in enumerate(zip(c.workers, c.hits, strict=True)):
            load = w.owed_ms + w.queued_ms
            if load < min_load:
                min_load = load
            if hit <= 0 or hit < best_hit:
                continue
            if hit > best_hit:
                best_hit = hit
                holders = [i]
                holder_load = load
            else:
                holders.append(i)
                if load < holder_load:
                    holder_load = load
        if not holders:
            return c.keep(range(len(c.workers)), "no_hit")
        if holder_load - min_load > self.balance_abs_ms and holder_load > min_load * self.balance_rel:
            return c.keep(range(len(c.workers)), "load_guard")
        return c.keep(holders, "prefix")
