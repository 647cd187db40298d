"""Issue #20's table rows from several `bench/gateway_overhead.py` runs: medians per label.

    .venv/bin/python bench/gw_rows.py LABEL=DIR1,DIR2,DIR3 [LABEL=...]

Each DIR holds a run's results.json (`--output DIR`). A figure missing from a run (an older bench)
is left out of that figure's median, and the row says over how many runs each median is.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _get(r: dict[str, Any], path: str) -> float | None:
    cur: Any = r
    for part in path.split("."):
        if isinstance(cur, list):
            cur = cur[int(part)] if len(cur) > int(part) else None
        elif isinstance(cur, dict):
            cur = cur.get(part)
        if cur is None:
            return None
    return float(cur)


COLUMNS = [
    ("added p50 ms", "e2e.added_p50_ms"),
    ("added p99 ms", "e2e.added_p99_ms"),
    ("gw CPU ms/req seq (net of idle)", "e2e.gateway_cpu_ms_per_req_net"),
    ("Redis CPU ms/req seq", "e2e.redis_cpu_ms_per_req"),
    ("gw CPU ms/req 32 cl", "closed_loop.0.gateway_cpu_ms_per_req"),
    ("Redis CPU ms/req 32 cl", "closed_loop.0.redis_cpu_ms_per_req"),
    ("req/s 32 cl", "closed_loop.0.rps"),
    ("gw cores 32 cl", "closed_loop.0.gateways_cores"),
    ("Redis cores 32 cl", "closed_loop.0.redis_cores"),
    ("origin p50 seq ms", "e2e.unloaded_origin_p50_ms"),
    ("origin p50 / p99 ms open loop", "open_loop.origin_p50_ms"),
    ("", "open_loop.origin_p99_ms"),
    ("Redis cmds/req net", "open_loop.redis_cmds_per_req_net"),
    ("load avg before", "config.loadavg_before.0"),
]


def rows(groups: Sequence[tuple[str, list[Path]]]) -> str:
    heads = [h for h, _ in COLUMNS if h]
    out = ["| run | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for label, dirs in groups:
        runs = [json.loads((d / "results.json").read_text()) for d in dirs]
        cells: list[str] = []
        for head, path in COLUMNS:
            vals = [v for r in runs if (v := _get(r, path)) is not None]
            text = f"{statistics.median(vals):.2f}" if vals else "—"
            if len(vals) != len(runs):
                text += f" ({len(vals)} runs)"
            if head:
                cells.append(text)
            else:
                cells[-1] += f" / {text}"
        out.append(f"| {label} ({len(runs)} runs) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    groups = []
    for arg in argv if argv is not None else sys.argv[1:]:
        label, _, dirs = arg.partition("=")
        groups.append((label, [Path(d) for d in dirs.split(",")]))
    print(rows(groups))


if __name__ == "__main__":
    main()
