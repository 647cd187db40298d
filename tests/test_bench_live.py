"""`flexlb bench` against a started stack: one gateway replica over the session's real Triton
worker pool and the shared embedded Redis, replaying a slice of the real RTP-LLM trace."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.loadgen.cli import main as bench_main

from .conftest import WorkerProc, worker_call
from .gateways import ADMIN_TOKEN, Gateway, start_gateway, wait_for

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"  # shipped in the repository
FLEXLB_TRACE = TRACES / "trace_30min.jsonl.gz"

pytestmark = pytest.mark.triton


@pytest.fixture
def stack(
    workers_reset: dict[str, list[WorkerProc]], shared_embedded_redis: str, tmp_path: Path
) -> Iterator[tuple[Gateway, dict[str, list[WorkerProc]]]]:
    pool = workers_reset
    spec = ",".join(f"{w.role}@{w.address}" for ws in pool.values() for w in ws)
    gw = start_gateway(tmp_path, shared_embedded_redis, f"t-bench-{uuid.uuid4().hex[:6]}", workers=spec)
    try:
        wait_for(lambda: gw.readyz().get("ready"), 60, what="gateway ready")

        def snapshots_in() -> bool:
            ws = gw.get("/admin/workers", admin=True).json()["workers"]
            return len(ws) == 3 and all(w["snapshot"].get("block_size") for w in ws.values())

        wait_for(snapshots_in, 10, what="worker snapshots with block sizes")
        yield gw, pool
    finally:
        gw.stop()


def _set_time_scale(gw: Gateway, pool: dict[str, list[WorkerProc]], scale: float) -> None:
    """Configure every pool worker, then wait until the gateway's snapshots show it (the bench
    reads the time scale there)."""
    for ws in pool.values():
        for w in ws:
            assert worker_call(w.address, "configure", time_scale=scale)["ok"]

    def seen() -> bool:
        ws = gw.get("/admin/workers", admin=True).json()["workers"]
        return all(float(w["snapshot"].get("time_scale", 0)) == scale for w in ws.values())

    wait_for(seen, 10, what=f"snapshots at time scale {scale}")


def test_replay_of_a_trace_slice(stack: tuple[Gateway, dict[str, list[WorkerProc]]], tmp_path: Path) -> None:
    """50 rows of the RTP-LLM trace (15 of them prefill-only) at 2x speed; the pool runs ten times
    faster than modelled so the longest output (3,894 tokens) takes ~3 s."""
    gw, pool = stack
    _set_time_scale(gw, pool, 0.1)
    out = tmp_path / "run"
    argv = ["--url", gw.url, "--trace", str(FLEXLB_TRACE), "--slice", "1000:1050", "--speed", "2"]
    argv += ["--output", str(out), "--admin-token", ADMIN_TOKEN, "--seed", "11", "--no-progress"]
    argv += ["--timeout-s", "60", "--lag-interval-s", "0.5"]
    assert bench_main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["policies"]) == ["cost+batch"]
    m = doc["policies"]["cost+batch"]
    for key in (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "throughput_rps",
        "goodput_rps",
        "hit_ratio_routed",
        "hit_ratio_theoretical",
        "hit_ratio_pooled_lru",
        "errors",
    ):
        assert key in m, key
    assert m["n_requests"] == 50 and m["n_ok"] == 50 and m["errors"] == {}
    assert m["ttft_p50_ms"] > 0 and m["tpot_p50_ms"] > 0
    # The slice shares prefixes (10% of tokens with an infinite cache); routing can reach at most that.
    assert 0.0 < m["hit_ratio_theoretical"] < 0.2
    assert m["hit_ratio_routed"] <= m["hit_ratio_theoretical"] + 1e-9
    assert m["hit_ratio_pooled_lru"] <= m["hit_ratio_theoretical"] + 1e-9
    meta = doc["meta"]
    assert meta["prompt_token_mismatches"] == 0  # byte tokenizer: prompt tokens == trace input_len
    assert meta["zero_output_rows"] == 15 and meta["worker_block_size"] == 64
    assert meta["trace_block_size"] == 1024 and meta["time_scale"] == 0.1
    assert isinstance(meta["valid"], bool) and "engine_lag_ratio" in meta
    assert "--admin-token ***" in meta["command"] and ADMIN_TOKEN not in json.dumps(doc)
    assert any("max_tokens 1" in n for n in meta["notes"])
    summary = (out / "summary.md").read_text()
    assert "max_tokens 1" in summary and "cost+batch" in summary
    for png in ("ttft_cdf.png", "ttft_over_time.png", "batch_sizes.png"):
        assert (out / png).stat().st_size > 0
    recs = [json.loads(line) for line in __import__("gzip").open(out / "records.jsonl.gz", "rt")]
    assert len(recs) == 50
    assert sum(1 for r in recs if r["output_tokens"] == 1) >= 15  # prefill-only rows got one token
    assert {r["prefill_worker"] for r in recs} <= {f"prefill@{w.address}" for w in pool["prefill"]}


def test_block_size_mismatch_is_refused_before_any_request(
    stack: tuple[Gateway, dict[str, list[WorkerProc]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A synthetic trace with 96-token blocks cannot be tiled by the workers' 64-token blocks."""
    gw, _ = stack
    argv = ["--url", gw.url, "--synthetic", "3", "--rate", "5", "--block-size", "96"]
    argv += ["--output", str(tmp_path / "x"), "--admin-token", ADMIN_TOKEN, "--no-progress"]
    assert bench_main(argv) == 2
    assert "must equal or divide" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # No request reached the gateway: its workers' caches are still empty.
    cache = gw.get("/admin/cache", admin=True).json()["workers"]
    assert cache and all(v["blocks"] == 0 for v in cache.values())


