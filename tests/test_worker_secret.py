"""The workers' control plane locked down (issue 16), on a real worker: with `--secret` its
`control` model and its KV side channel answer only callers that present the secret, and fault
injection is refused unless it was started with `--allow-faults` (the test session allows it for
every other worker through FLEXLB_WORKER_ALLOW_FAULTS)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from app.rpc.worker_client import WorkerClient
from workers.server.spawn import worker_argv

from .conftest import ROOT, WorkerProc, start_worker
from .gateways import start_gateway, wait_for

SECRET = "s3cret-for-the-test"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProc, WorkerProc]]:
    """A prefill and a decode worker started with the secret (in parallel), faults not allowed."""
    tmp = tmp_path_factory.mktemp("locked")
    args = ("--profile", "formula", "--formula", "1", "--secret", SECRET, "--no-allow-faults")
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(start_worker, role, tmp, *args) for role in ("prefill", "decode")]
    started = [f.result() for f in futs if f.exception() is None]
    try:
        assert len(started) == 2, [f.exception() for f in futs]
        yield started[0], started[1]
    finally:
        for w in started:
            w.stop()


@pytest.fixture(scope="module")
def locked(pair: tuple[WorkerProc, WorkerProc]) -> WorkerProc:
    return pair[0]


def _control(address: str, secret: str, op: str, **kw: Any) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        c = WorkerClient(address, secret=secret)
        try:
            return await getattr(c, op)(**kw)  # type: ignore[no-any-return]
        finally:
            await c.close()

    return asyncio.run(go())


def test_control_without_the_secret_is_refused(locked: WorkerProc) -> None:
    for secret in ("", "wrong"):
        for op, kw in (("configure", {"time_scale": 1.0}), ("reset", {}), ("status", {})):
            res = _control(locked.address, secret, op, **kw)
            assert "worker secret" in str(res.get("error", "")), (secret, op, res)
    res = _control(locked.address, SECRET, "status")
    assert "error" not in res and res["role"] == "prefill"


def test_fault_injection_needs_allow_faults(locked: WorkerProc) -> None:
    res = _control(locked.address, SECRET, "configure", faults={"exit_after_batches": 1})
    assert "--allow-faults" in str(res.get("error", ""))
    assert "error" not in _control(locked.address, SECRET, "configure", time_scale=1.0)
    # and at start-up: refused before Triton starts
    out = subprocess.run(
        worker_argv("prefill", ["--fault-hang", "--no-allow-faults"]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--allow-faults" in out.stderr


def _kv_claim(endpoint: str, first: bytes | None) -> bytes:
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
        if first is not None:
            s.sendall(first + b"\n")
        s.sendall(json.dumps({"id": 1, "request_id": "nobody", "epoch": ""}).encode() + b"\n")
        s.settimeout(10)
        return s.recv(4096)


def test_the_kv_side_channel_needs_the_secret_first(locked: WorkerProc) -> None:
    endpoint = str(locked.ready["kv_endpoint"])
    assert _kv_claim(endpoint, None) == b""  # closed without an answer
    assert _kv_claim(endpoint, b"wrong") == b""
    answer = json.loads(_kv_claim(endpoint, SECRET.encode()).split(b"\n")[0])
    assert answer["id"] == 1 and answer["status"]  # answered (an unknown handle)


def test_worker_logs_do_not_show_the_secret(locked: WorkerProc) -> None:
    assert SECRET not in Path(locked.log_path).read_text(errors="replace")
    assert all(SECRET not in line for line in locked.stdout)


def test_a_cluster_with_the_secret_serves(
    pair: tuple[WorkerProc, WorkerProc], tmp_path: Path, shared_embedded_redis: str
) -> None:
    """Gateway → prefill (control polls, dispatch), decode → prefill (KV over the side channel):
    every hop presents the secret, and a request runs end to end."""
    prefill, decode = pair
    workers = f"prefill@{prefill.address},decode@{decode.address}"
    cluster = f"t-ws-{uuid.uuid4().hex[:6]}"
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, workers=workers, FLEXLB_WORKER_SECRET=SECRET)
    try:
        wait_for(lambda: gw.readyz()["ready"], 60, what="ready with the secret")
        res = gw.post("/v1/generate", json={"prompt": "hello there", "max_new_tokens": 4})
        assert res.status_code == 200 and len(res.json()["output_ids"]) == 4, res.text
    finally:
        gw.stop()
