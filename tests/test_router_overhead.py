"""bench/router_overhead.py in its smallest mode, FlexLB only (the peer routers are opt-in with
`--peers` and not installed here): both FlexLB rows over the session's Triton workers, and the
table's figures are the ones a real run needs (every request answered, CPU and cores measured,
the added latency the difference of two real latencies)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, WorkerProc

pytestmark = pytest.mark.triton


def test_router_overhead_quick_flexlb_rows(
    workers_reset: dict[str, list[WorkerProc]], tmp_path: Path
) -> None:
    pre, dec = workers_reset["prefill"][0], workers_reset["decode"][0]  # the bench configures them
    spec = f"prefill@{pre.address}={pre.proc.pid},decode@{dec.address}={dec.proc.pid}"
    out = tmp_path / "ro"
    argv = ["--quick", "--workers", spec, "--e2e-n", "10", "--closed-s", "1", "--output", str(out)]
    run = subprocess.run(
        [sys.executable, "bench/router_overhead.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["systems"] == ["flexlb-1", "flexlb-2"]  # no peers without --peers
    assert [len(r) for r in doc["runs"].values()] == [1, 1]
    assert doc["systems"]["flexlb-2"]["ownership"] != doc["systems"]["flexlb-1"]["ownership"]
    for system, m in doc["medians"].items():
        assert m["errors"] == 0, system
        e2e = doc["runs"][system][0]["e2e"]
        assert 0 < e2e["direct_p50_ms"] < 5_000 and 0 < e2e["gateway_p50_ms"] < 5_000
        assert math.isclose(m["added_p50"], e2e["gateway_p50_ms"] - e2e["direct_p50_ms"], abs_tol=0.002)
        assert m["cpu_seq"] is not None and m["cpu_cl"] > 0  # idle-netted may dip, never the loaded one
        assert m["redis_seq"] is not None and m["redis_cl"] > 0  # idle-netted, as cpu_seq: may dip
        assert 0 < m["cores_cl"] <= doc["config"]["cpus"] and m["rps_cl"] > 0
        # the floor under the CPU figures: the same two gRPC calls alone, every one answered
        floor = doc["runs"][system][0]["direct_closed"]
        assert set(floor["codes"]) == {"ok"} and floor["client_cpu_ms_per_req"] > 0
        assert m["dcpu_seq"] is not None and m["dcpu_seq"] > 0
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| system | added p50 | added p99 | router CPU per request (sequential / 32")
    assert [r.split(" | ")[0] for r in table[2:]] == [
        "| FlexLB, 1 replica, direct schedule",
        "| FlexLB, 2 replicas (cross-replica hand-off)",
    ]
    assert all("+ Redis" in r for r in table[2:])
    assert "|" in run.stdout and "FlexLB, 2 replicas" in run.stdout  # the table is printed
    assert (out / "floor.md").read_text().count("its two gRPC calls alone") == 2
