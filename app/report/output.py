"""Writing a run's results: results.json, summary.md, a rich table and PNG plots.

`flexlb bench` (live, one policy) and `flexlb simulate` (virtual clock, one entry per policy) both
end here, so their outputs have one schema and can be diffed or plotted together.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.report.records import RequestRecord
from app.report.summary import percentile

__all__ = ["TABLE_COLUMNS", "fit_columns", "markdown_table", "print_table", "rich_table", "write_results"]

# (metric key, column header, kind) for the human tables; kind picks the number format.
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("n_requests", "requests", "int"),
    ("ttft_p50_ms", "TTFT p50 ms", "ms"),
    ("ttft_p90_ms", "TTFT p90 ms", "ms"),
    ("ttft_p99_ms", "TTFT p99 ms", "ms"),
    ("tpot_p50_ms", "TPOT p50 ms", "ms"),
    ("e2e_p99_ms", "e2e p99 ms", "ms"),
    ("throughput_rps", "thru rps", "rate"),
    ("goodput_rps", "goodput rps", "rate"),
    ("goodput_ratio", "good %", "pct"),
    ("hit_ratio_routed", "hit routed", "pct"),
    ("hit_ratio_pooled_lru", "pooled LRU", "pct"),
    ("hit_ratio_theoretical", "theoretical", "pct"),
    ("mean_batch_size", "batch", "float"),
    ("errors", "errors", "errors"),
)


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "–"
    if kind == "errors":
        return ", ".join(f"{k} {n}" for k, n in v.items()) if v else "0"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if kind == "int":
        return f"{int(v):,}"
    if kind == "ms":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"
    if kind == "rate":
        return f"{v:.2f}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    return f"{v:.2f}"


def markdown_table(policies: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per policy, the columns of TABLE_COLUMNS that any policy has."""
    cols = [c for c in TABLE_COLUMNS if any(c[0] in m for m in policies.values())]
    head = "| policy | " + " | ".join(h for _, h, _ in cols) + " |"
    sep = "|---|" + "|".join("---:" for _ in cols) + "|"
    rows = [
        f"| {name} | " + " | ".join(_fmt(m.get(k), kind) for k, _, kind in cols) + " |"
        for name, m in policies.items()
    ]
    return "\n".join([head, sep, *rows])


#: Columns kept when the terminal is narrow, most important first; the others go first, from the
#: end of this list's complement (`summary.md` and `--wide` always have every column).
_NARROW_KEEP = (
    "n_requests",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "hit_ratio_routed",
    "goodput_rps",
    "errors",
    "tpot_p50_ms",
    "goodput_ratio",
    "throughput_rps",
    "e2e_p99_ms",
    "ttft_p90_ms",
    "hit_ratio_theoretical",
    "mean_batch_size",
    "hit_ratio_pooled_lru",
)


def rich_table(
    policies: Mapping[str, Mapping[str, Any]],
    title: str | None = None,
    keys: Sequence[str] | None = None,
    compact: bool = False,
) -> Any:
    """The same table for a terminal (a `rich.table.Table`), optionally only the columns `keys`.
    `compact`: headers on two lines ("TTFT" over "p50 ms") and no inner borders, so more columns
    fit a narrow terminal; the errors column folds."""
    from rich import box
    from rich.table import Table

    cols = [c for c in TABLE_COLUMNS if any(c[0] in m for m in policies.values())]
    if keys is not None:
        cols = [c for c in cols if c[0] in keys]
    t = Table(title=title, box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD)
    t.add_column("policy", style="bold", overflow="fold")
    for _, h, kind in cols:
        head = h.replace(" ", "\n", 1) if compact else h
        if kind == "errors":
            t.add_column(head, justify="left", overflow="fold", max_width=24 if compact else None)
        else:
            t.add_column(head, justify="right", no_wrap=True)  # a number is never cut
    for name, m in policies.items():
        t.add_row(name, *(_fmt(m.get(k), kind) for k, _, kind in cols))
    return t


def fit_columns(policies: Mapping[str, Mapping[str, Any]], width: int) -> tuple[list[str], list[str]]:
    """(shown, hidden) metric keys: the most important columns that fit `width` characters."""
    from rich.console import Console

    present = [k for k, _, _ in TABLE_COLUMNS if any(k in m for m in policies.values())]
    order = [k for k in _NARROW_KEEP if k in present] + [k for k in present if k not in _NARROW_KEEP]
    console = Console(width=10_000)
    shown = list(order)
    while len(shown) > 2:
        need = console.measure(rich_table(policies, keys=shown, compact=True)).maximum
        if need <= width:
            break
        shown.pop()
    hidden = [k for k in order if k not in shown]
    return [k for k in present if k in shown], hidden


