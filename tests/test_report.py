"""Flat metrics and the files every bench/simulation writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.report import RequestRecord, markdown_table, percentile, summarize, write_results

ROWS = [(100.0, 0, 1), (200.0, 500, 2), (300.0, 1000, 2), (900.0, 0, 1)]


def recs() -> list[RequestRecord]:
    out = [
        RequestRecord(f"r{i}", 100.0 * i, 1000, 10, ttft, 5.0 + i, ttft + 50, None, cached, "p0", "d0", bs)
        for i, (ttft, cached, bs) in enumerate(
            [(100.0, 0, 1), (200.0, 500, 2), (300.0, 1000, 2), (900.0, 0, 1)]
        )
    ]
    out.append(RequestRecord("r9", 50.0, 1000, 10, None, None, None, "worker_error"))
    out.append(RequestRecord("r8", 60.0, 1000, 10, None, None, None, "timeout"))
    out.append(RequestRecord("r7", 70.0, 1000, 10, None, None, None, "timeout"))
    return out


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_summarize() -> None:
    m = summarize(recs(), slo_ttft_ms=250.0, duration_s=2.0)
    assert m["n_requests"] == 7 and m["n_ok"] == 4 and m["n_errors"] == 3
    assert m["ttft_p50_ms"] == 250.0
    assert m["ttft_p99_ms"] == pytest.approx(300 + 0.97 * 600)
    assert m["throughput_rps"] == 2.0
    assert m["goodput_rps"] == 1.0  # two of four met 250 ms, over 2 s
    assert m["hit_ratio_routed"] == pytest.approx(1500 / 4000)  # failed requests do not count
    assert m["mean_batch_size"] == 1.5
    assert m["errors"] == {"timeout": 2, "worker_error": 1}
    assert m["tpot_p50_ms"] == 6.5
    empty = summarize([], slo_ttft_ms=1.0, duration_s=0.0)
    assert empty["ttft_p50_ms"] is None and empty["throughput_rps"] == 0.0


def test_write_results(tmp_path: Path) -> None:
    r = recs()
    pol = {
        "cost": {**summarize(r, slo_ttft_ms=250.0, duration_s=2.0), "hit_ratio_theoretical": 0.5},
        "round_robin": {**summarize(r[:2], slo_ttft_ms=250.0, duration_s=2.0), "x": float("nan")},
    }
    write_results(tmp_path, pol, {"cost": r, "round_robin": r[:2]}, {"tool": "test", "slo_ttft_ms": 250.0})
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["policies"]) == ["cost", "round_robin"]
    assert doc["policies"]["cost"]["ttft_p50_ms"] == 250.0
    assert doc["policies"]["round_robin"]["x"] is None  # strict JSON
    assert doc["meta"]["tool"] == "test"
    md = (tmp_path / "summary.md").read_text()
    assert "| cost |" in md and "| round_robin |" in md and "50.0%" in md
    for png in ("ttft_cdf.png", "ttft_over_time.png", "batch_sizes.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT p50 ms" in markdown_table(pol)
