"""`flexlb status` on a real gateway with real workers: one screen that names the replicas and
the master, who owns each worker, each worker's health and prefix-cache hit ratio, and the
request and error rates measured between two samples."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from app.cli import app
from app.status import render, sample

from .gateways import ADMIN_TOKEN, Gateway, start_gateway, wait_for

pytestmark = pytest.mark.triton


@pytest.fixture
def gateway(workers_reset, shared_embedded_redis: str, cluster: str, tmp_path: Path) -> Iterator[Gateway]:  # type: ignore[no-untyped-def]
    specs = ",".join(f"{w.role}@{w.address}" for ws in workers_reset.values() for w in ws)
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, specs)
    try:
        wait_for(lambda: gw.readyz().get("ready") and gw.readyz().get("master"), 60, 0.1, what="ready master")
        yield gw
    finally:
        gw.stop()


def _frame(renderable: object, width: int = 100) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_one_frame_shows_roles_owners_health_hits_and_rates(gateway: Gateway) -> None:
    gw = gateway
    workers = sorted(gw.readyz()["workers"])
    wait_for(lambda: set(gw.readyz()["owned"]) == set(workers), 15, 0.1, what="one replica owns all")
    prev = asyncio.run(sample([gw.url], ADMIN_TOKEN))
    prompt = "status " * 200  # the same long prompt four times: the later ones hit the prefix cache
    for _ in range(4):
        r = httpx.post(gw.url + "/v1/generate", json={"prompt": prompt, "max_new_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(gw.url + "/v1/generate", json={"prompt": "x", "max_new_tokens": 2, "bogus": 1}, timeout=10)
    assert r.status_code == 400
    prefill = [w for w in workers if w.startswith("prefill")]

    def hits_counted() -> bool:  # the owner counts a prefill when it next polls the worker
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        return "flexlb_worker_prefill_cached_tokens_total{" in text

    wait_for(hits_counted, 10, 0.1, what="per-worker prefill tokens exported")
    cur = asyncio.run(sample([gw.url], ADMIN_TOKEN))
    text = _frame(render(cur, prev))
    rid = gw.replica_id
    assert f"master {rid}" in text and re.search(rf"{rid}\s+127\.0\.0\.1:{gw.port}\s+ready\s+master", text)
    for w in workers:
        assert re.search(rf"{re.escape(w)}\s+up\s+{rid}\s", text), (w, text)
    rate = float(re.search(r"([\d.]+) req/s", text).group(1))  # type: ignore[union-attr]
    assert rate > 0, text
    assert re.search(r"errors: invalid_request [\d.]+/s", text), text
    hit_rows = [ln for ln in text.splitlines() if any(ln.lstrip().startswith(p) for p in prefill)]
    assert any(re.search(r"[1-9]\d*%\s*$", ln) for ln in hit_rows), text  # a non-zero hit ratio
    assert "admin token" not in text
    assert "cancelled" not in text, "a completed request is not a cancelled one"
    errs = cur.replicas[0].errors
    assert errs.get("cancelled", 0) == prev.replicas[0].errors.get("cancelled", 0), errs


def test_status_once_fits_one_screen_and_says_what_needs_the_token(gateway: Gateway) -> None:
    runner = CliRunner()
    args = ["status", "--once", "--url", gateway.url, "--interval", "0.2"]
    res = runner.invoke(
        app, [*args, "--admin-token", ADMIN_TOKEN], env={"COLUMNS": "100"}, prog_name="flexlb"
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) <= 40 and max(len(ln) for ln in lines) <= 100, res.output
    assert "% of" in res.output  # KV used needs the admin view
    res = runner.invoke(app, args, env={"COLUMNS": "100", "FLEXLB_ADMIN_TOKEN": ""}, prog_name="flexlb")
    assert res.exit_code == 0 and "no admin token" in res.output, res.output
    res = runner.invoke(app, ["status", "--once", "--url", "http://127.0.0.1:9", "--interval", "0.1"])
    assert res.exit_code == 1 and "down" in res.output


def test_status_pointed_at_one_replica_counts_and_probes_the_whole_cluster(
    workers_reset, shared_embedded_redis: str, cluster: str, tmp_path: Path
) -> None:
    """`flexlb status --url <one replica>` of a two-replica cluster said "1/1 replicas up": it
    showed only the URLs it was given. Every replica knows the live members (by heartbeat) and
    their addresses, so the frame must count both and, with the admin token, probe the other one
    at its address; without the token it must still list it (live, not probed)."""
    from .test_faults import start_two, wid

    wids = [wid(workers_reset["prefill"][0]), wid(workers_reset["decode"][0])]
    a, b = start_two(tmp_path, shared_embedded_redis, cluster, wids)
    try:
        wait_for(lambda: len(a.readyz().get("live_replicas", [])) == 2, 10, 0.1, what="a sees 2 live")
        prev = asyncio.run(sample([a.url], ADMIN_TOKEN))
        text = _frame(render(asyncio.run(sample([a.url], ADMIN_TOKEN)), prev))
        assert "2/2 replicas up" in text, text
        for g in (a, b):
            row = rf"{g.replica_id}\s+127\.0\.0\.1:{g.port}\s+(not )?ready"
            assert re.search(row, text), (g.replica_id, text)
        text = _frame(render(asyncio.run(sample([a.url], None)), None))
        assert "2/2 replicas up (1 by heartbeat only" in text, text
        assert re.search(rf"{b.replica_id}\s+–\s+live, not probed", text), text
        b.stop()  # gone from membership at once (graceful leave): one replica left, and truthfully
        wait_for(lambda: len(a.readyz().get("live_replicas", [])) == 1, 15, 0.1, what="a sees 1 live")
        text = _frame(render(asyncio.run(sample([a.url], ADMIN_TOKEN)), None))
        assert "1/1 replicas up" in text and b.replica_id not in text, text
    finally:
        a.stop()
        b.stop()
