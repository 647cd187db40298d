"""Cluster state through real gateway replicas (subprocesses), real Redis and real Triton workers,
as replicas, workers and Redis come and go: lease ownership moving off a dead replica, a worker
down and back with a new epoch, the embedded Redis outliving its replica, the cache mirror on every
replica and a late joiner, a Redis restart with and without its data. The admin API and the
config / policies every replica shares: tests/test_gateway_admin.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from app.cluster.rendezvous import assign
from app.rpc.worker_client import WorkerClient
from app.state.embedded_redis import find_redis_server
from app.state.keys import Keys

from .conftest import running_on, start_worker, worker_call
from .gateways import Gateway, free_port, log_messages, specs, start_gateway, wait_for

TTL_S = 3.0


def owners(gw: Gateway) -> dict[str, str | None]:
    leases = gw.get("/admin/leases", admin=True).json()
    return {w: (o or {}).get("holder") for w, o in leases["owners"].items()}


def split_ids(workers: list[str]) -> tuple[str, str]:
    """Two replica ids between which rendezvous hashing gives each at least one worker."""
    for i in range(1000):
        a, b = f"gw-a{i}", f"gw-b{i}"
        if len(set(assign(workers, [a, b]).values())) == 2:
            return a, b
    raise AssertionError("no split found")


@pytest.fixture
def two_gateways(worker_pool, redis_url, cluster, tmp_path):
    """Two replicas started before any worker is registered; the workers are then added through
    the admin API, so each replica takes what rendezvous hashing assigns it (leases are sticky:
    a replica joining later would find them all held)."""
    ids = split_ids([f"{w.role}@{w.address}" for ws in worker_pool.values() for w in ws])
    gws = [start_gateway(tmp_path, redis_url, cluster, FLEXLB_REPLICA_ID=rid) for rid in ids]
    wait_for(
        lambda: len(gws[0].get("/admin/leases", admin=True).json()["live_replicas"]) == 2, 10, what="2 live"
    )
    assert gws[0].post("/admin/workers", admin=True, json={"workers": specs(worker_pool)}).status_code == 200
    yield gws
    for g in gws:
        g.stop()


def test_owners_spread_and_move_when_a_replica_dies(two_gateways, worker_pool, redis_url, cluster) -> None:
    a, b = two_gateways
    wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="both ready")
    wait_for(lambda: all(owners(a).values()), 10, what="every worker owned")
    held = owners(a)
    assert set(held.values()) == {a.replica_id, b.replica_id}  # spread over both
    # A real request with B as its origin, holding decode KV while its (slow) prefill runs: when
    # B dies, reaping must end it `owner_lost` and release the hold. Nothing here writes state the
    # product would not write itself (the record names its decode worker from creation).
    keys = Keys(cluster)
    r = redis.Redis.from_url(redis_url)
    dec = next(w for w in held if w.startswith("decode"))
    for w in worker_pool["prefill"]:
        assert worker_call(w.address, "configure", formula="4000")["ok"]
    rid = f"req-{uuid.uuid4().hex[:8]}"

    def call() -> None:
        with contextlib.suppress(httpx.HTTPError):  # B dies under it, and its client's connection
            b.post("/v1/generate", json={"prompt": "slow one", "max_new_tokens": 4, "request_id": rid})

    th = threading.Thread(target=call, daemon=True)
    th.start()
    try:
        wait_for(lambda: r.hexists(keys.reservations(dec), rid), 10, what="B's request holds decode KV")
        assert r.hget(keys.request(rid), "decode_worker") == dec.encode()  # from creation
        t0 = time.monotonic()
        b.kill()
        wait_for(lambda: set(owners(a).values()) == {a.replica_id}, 2 * TTL_S + 1, what="leases moved to A")
        moved_s = time.monotonic() - t0
        assert moved_s <= 2 * TTL_S + 1
        wait_for(lambda: r.hget(keys.request(rid), "state") == b"owner_lost", 2 * TTL_S + 2, what="reaped")
        assert int(r.hget(keys.reservations(dec), "_total") or 0) == 0
        # `owner_lost` is retryable: the client's retry of the id (its proxy's, on the surviving
        # replica) runs a new attempt under its own id (app/state/lifecycle.py) while the dead
        # origin's attempt may still run on the prefill engine, and completes.
        again = a.post("/v1/generate", json={"prompt": "slow one", "max_new_tokens": 4, "request_id": rid})
        assert again.status_code == 200 and len(again.json()["output_ids"]) == 4, again.text
        rec = a.get(f"/v1/requests/{rid}").json()
        assert rec["state"] == "completed" and rec["attempt"] == 2 and rec["origin"] == a.replica_id, rec
        wait_for(lambda: int(r.hget(keys.reservations(dec), "_total") or 0) == 0, 5, what="holds released")
    finally:
        for w in worker_pool["prefill"]:
            worker_call(w.address, "reset")
    live = a.get("/admin/leases", admin=True).json()["live_replicas"]
    assert live == [a.replica_id]


def test_embedded_redis_survives_the_replica_that_started_it(worker_pool, cluster, tmp_path) -> None:
    # Idle 15 s: the second replica below must reach Redis before it counts as idle, and a
    # gateway takes 2-3 s to start on a quiet box but over 8 s on a loaded one (5 s failed in CI).
    gw = start_gateway(tmp_path, None, cluster, specs(worker_pool), FLEXLB_EMBEDDED_REDIS_IDLE_S="15")
    first = json.loads(gw.log().splitlines()[0])
    assert first["msg"].startswith("redis_url=redis://127.0.0.1:")
    url = first["msg"].split("=", 1)[1]
    wait_for(lambda: gw.readyz()["ready"], 60, what="ready on embedded redis")
    gw.kill()
    r = redis.Redis.from_url(url)
    assert r.ping()
    assert r.scard(Keys(cluster).workers) == 3  # the state outlived the replica
    b = start_gateway(tmp_path, url, cluster)  # another replica joins the same state
    try:
        wait_for(lambda: b.readyz()["ready"], 60, what="second replica ready")
    finally:
        b.stop()
    # no replica heartbeats any more: the embedded Redis exits by itself after its idle time
    wait_for(lambda: not _ping(url), 60, interval=0.5, what="embedded redis exits when idle")


def test_worker_down_on_kill_and_hang_back_with_new_epoch(
    worker_pool, shared_embedded_redis, cluster, tmp_path, worker_tmp
) -> None:
    """A hung worker goes down and comes back; a killed one goes down, takes its in-flight batch
    with it and comes back on restart with a new epoch. The batch is a real request the gateway
    committed (held running by a slow formula): the owner sees its stream break, answers the
    request `worker_error` and settles the batch while the worker is still down. (The owner's
    old-epoch sweep on restart, `Ownership.settle_epoch`, is a backstop for a batch that outlived
    its stream; with a live owner the stream's end always settles first, so it is not what this
    test pins: tests/test_epoch_settle_live.py does.) The test starts its own worker, so the pool's
    is never killed."""
    own = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "1")
    port = own.ready["grpc_port"]
    wid = f"prefill@{own.address}"
    dec = worker_pool["decode"][0]
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, f"{wid},decode@{dec.address}")
    out: dict[str, httpx.Response | httpx.TransportError] = {}
    th: threading.Thread | None = None

    def call(rid: str) -> None:
        body = {"prompt": "held in flight", "max_new_tokens": 2, "request_id": rid}
        try:
            out[rid] = gw.post("/v1/generate", json=body)
        except httpx.TransportError as exc:  # the gateway stopped under it: a failed test's cleanup
            out[rid] = exc

    try:
        wait_for(lambda: gw.readyz()["workers"].get(wid) == "up", 15, what="worker up")
        # hang (fault): stops answering status. Each poll runs past its deadline, as a loaded
        # worker's might: down after 5 in a row (the owner's count, not wall-clock time; the
        # wait only bounds a hang).
        down = f"worker {wid} health up -> down after"
        asyncio.run(_configure(own.address, faults={"hang": True}))
        wait_for(lambda: gw.readyz()["workers"][wid] == "down", 30, what="down on hang")
        assert f"{down} 5 missed polls" in gw.log(), gw.log()[-2000:]
        asyncio.run(_configure(own.address, faults={}))
        wait_for(lambda: gw.readyz()["workers"][wid] == "up", 5, what="up after hang")
        # A real batch in flight when the worker dies: the gateway's request, held running by a
        # slow formula (600 s), committed into the ledger by the owner under the current epoch.
        keys = Keys(cluster)
        r = redis.Redis.from_url(shared_embedded_redis)
        assert worker_call(own.address, "configure", formula="600000")["ok"]
        rid = f"held-{cluster}"
        th = threading.Thread(target=call, args=(rid,), daemon=True)
        th.start()

        def held_batch() -> dict | None:
            for raw in r.hvals(keys.ledger(wid)):
                entry = json.loads(raw)
                if rid in entry.get("members", []):
                    return entry  # type: ignore[no-any-return]
            return None

        entry = wait_for(held_batch, 30, what="the request's batch in the ledger")
        assert entry["epoch"] == own.epoch, entry
        wait_for(lambda: running_on(own.address, rid), 30, what="the batch running on the worker")
        # kill
        old_epoch = own.epoch
        own.kill_hard()
        # a refused poll says it is not there: down at once, on the first one
        wait_for(lambda: gw.readyz()["workers"][wid] == "down", 30, what="down on kill")
        assert log_messages(gw).count(f"{down} 1 missed poll") == 1, gw.log()[-2000:]
        # its only prefill worker is down: the replica says it is not ready, and why
        ready = gw.readyz()
        assert not ready["ready"] and "no live prefill worker" in ready["reasons"], ready
        # The owner saw the batch's stream break: the request ends typed (a worker error, never a
        # hang or a 500) and its batch is settled, nothing owed for work that died with the worker.
        th.join(30)
        ended = out.get(rid)
        assert isinstance(ended, httpx.Response) and ended.status_code == 502, ended
        assert ended.json()["error"]["code"] == "worker_error", ended.text
        wait_for(lambda: held_batch() is None, 10, what="the dead batch settled")
        # restart on the same port: new epoch, back up
        own = start_worker(
            "prefill", worker_tmp, "--profile", "formula", "--formula", "1", "--grpc-port", str(port)
        )
        assert own.epoch != old_epoch
        wait_for(lambda: gw.readyz()["workers"][wid] == "up", 15, what="up after restart")
        snap = gw.get("/admin/workers", admin=True).json()["workers"][wid]["snapshot"]
        assert snap["epoch"] == own.epoch
        assert not r.hlen(keys.ledger(wid)), r.hgetall(keys.ledger(wid))  # nothing left owed
        metrics = gw.get("/metrics").text
        assert f'flexlb_worker_epoch_changes_total{{worker="{wid}"}} 1.0' in metrics
    finally:
        gw.stop()
        if th is not None and th.is_alive():  # its client call ends with the gateway
            th.join(30)
        own.stop()


async def _configure(addr: str, **kw) -> None:
    c = WorkerClient(addr)
    try:
        await c.configure(**kw)
    finally:
        await c.close()


async def _prefill(addr: str, tokens: np.ndarray) -> None:
    c = WorkerClient(addr)
    try:
        epoch = (await c.status())["epoch"]
        async for _ in c.prefill(f"b-{time.monotonic_ns()}", epoch, [(f"r-{time.monotonic_ns()}", tokens)]):
            pass
    finally:
        await c.close()


def test_cache_mirror_on_every_replica_and_late_joiner(
    worker_pool, clients_sync, shared_embedded_redis, cluster, tmp_path
) -> None:
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, specs(worker_pool))
    b = start_gateway(tmp_path, shared_embedded_redis, cluster)
    late = None
    try:
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="ready")
        p = worker_pool["prefill"][0]
        wid = f"prefill@{p.address}"
        tokens = np.random.default_rng(5).integers(32, 127, 64 * 10, dtype=np.int32)
        asyncio.run(_prefill(p.address, tokens))
        version = asyncio.run(_cache_version(p.address))
        for gw in (a, b):
            wait_for(
                lambda gw=gw: gw.get("/admin/cache", admin=True).json()["workers"][wid]["version"] >= version,
                10,
                what="mirror caught up",
            )
            m = gw.post("/admin/cache/match", admin=True, json={"input_ids": tokens.tolist()}).json()
            assert m["match"][wid] == 10
            assert all(v == 0 for w, v in m["match"].items() if w != wid)
        late = start_gateway(tmp_path, shared_embedded_redis, cluster)
        wait_for(
            lambda: (
                late.get("/admin/cache", admin=True).json()["workers"].get(wid, {}).get("version", 0)
                >= version
            ),
            10,
            what="late joiner caught up",
        )
        m = late.post("/admin/cache/match", admin=True, json={"input_ids": tokens.tolist()}).json()
        assert m["match"][wid] == 10
    finally:
        for g in (a, b, late):
            if g is not None:
                g.stop()


async def _cache_version(addr: str) -> int:
    c = WorkerClient(addr)
    try:
        st = await c.status()
        return int((await c.cache(None, st["epoch"]))["version"])
    finally:
        await c.close()


@pytest.fixture
def clients_sync(worker_pool):
    """Reset the pool's workers before and after (sync tests cannot use the async `clients`)."""

    async def reset_all() -> None:
        for ws in worker_pool.values():
            for w in ws:
                c = WorkerClient(w.address)
                await c.reset()
                await c.close()

    asyncio.run(reset_all())
    yield
    asyncio.run(reset_all())