def test_wrong_admin_token_is_a_clear_error(
    stack: tuple[Gateway, dict[str, list[WorkerProc]]], capsys: pytest.CaptureFixture[str]
) -> None:
    gw, _ = stack
    assert bench_main(["--url", gw.url, "--synthetic", "3", "--rate", "5", "--admin-token", "nope"]) == 2
    assert "--admin-token" in capsys.readouterr().err


def test_simulator_and_live_stack_agree_on_ttft(
    stack: tuple[Gateway, dict[str, list[WorkerProc]]], tmp_path: Path
) -> None:
    """Issue #7: the simulator and the live stack agree within 20% on modelled TTFT p50 for a small
    scenario (p50 >= 500 ms) at time scale 1. Same trace, same engine profile (the Llama-3.1-8B/H100
    roofline), same gateway formula and strategy; 8 distinct 20K-token prompts at 1 req/s on 2
    prefill workers (each prefill ~0.8 s), so TTFT is mostly modelled compute plus some queueing
    that both must reproduce, and the live stack's few tens of ms of overhead stay well inside 20%."""
    sim_run = pytest.importorskip("app.sim.run")
    sim_config = pytest.importorskip("app.sim.config")
    from app.traces import save_trace, synthetic_trace

    gw, pool = stack
    for ws in pool.values():
        for w in ws:
            assert worker_call(w.address, "configure", profile="llama3.1-8b-h100", time_scale=1.0)["ok"]

    def profiled() -> bool:
        ws = gw.get("/admin/workers", admin=True).json()["workers"]
        return all(int(float(w["snapshot"].get("kv_total_tokens", 0))) == 450_000 for w in ws.values())

    wait_for(profiled, 10, what="snapshots with the H100 profile's KV capacity")
    trace = synthetic_trace(
        8, 1.0, prefix_groups=1, prefix_blocks=0, unique_blocks=320, block_size=64, output_len=1, seed=5
    )
    path = tmp_path / "scenario.jsonl"
    save_trace(trace, path)

    cfg = sim_config.SimConfig(prefill=2, decode=1, seed=5, profile="llama3.1-8b-h100")
    sim = sim_run.run_simulation(trace, cfg, [sim_run.PolicySpec("cost", "cost", "fixed_window")])
    sim_p50 = sim.policies["cost"]["ttft_p50_ms"]

    out = tmp_path / "live"
    argv = ["--url", gw.url, "--trace", str(path), "--output", str(out), "--admin-token", ADMIN_TOKEN]
    argv += ["--seed", "5", "--no-progress", "--timeout-s", "60"]
    assert bench_main(argv) == 0
    live = json.loads((out / "results.json").read_text())["policies"]["cost+batch"]
    assert live["n_ok"] == 8
    live_p50 = live["ttft_p50_ms"]
    assert sim_p50 >= 500, sim_p50
    assert abs(live_p50 - sim_p50) <= 0.2 * sim_p50, (live_p50, sim_p50)