def print_table(
    policies: Mapping[str, Mapping[str, Any]],
    title: str | None = None,
    *,
    wide: bool = False,
    width: int | None = None,
) -> None:
    """The table at the terminal's width (`COLUMNS` when piped, else 100): the less important
    columns are left out, and named, when they do not fit; `wide` prints all of them whatever the
    width. A 190-column table in an 80-column terminal was unreadable."""
    import shutil

    from rich.console import Console

    width = width or shutil.get_terminal_size((100, 24)).columns
    if wide:
        table = rich_table(policies, title)
        need = Console(width=10_000).measure(table).maximum
        Console(width=max(width, need)).print(table)
        return
    shown, hidden = fit_columns(policies, width)
    console = Console(width=width)
    console.print(rich_table(policies, title, keys=shown, compact=True))
    if hidden:
        names = ", ".join(h for k, h, _ in TABLE_COLUMNS if k in hidden)
        console.print(f"({len(hidden)} more columns with --wide or in summary.md: {names})", style="dim")


def _jsonable(v: Any) -> Any:
    """NaN/inf become null: results.json must be strict JSON for other tools."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def write_results(
    output_dir: Path,
    policies: dict[str, dict[str, Any]],
    records: dict[str, list[RequestRecord]],
    meta: dict[str, Any],
) -> None:
    """Write results.json, summary.md, records.jsonl.gz and the three plots into ``output_dir``.

    results.json = ``{"policies": {NAME: flat metrics}, "meta": meta}``; the policy metrics are
    written exactly as given (callers add ``hit_ratio_theoretical`` / ``hit_ratio_pooled_lru`` from
    `app.traces.trace_bounds`). Everything but the PNGs is byte-identical for identical inputs.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"policies": _jsonable(policies), "meta": _jsonable(meta)}
    (out / "results.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    (out / "summary.md").write_text(_summary_md(policies, meta))
    lines = []
    for name, recs in records.items():
        for r in recs:
            d = r.to_dict()
            d["policy"] = name
            lines.append(json.dumps(_jsonable(d)))
    (out / "records.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    _plots(out, records, meta)


def _summary_md(policies: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    title = meta.get("title") or f"FlexLB {meta.get('tool', 'run')} results"
    parts = [f"# {title}", ""]
    for k, v in meta.items():
        if k == "title" or isinstance(v, dict | list):
            continue
        parts.append(f"- **{k}**: {v}")
    notes = meta.get("notes")
    if isinstance(notes, list):
        parts.extend(f"- {n}" for n in notes)
    parts += ["", markdown_table(policies), ""]
    parts.append(
        "TTFT/TPOT/e2e in ms; goodput = successful requests with TTFT ≤ the SLO per second; hit ratios "
        "are token-weighted (cached input tokens / input tokens); *theoretical* = infinite global "
        "cache, *pooled LRU* = one LRU with the cluster's whole KV capacity."
    )
    return "\n".join(parts) + "\n"


def _plots(out: Path, records: Mapping[str, list[RequestRecord]], meta: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = meta.get("slo_ttft_ms")
    # TTFT CDF, one line per policy.
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, recs in records.items():
        v = sorted(r.ttft_ms for r in recs if r.error is None and r.ttft_ms is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    if isinstance(slo, int | float):
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)

    # TTFT over time: p50 and p99 per arrival window, one colour per policy.
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, recs in records.items():
        pts = sorted((r.arrival_ms, r.ttft_ms) for r in recs if r.error is None and r.ttft_ms is not None)
        if not pts:
            continue
        t_end = pts[-1][0] or 1.0
        bins = 60
        xs, p50, p99 = [], [], []
        j = 0
        for b in range(bins):
            hi = t_end * (b + 1) / bins
            vals = []
            while j < len(pts) and (pts[j][0] <= hi or b == bins - 1):
                vals.append(pts[j][1])
                j += 1
            if vals:
                xs.append((t_end * (b + 0.5) / bins) / 1000.0)
                p50.append(percentile(vals, 50))
                p99.append(percentile(vals, 99))
        (line,) = ax.plot(xs, p50, label=f"{name} p50")
        ax.plot(xs, p99, linestyle=":", color=line.get_color(), label=f"{name} p99")
    ax.set_yscale("log")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title("TTFT over time (per-window p50 solid, p99 dotted)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_over_time.png", dpi=110)
    plt.close(fig)

    # Batch sizes: the share of requests that ran in a batch of each size.
    fig, ax = plt.subplots(figsize=(8, 5))
    any_sizes = False
    for name, recs in records.items():
        sizes = [r.batch_size for r in recs if r.batch_size is not None]
        if not sizes:
            continue
        any_sizes = True
        top = max(sizes)
        counts = [0] * (top + 1)
        for s in sizes:
            counts[s] += 1
        ax.step(range(1, top + 1), [c / len(sizes) for c in counts[1:]], where="mid", label=name)
    if not any_sizes:
        ax.text(0.5, 0.5, "no batch sizes recorded", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend()
    ax.set_xlabel("prefill batch size")
    ax.set_ylabel("share of requests")
    ax.set_title("Prefill batch sizes (per request)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "batch_sizes.png", dpi=110)
    plt.close(fig)