class OwnRedis:
    """A redis-server this test can stop and restart on the same port, with or without its data."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="flexlb-test-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                find_redis_server(),
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--save",
                "",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: _ping(self.url), 10, what="redis up")

    def stop(self, wipe: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        if wipe:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir()


def _ping(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def test_redis_restart_with_data_then_empty(worker_pool, cluster, tmp_path) -> None:
    own = OwnRedis()
    own.start()
    gw = start_gateway(tmp_path, own.url, cluster, specs(worker_pool))
    try:
        wait_for(lambda: gw.readyz()["ready"], 60, what="ready")
        keys = Keys(cluster)
        r = redis.Redis.from_url(own.url)
        epoch1 = r.get(keys.cluster_epoch)
        # outage: /readyz says why
        own.stop()
        body = wait_for(lambda: (lambda d: d if not d["ready"] else None)(gw.readyz()), 5, what="not ready")
        assert any("redis unreachable" in x for x in body["reasons"])
        assert gw.get("/readyz").status_code == 503
        # back with its data: resumes, same cluster epoch
        own.start()
        wait_for(lambda: gw.readyz()["ready"], 10, what="ready again")
        assert redis.Redis.from_url(own.url).get(keys.cluster_epoch) == epoch1
        # back empty: detected, rebuilt from what the replica knows and from the workers
        own.stop(wipe=True)
        own.start()
        r = redis.Redis.from_url(own.url)
        wait_for(lambda: r.get(keys.cluster_epoch) not in (None, epoch1), 10, what="new cluster epoch")
        wait_for(lambda: r.scard(keys.workers) == 3, 10, what="registry rebuilt")
        wait_for(lambda: gw.readyz()["ready"], 10, what="ready after rebuild")
        assert "came back empty" in gw.log()
    finally:
        gw.stop()
        own.stop(wipe=True)
        shutil.rmtree(own.dir, ignore_errors=True)
