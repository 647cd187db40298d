"""bench/cliff.py's markdown tables (``render``, also ``--render``) from its JSON rows, with the
capacity and 90 % crossing read off each policy's loads."""

from __future__ import annotations

import itertools
import math
from typing import Any


def capacity(by_load: dict[float, dict[str, Any]]) -> float:
    """Highest load with goodput ≥ 90 % (0 when none)."""
    ok = [ld for ld, r in by_load.items() if r["goodput_pct"] >= 90.0]
    return max(ok) if ok else 0.0


def crossing(by_load: dict[float, dict[str, Any]]) -> str:
    """The load where goodput first falls below 90 %, interpolated linearly between the two grid
    loads around it: finer than the grid's step, which puts most policies at the same grid load.
    ``>top`` when it never falls below 90 % on the grid, ``<low`` when it starts below."""
    pts = sorted((ld, r["goodput_pct"]) for ld, r in by_load.items())
    if not pts:
        return ""
    if pts[0][1] < 90.0:
        return f"<{pts[0][0]:g}"
    for (l0, g0), (l1, g1) in itertools.pairwise(pts):
        if g1 < 90.0:
            return f"{l0 + (l1 - l0) * (g0 - 90.0) / (g0 - g1):.2f}"
    return f">{pts[-1][0]:g}"


def fmt_ms(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f}"


def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    for tname, by_rep in results.items():
        for nrep, by_pol in by_rep.items():
            loads = sorted({float(ld) for pol in by_pol.values() for ld in pol}, key=float)
            lines.append(
                f"\n**{tname}, 8P+8D, {nrep} replica(s)** — goodput % (TTFT p50/p99 ms) per load; capacity\n"
            )
            lines.append(
                "| policy | "
                + " | ".join(f"{ld:g}" for ld in loads)
                + " | capacity | 90 % crossing | hit/bound @1.0 | rejected @1.5 |"
            )
            lines.append("|---|" + "---:|" * (len(loads) + 4))
            for pname, by_load in by_pol.items():
                cells = []
                fl = {float(k): v for k, v in by_load.items()}
                for ld in loads:
                    r = fl.get(ld)
                    if r is None:
                        cells.append("")
                        continue
                    cells.append(
                        f"{r['goodput_pct']:.1f} ({fmt_ms(r['ttft_p50_ms'])}/{fmt_ms(r['ttft_p99_ms'])})"
                    )
                one = fl.get(1.0)
                hb = f"{one['hit_routed'] * 100:.1f}/{one['hit_bound'] * 100:.1f}" if one else ""
                rej = fl.get(1.5)
                rj = ", ".join(f"{k} {v}" for k, v in (rej or {}).get("rejections", {}).items()) or "0"
                label = "**default** (cost, window)" if pname == "cost" else pname
                tail = f" | {capacity(fl):g} | {crossing(fl)} | {hb} | {rj} |"
                lines.append(f"| {label} | " + " | ".join(cells) + tail)
    return "\n".join(lines) + "\n"
