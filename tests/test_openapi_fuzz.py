"""A bounded schemathesis pass (issue #21) against a live gateway over the session's real Triton
workers: every check, admin paths included (with the admin token), a fixed seed and a random one
(printed, so a failure can be replayed with `FLEXLB_FUZZ_SEED`). It must find 0 failures and 0
server errors: the published document says exactly what the gateway does.

Two passes per seed: first everything but the admin operations that change the cluster (for
both seeds), then those (registering made-up workers, draining, runtime config). A generated
config (say a batch window of 60 s) would otherwise slow every later generation request.

The gateway serves at most 8 new tokens (FLEXLB_MAX_NEW_TOKENS_LIMIT; the document publishes it),
so the fuzzer's boundary values stay cheap on the simulated engines.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .gateways import ADMIN_TOKEN, start_gateway, wait_for

pytest.importorskip("schemathesis")

FIXED_SEED = 2121
MAX_EXAMPLES = 15
#: The admin operations that change the cluster (second pass).
MUTATING = (
    r"^(PUT /admin/config|POST /admin/workers|DELETE /admin/workers/\{worker_id\}"
    r"|POST /admin/workers/\{worker_id\}/drain|PUT /admin/tenants/\{tenant\}/limits"
    r"|POST /admin/keys|DELETE /admin/keys/\{key_id\}|POST /admin/stats/reset)$"
)
ROOT = Path(__file__).resolve().parent.parent


def _schemathesis(url: str, seed: int, include: bool, report: Path) -> tuple[int, str]:
    cmd = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(seed),
        "--workers",
        "2",
        "--no-shrink",
        "--request-timeout",
        "30",
        "--generation-database",
        "none",
        "--no-color",
        "--phases",
        "examples,coverage,fuzzing",
        "-H",
        f"Authorization: Bearer {ADMIN_TOKEN}",
        "--include-name-regex" if include else "--exclude-name-regex",
        MUTATING,
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
    # cwd: schemathesis keeps a crash cache (.schemathesis/) in its working directory
    out = subprocess.run(cmd, cwd=report.parent, env=env, capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def test_schemathesis_finds_no_failures_and_no_server_errors(
    worker_pool, shared_embedded_redis, tmp_path: Path, workers_reset
) -> None:
    seeds = [FIXED_SEED, int(os.environ.get("FLEXLB_FUZZ_SEED") or random.randrange(1, 2**31))]
    print(f"\nschemathesis seeds: fixed {seeds[0]}, random {seeds[1]} (replay: FLEXLB_FUZZ_SEED={seeds[1]})")
    workers = ",".join(f"{w.role}@{w.address}" for ws in worker_pool.values() for w in ws)
    gw = start_gateway(
        tmp_path,
        shared_embedded_redis,
        f"t-fuzz-{uuid.uuid4().hex[:6]}",
        workers=workers,
        FLEXLB_MAX_NEW_TOKENS_LIMIT="8",
    )
    try:
        wait_for(lambda: gw.readyz()["ready"], 60, what="fuzz gateway ready")
        total = 0
        # Every seed's main pass before any mutating one: a config a mutating pass leaves behind (say
        # an SLO of 1 ms) would fail the next seed's generation requests.
        for include in (False, True):
            for seed in seeds:
                report = tmp_path / f"junit-{seed}-{include}.xml"
                rc, log = _schemathesis(gw.url, seed, include, report)
                summary = [ln for ln in log.splitlines() if re.search(r"passed|failed|error|cases", ln, re.I)]
                print(f"seed {seed} {'mutating admin' if include else 'main'} pass: rc={rc}")
                print("\n".join(summary[-8:]))
                assert rc == 0, log[-6000:]
                m = re.search(r"(\d+) generated", log)
                total += int(m.group(1)) if m else 0
        print(f"schemathesis: {total} test cases in all")
        assert total > 0
        assert "Traceback" not in gw.log(), gw.log()[-4000:]
    finally:
        gw.stop()
