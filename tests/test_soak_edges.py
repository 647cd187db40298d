"""Defects found by the soak with faults (SIGKILLed replicas and workers, a Redis that restarts
empty, overload bursts, client disconnects and cancels; docs/operations.md "Soak with faults"):
each test here failed before its fix."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from app.cluster.leases import Lease
from app.dispatch.owner import OwnerDispatcher
from app.netports import free_port
from app.state.embedded_redis import find_redis_server
from app.state.keys import Keys
from app.state.retry import TerminalWrites
from app.state.store import StateStore

from .gateways import ADMIN_TOKEN, start_gateway, wait_for


def test_an_owner_retries_its_replies_in_the_replicas_queue_even_while_that_queue_is_empty() -> None:
    """The replica hands its one terminal-write queue to every owner it runs, so its stop gives
    an owner's failed reply + settle writes their last bounded chance and one task drains them.
    An empty queue is falsy (it has a length): `terminal or TerminalWrites()` gave each owner a
    private queue, which nobody stopped; after a Redis restart the gateway logged "Task was
    destroyed but it is pending! task: <Task pending name='terminal-writes' ...>" when a
    dropped owner's private queue was collected."""

    async def run() -> None:
        shared = TerminalWrites()
        assert len(shared) == 0
        url = "redis://127.0.0.1:1/0"  # never connected to: nothing here reaches Redis
        store = StateStore(aioredis.from_url(url), Keys("t-edges"))
        lease = Lease("lease", "me", 3000, 500)
        d = OwnerDispatcher(
            "prefill@x", "me", lease, store, cast(Any, None), url, epoch=lambda: "1", terminal=shared
        )
        assert d.terminal is shared

    asyncio.run(run())


def test_a_request_status_or_cancel_while_redis_is_away_is_a_typed_retryable_503(tmp_path: Path) -> None:
    """During the soak's Redis restart, `DELETE /v1/requests/{id}` (and `GET`) raised redis-py's
    ConnectionError / BusyLoadingError out of the handler: a 500 `internal` and an "unhandled
    error" traceback in the log. Redis not answering is DESIGN §6's 503 `state_unavailable`,
    retryable, with `Retry-After`, on every endpoint that reads it. A real redis-server, killed."""
    with _own_redis(tmp_path) as (server, url):
        gw = start_gateway(tmp_path, url, f"t-away-{uuid.uuid4().hex[:6]}")
        try:
            assert gw.get("/v1/requests/some-id").status_code == 404  # Redis answers: not found
            server.kill()
            server.wait(5)
            for resp in (gw.get("/v1/requests/some-id"), gw.delete("/v1/requests/some-id")):
                assert resp.status_code == 503, (resp.status_code, resp.text)
                err = resp.json()["error"]
                assert err["code"] == "state_unavailable" and err["retryable"] is True, err
                assert resp.headers.get("retry-after") == "1", resp.headers
            assert "unhandled error" not in gw.log()
        finally:
            gw.stop()


@contextmanager
def _own_redis(tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A redis-server of the test's own (the test kills it), up, and its URL; killed at the end
    if it still runs. Skipped without the binary, as every test needing redis-server is."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("needs redis-server on PATH")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen([*args, "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(lambda: _pings(url), 10, what="redis-server up")
        yield server, url
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(5)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


@pytest.mark.triton
def test_a_removed_worker_leaves_no_published_views_behind(
    workers_reset: dict[str, list[Any]], shared_embedded_redis: str, cluster: str, tmp_path: Path
) -> None:
    """`DELETE /admin/workers/{id}` kept the worker's snapshot, cache diff stream and snapshot,
    speculative stream, queued ms and tombstones in Redis for good (no TTL; nobody writes or trims
    them once the worker is gone): ~0.8 MB per removed prefill worker at the soak's rates, so a
    cluster whose workers come and go under new addresses grows with every departure. After the
    removal, and after its owner let the lease go (its poller may publish once more), they must
    be gone, and the tombstones must expire with their last entry."""
    from .test_faults import wid

    pre, dec = wid(workers_reset["prefill"][0]), wid(workers_reset["decode"][0])
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, f"{pre},{dec}")
    r = redis.Redis.from_url(shared_embedded_redis)
    keys = Keys(cluster)
    try:
        wait_for(lambda: gw.readyz().get("ready") and len(gw.readyz()["owned"]) == 2, 60, 0.1, what="ready")
        for i in range(4):
            body = {"prompt": f"edges {i} " * 80, "max_new_tokens": 2}
            assert gw.post("/v1/generate", json=body).status_code == 200
        views = [keys.snapshot(pre), keys.cache_stream(pre), keys.cache_snapshot(pre), keys.spec_stream(pre)]
        views.append(keys.queued_ms(pre))
        published = [*views, keys.tombstones(pre)]
        wait_for(lambda: all(r.exists(k) for k in published), 10, 0.1, what="every view published")
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        gone = httpx.delete(f"{gw.url}/admin/workers/{pre}", headers=admin, timeout=30)
        assert gone.status_code == 200, gone.text
        wait_for(lambda: r.get(keys.owner_lease(pre)) is None, 15, 0.1, what="owner lease let go")
        # The lease is released in the lease loop's Redis step; the owner's hook that stops the
        # poller and deletes what its last poll published again runs right after (under CI load,
        # after this check had already looked: a snapshot was still there).
        wait_for(lambda: not any(r.exists(k) for k in views), 10, 0.1, what="views gone, owner stopped")
        left = [k for k in views if r.exists(k)]
        assert left == [], left
        assert 0 < r.pttl(keys.tombstones(pre)) <= 600_000 + 1000  # with its last entry (10 min TTL)
        assert gw.post("/admin/workers", admin=True, json={"workers": pre}).status_code == 200
        wait_for(lambda: r.pttl(keys.tombstones(pre)) == -1, 10, 0.1, what="tombstones lasting again")
    finally:
        gw.stop()
        r.close()


@pytest.mark.triton
def test_owners_losing_their_leases_to_a_redis_outage_stop_cleanly(
    workers_reset: dict[str, list[Any]], tmp_path: Path
) -> None:
    """An owner that loses a worker's lease checks whether the worker was removed (to delete the
    views its poller may have published after the removal). Leases are mostly lost because Redis
    is away, when that check cannot run: it must not make the lease hook fail (an error with a
    traceback per worker, seen in the soak's Redis restart). A real redis-server, killed."""
    from .test_faults import wid

    with _own_redis(tmp_path) as (server, url):
        specs = f"{wid(workers_reset['prefill'][0])},{wid(workers_reset['decode'][0])}"
        gw = start_gateway(tmp_path, url, f"t-lose-{uuid.uuid4().hex[:6]}", specs)
        try:
            wait_for(lambda: len(gw.readyz().get("owned", [])) == 2, 60, 0.1, what="both workers owned")
            server.kill()
            server.wait(5)
            wait_for(lambda: gw.log().count("lapsed locally") >= 2, 30, 0.1, what="both owner leases lapsed")
            seen = ("not re-checked after losing its lease", "lease hook on_lose")
            wait_for(lambda: any(s in gw.log() for s in seen), 10, 0.1, what="the removal check ran")
            assert "lease hook on_lose" not in gw.log(), gw.log()[-3000:]
        finally:
            gw.stop()
