"""What a person reads from the `flexlb` commands (issue 19): one help and error style for every
subcommand, option names never cut, tables that fit the terminal (`--wide` for all columns), and
trace rows above the gateway's limits clipped or skipped with the reason in the summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from app.loadgen.plan import Limits, apply_limits
from app.report import TABLE_COLUMNS, print_table
from app.traces import Trace, TraceRequest, load_trace

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"
SUBCOMMANDS = ["worker", "gateway", "up", "status", "bench", "simulate"]


def _help(sub: str, columns: int) -> str:
    res = CliRunner().invoke(app, [sub, "--help"], env={"COLUMNS": str(columns)}, prog_name="flexlb")
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_has_one_help_style_and_never_cuts_an_option_name(sub: str) -> None:
    out = _help(sub, 60)
    assert out.startswith(f"Usage: flexlb {sub} [OPTIONS]"), out[:200]
    assert "\nOptions:\n" in out and "--help" in out
    assert "…" not in out and "╭" not in out  # no rich panel, nothing elided
    options = re.findall(r"^  (--[a-z][a-z0-9-]+)", out, flags=re.M)
    assert len(options) >= 3, out
    for line in out.splitlines():
        assert len(line) <= 80, line
    if sub == "worker":  # the longest names, cut by the old rich panels in a narrow terminal
        assert {"--kv-capacity-tokens", "--fault-exit-after-batches", "--kv-handle-ttl-ms"} <= set(options)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_reports_a_bad_option_the_same_way(sub: str) -> None:
    required = {
        "bench": ["--url", "u", "--trace", "t"],
        "simulate": ["--trace", "t"],
        "worker": ["--role", "decode"],
    }
    res = CliRunner().invoke(app, [sub, *required.get(sub, []), "--no-such-option"], prog_name="flexlb")
    assert res.exit_code == 2, res.output
    text = res.output
    assert f"Usage: flexlb {sub} [OPTIONS]" in text
    assert f"Try 'flexlb {sub} --help' for help." in text
    assert re.search(r"^Error: .*no-such-option", text, flags=re.M), text


def _policies() -> dict[str, dict[str, object]]:
    m = {k: 1234.5 for k, _, kind in TABLE_COLUMNS if kind in ("ms", "float", "rate")}
    m |= {k: 0.5 for k, _, kind in TABLE_COLUMNS if kind == "pct"}
    m |= {"n_requests": 8332, "errors": {"invalid_request": 20, "overloaded": 3}}
    return {name: dict(m) for name in ("cost", "prefix", "least_load", "round_robin@direct")}


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_results_table_fits_the_terminal_and_names_what_it_leaves_out(
    width: int, capsys: pytest.CaptureFixture[str]
) -> None:
    print_table(_policies(), "flexlb simulate — t", width=width)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= width, out
    assert "8,332" in out and "1,234" in out and "round_robin@direct" in out  # numbers are never cut
    shown = [h for _, h, _ in TABLE_COLUMNS if h.split()[0] in out]
    assert "--wide" in out, out  # 14 columns never fit 120 characters
    assert len(shown) >= 3


def test_wide_prints_every_column(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(_policies(), "t", wide=True, width=80)
    out = capsys.readouterr().out
    for _, header, _ in TABLE_COLUMNS:
        assert header in out, header
    assert "--wide" not in out and "invalid_request 20, overloaded 3" in out


def _trace(rows: list[tuple[int, int]]) -> Trace:
    reqs = [TraceRequest(i, float(i), il, ol, ()) for i, (il, ol) in enumerate(rows)]
    return Trace("t", "synthetic", 64, reqs)


def test_rows_above_the_gateway_limits_are_clipped_and_named() -> None:
    lim = Limits(max_output_tokens=8192, max_context_tokens=32768)
    rows = [(100, 20_000), (100, 50), (30_000, 4_000), (40_000, 10), (0, 0)]
    out, rep = apply_limits(_trace(rows), lim, "clip")
    assert [(r.index, r.output_len) for r in out.requests] == [(0, 8192), (1, 50), (2, 2768), (4, 0)]
    assert rep.over_output == [(0, 20_000)] and rep.over_context == [(2, 34_000)]
    assert rep.unservable == [(3, 40_000)] and rep.affected == 3
    notes = " ".join(rep.notes())
    assert "#0 (20,000)" in notes and "clipped to 8,192" in notes and "#3 (40,000)" in notes


def test_rows_above_the_gateway_limits_can_be_skipped_instead() -> None:
    out, rep = apply_limits(_trace([(100, 20_000), (100, 50)]), Limits(), "skip")
    assert [r.index for r in out.requests] == [1]
    assert "skipped, not sent" in rep.notes()[0]
    with pytest.raises(ValueError):
        apply_limits(_trace([]), Limits(), "truncate")


def test_the_shipped_rtp_llm_trace_has_45_rows_the_default_gateway_would_refuse() -> None:
    """45 rows ask for more than 8,192 output tokens, 20 of them for 20,000 (data/traces/README.md)."""
    _, rep = apply_limits(load_trace(TRACES / "trace_30min.jsonl.gz"), Limits(), "clip")
    assert len(rep.over_output) == 45 and sum(n == 20_000 for _, n in rep.over_output) == 20
    assert rep.unservable == [] and rep.over_context == []
