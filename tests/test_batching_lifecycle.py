"""Batching under load and at the edges of a request's life, through real replicas, Redis and
Triton workers: the in-flight cap seen from the worker, nothing left owed or reserved after 1,000
requests, cancel of a member waiting in the owner's batcher, and a replica's graceful drain."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from typing import Any

import httpx
import redis

from app.rpc.worker_client import WorkerClient
from app.state.handoff import GROUP
from app.state.keys import Keys

from .gateways import ADMIN_TOKEN, Gateway, metric_value, start_gateway, wait_for
from .test_batching_live import one_prefill_cluster  # noqa: F401  (shared fixture)

H = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# The pool decode worker's KV for the refused-reservation test, and the real request that fills it:
# it reserves its prompt + maximum (nothing learned yet) = 1,960 of 2,000 tokens, leaving 40, less
# than the 133 a `which decode` request needs. Its decode takes ~1,900 x 8 ms modelled steps at a
# clock 4x slower than the wall: ~60 s, far past the rest of the test (a few seconds); it is
# cancelled at the end.
HOLD_CAP = 2_000
HOLD_PROMPT = "h" * 60  # byte tokenizer: 60 prompt tokens
HOLD_NEW = 1_900
HOLD_TIME_SCALE = 4.0


def _configure(gw: Gateway, **cfg: Any) -> None:
    before = gw.log().count("runtime config v")
    assert httpx.put(gw.url + "/admin/config", json=cfg, headers=H).status_code == 200
    wait_for(lambda: gw.log().count("runtime config v") > before, 30, what="config applied")


async def _worker(addr: str, **kw: Any) -> dict[str, Any]:
    c = WorkerClient(addr)
    try:
        if kw:
            await c.configure(**kw)
        return await c.status(0)
    finally:
        await c.close()


def _prefill_addr(gw: Gateway) -> str:
    wid = next(w for w in gw.get("/admin/workers", admin=True).json()["workers"] if w.startswith("prefill"))
    return wid.split("@", 1)[1]


def test_thousand_requests_leave_nothing_owed_or_reserved_and_inflight_is_capped(
    one_prefill_cluster,  # noqa: F811
    shared_embedded_redis,
    cluster,
) -> None:
    """1,000 requests from both replicas, 32 at a time, over one prefill worker with a real
    per-batch cost: the worker's own high-water mark of batches held at once (`max_live_batches`,
    updated on every submit) is exactly `max_inflight_batches`, so the cap was reached and never
    exceeded; after the last reply every ledger and reservation empties and the owner's
    late-settlement audit never had to act (settle on reply did it all: no wall-clock bound, the
    audit's counters say who settled). No request is refused: under a CPU hog the decode worker
    answers its owner's polls late, and it stays in routing (app/cluster/health.py).

    A poller sampling `live` every 10 ms in the clients' event loop once saw at most 1 batch in
    flight on a loaded box (CI): it missed the short overlaps the worker's mark cannot miss."""
    a, b = one_prefill_cluster
    paddr = _prefill_addr(a)
    asyncio.run(_worker(paddr, formula="12 + sum(0.002*computeTokens)"))
    _configure(a, max_inflight_batches=2, batch_max_size=8)
    rng = random.Random(7)
    n, conc = 1000, 32
    keys = Keys(cluster)
    r = redis.Redis.from_url(shared_embedded_redis)
    wids = list(a.get("/admin/workers", admin=True).json()["workers"])

    # the fixture reset the worker; nothing was sent since: the mark starts from an idle worker
    assert asyncio.run(_worker(paddr))["max_live_batches"] == 0

    async def run() -> tuple[list[httpx.Response], float]:
        sem = asyncio.Semaphore(conc)

        async def one(i: int, c: httpx.AsyncClient) -> httpx.Response:
            gw = a if i % 2 else b
            body = {"prompt": f"load {i} " + "z" * rng.randint(20, 400), "max_new_tokens": 1 + (i % 3)}
            async with sem:
                return await c.post(gw.url + "/v1/generate", json=body)

        limits = httpx.Limits(max_connections=conc * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            resps = await asyncio.gather(*(one(i, c) for i in range(n)))
            t_last = time.monotonic()
        return resps, t_last

    resps, t_last = asyncio.run(run())
    bad = [x.json() for x in resps if x.status_code != 200]
    assert not bad, (len(bad), bad[:3])

    def empty() -> bool:
        for w in wids:
            if r.hlen(keys.ledger(w)):
                return False
            total = r.hget(keys.reservations(w), "_total")
            if total is not None and int(float(total)) != 0:
                return False
        return True

    # Settled on reply, not by the owner's audit: the late-settlement counters below stay 0. The
    # wait only bounds a hang (it took 178 ms under a CPU hog, against ~10 ms idle).
    wait_for(empty, 30.0, interval=0.002, what="ledgers and reservations empty")
    settled_after_ms = (time.monotonic() - t_last) * 1000
    peak = asyncio.run(_worker(paddr))["max_live_batches"]
    # owner polls answered late, for the log
    slow = sum(metric_value(gw, "flexlb_worker_polls_slow_total") for gw in (a, b))
    print(f"ledgers+reservations empty {settled_after_ms:.1f} ms after the last reply; in flight max {peak}")
    print(f"owner polls answered past their deadline during the run: {slow:.0f}")
    assert peak <= 2, peak  # the cap held
    assert peak == 2  # and was actually reached
    for gw in (a, b):
        for path in ("ttl", "missed", "record"):
            assert metric_value(gw, "flexlb_ledger_late_settled_total", path=path) == 0, (gw.replica_id, path)
    sizes = [x.json()["batch_size"] for x in resps]
    assert max(sizes) > 1  # the load did batch


def test_cancel_of_a_member_waiting_in_the_batcher_never_reaches_the_worker(
    one_prefill_cluster,  # noqa: F811
    shared_embedded_redis,
    cluster,
) -> None:
    """The worker is busy and the in-flight cap is reached, so three requests wait in the owner's
    batcher; one is cancelled from the OTHER replica. Its tombstone makes the owner's fenced commit
    drop it: the worker never sees it, its batch mates complete, and it ends `cancelled`."""
    a, b = one_prefill_cluster
    paddr = _prefill_addr(a)
    _configure(a, max_inflight_batches=1, batch_max_size=8)
    asyncio.run(_worker(paddr, formula="1500"))
    tag = f"{random.getrandbits(32):08x}"
    wid = next(w for w in a.get("/admin/workers", admin=True).json()["workers"] if w.startswith("prefill"))
    r = redis.Redis.from_url(shared_embedded_redis)
    qkey = Keys(cluster).queue(wid)

    def owner_holds(n: int) -> bool:
        """The owner has read n hand-offs it has not settled yet (in its batcher or dispatched)."""
        return int(r.xpending(qkey, GROUP)["pending"]) == n

    async def run() -> tuple[list[httpx.Response], httpx.Response, dict]:
        async with httpx.AsyncClient(timeout=60) as c:
            blocker = asyncio.create_task(
                c.post(a.url + "/v1/generate", json={"prompt": "blocker " * 30, "max_new_tokens": 2})
            )
            await _until(lambda: _live_batches(paddr), 5)
            ids = [f"wait-{tag}-{i}" for i in range(3)]
            waiting = [
                asyncio.create_task(
                    c.post(
                        a.url + "/v1/generate",
                        json={"prompt": f"w{i} " * 40, "max_new_tokens": 2, "request_id": rid},
                    )
                )
                for i, rid in enumerate(ids)
            ]
            await _until(lambda: owner_holds(4), 5)  # the blocker + the three waiting ones
            assert len(await _live_batches(paddr)) == 1  # still only the blocker on the worker
            assert (await c.get(b.url + f"/v1/requests/{ids[1]}")).json()["state"] == "queued"
            cancel = await c.delete(b.url + f"/v1/requests/{ids[1]}")
            done = await asyncio.gather(blocker, *waiting)
            rec = (await c.get(b.url + f"/v1/requests/{ids[1]}")).json()
            return list(done), cancel, rec

    done, cancel, rec = asyncio.run(run())
    assert cancel.status_code in (200, 202), cancel.text
    blocker, first, cancelled, third = done
    assert blocker.status_code == 200 and first.status_code == 200 and third.status_code == 200
    assert cancelled.status_code == 499 and cancelled.json()["error"]["code"] == "cancelled"
    assert rec["state"] == "cancelled", rec
    mate = asyncio.run(_get(b, f"wait-{tag}-0"))
    assert mate["state"] == "completed" and mate.get("batch_id") == first.json()["batch_id"], mate
    assert first.json()["batch_id"] == third.json()["batch_id"]  # the two mates ran together
    finished = asyncio.run(_all_finished(paddr))
    assert f"wait-{tag}-1" not in {f["request_id"] for f in finished}, "the cancelled one reached the worker"
    assert sum(1 for f in finished if f["request_id"].startswith(f"wait-{tag}")) == 2
    # one JSON log line per lifecycle transition, with the ids an operator greps for
    ev = _events(a, f"wait-{tag}-0")
    assert [e["event"] for e in ev] == ["queued", "dispatched", "prefilled", "decoding", "completed"], ev
    assert all(e["trace_id"] == ev[0]["trace_id"] for e in ev) and ev[0]["trace_id"]
    assert ev[1]["batch_id"] == first.json()["batch_id"] and ev[1]["prefill_worker"] == wid
    assert ev[-1]["decode_worker"] and ev[-1]["batch_id"] == ev[1]["batch_id"]
    gone = _events(a, f"wait-{tag}-1")
    assert [e["event"] for e in gone] == ["queued", "cancelled"] and gone[-1]["code"] == "cancelled", gone
    asyncio.run(_worker(paddr, formula="1"))


def test_sigterm_drains_requests_then_hands_leases_over(one_prefill_cluster) -> None:  # noqa: F811
    """SIGTERM the replica that owns the workers while requests run through it and through the
    other replica: /readyz turns false at once, a new request gets 503 `draining`, both running
    requests complete, the process exits, and the survivor takes the leases and serves."""
    a, b = one_prefill_cluster
    paddr = _prefill_addr(a)
    asyncio.run(_worker(paddr, formula="1500"))

    async def run() -> tuple[list[httpx.Response], dict, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            running = [
                asyncio.create_task(
                    c.post(gw.url + "/v1/generate", json={"prompt": f"drain {i} " * 30, "max_new_tokens": 3})
                )
                for i, gw in enumerate((a, b))
            ]
            await _until(lambda: _live_batches(paddr), 5)
            a.proc.send_signal(signal.SIGTERM)

            async def not_ready() -> dict | None:
                body = (await c.get(a.url + "/readyz")).json()
                return body if not body["ready"] else None

            ready = await _until(not_ready, 3)
            refused = await c.post(a.url + "/v1/generate", json={"prompt": "late", "max_new_tokens": 2})
            return list(await asyncio.gather(*running)), ready, refused

    done, ready, refused = asyncio.run(run())
    assert "draining" in ready["reasons"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert [x.status_code for x in done] == [200, 200], [x.text for x in done]
    assert a.proc.wait(20) is not None
    drained = [json.loads(x) for x in a.log().splitlines() if '"event": "drained"' in x]
    assert len(drained) == 1 and '"requests_unfinished": 0' in drained[0]["msg"], drained
    asyncio.run(_worker(paddr, formula="1"))

    def b_owns_all() -> bool:
        ws = b.get("/admin/workers", admin=True).json()["workers"]
        return all(info["owner"] == b.replica_id for info in ws.values())

    wait_for(b_owns_all, 10, interval=0.1, what="survivor owns every worker")
    after = httpx.post(
        b.url + "/v1/generate", json={"prompt": "after " * 20, "max_new_tokens": 2}, timeout=30
    )
    assert after.status_code == 200, after.text


async def _until(cond: Any, timeout: float) -> Any:
    """Bounded async poll on a (possibly async) condition."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout}s")


async def _live_batches(addr: str) -> list[dict]:
    c = WorkerClient(addr)
    try:
        return (await c.status(10**12))["live"]
    finally:
        await c.close()


async def _all_finished(addr: str) -> list[dict]:
    """Every finished record the worker still holds, paged (a status page is bounded)."""
    c = WorkerClient(addr)
    out: list[dict] = []
    try:
        since = 0
        while True:
            st = await c.status(since)
            out += st["finished"]
            if not st.get("more") or not st["finished"]:
                return out
            since = st["finished"][-1]["seq"]
    finally:
        await c.close()


def _events(gw: Gateway, rid: str) -> list[dict[str, Any]]:
    out = []
    for line in gw.log().splitlines():
        if rid in line and '"event"' in line:
            d = json.loads(line)
            if d.get("request_id") == rid:
                out.append(d)
    return out


async def _get(gw: Gateway, rid: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(gw.url + f"/v1/requests/{rid}")).json()


def test_batch_that_fails_before_the_worker_accepts_it_is_retried_once_elsewhere(
    worker_pool, worker_tmp, shared_embedded_redis, cluster, tmp_path
) -> None:
    """A prefill worker dies between routing and dispatch (SIGKILL, so the owner's gRPC call is
    refused before any `accepted`): nothing ran, so the origin re-routes the request once, to the
    other prefill worker, and the client sees a normal answer."""
    from .conftest import start_worker

    doomed = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "1")
    p = worker_pool["prefill"][0]
    d = worker_pool["decode"][0]
    spec = f"prefill@{p.address},prefill@{doomed.address},decode@{d.address}"
    # One poll per worker at start-up, the next 10 minutes later: the kill below is not seen by a
    # poll (a refused one takes a worker out of routing at once), so the router still picks
    # `doomed` and the dispatch meets the dead worker, however slow the box. (The runtime config
    # is read at that interval too: the strategy is set at start.)
    a = start_gateway(
        tmp_path,
        shared_embedded_redis,
        cluster,
        spec,
        FLEXLB_POLL_INTERVAL_MS="600000",
        FLEXLB_PREFILL_STRATEGY="round_robin",
    )
    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="ready")
        doomed_id = f"prefill@{doomed.address}"

        def send(tag: str) -> httpx.Response:
            body = {"prompt": f"retry {tag} " * 20, "max_new_tokens": 2}
            return httpx.post(a.url + "/v1/generate", json=body, timeout=30)

        # round_robin goes by id: after a request on the survivor, the next one goes to `doomed`
        for i in range(3):
            first = send(f"warm{i}")
            assert first.status_code == 200, first.text
            if first.json()["prefill_worker"] != doomed_id:
                break
        before = metric_value(a, "flexlb_prefill_retries_total")
        doomed.kill_hard()
        resp = send("after-kill")
        assert resp.status_code == 200, resp.text
        assert resp.json()["prefill_worker"] == f"prefill@{p.address}"
        assert metric_value(a, "flexlb_prefill_retries_total") == before + 1
    finally:
        a.stop()
        doomed.stop()


def test_a_refused_decode_reservation_is_placed_on_another_decode_worker(
    workers_reset, worker_tmp, shared_embedded_redis, cluster, tmp_path
) -> None:
    """The decode worker the router picks refuses the reservation: requests admitted since the
    snapshot the router ranked on hold its KV (made stale on purpose: one poll at start-up). The
    origin reserves on the next decode worker instead of answering 429.

    The hold is a real request the gateway admitted: a long generation on the pool's decode worker,
    reconfigured for this test (a small KV and a slower clock), still running while the later
    requests are routed. It is this replica's own: the router counts reservations only through
    the snapshot, so its own hold is as unseen as another replica's until the next poll.
    `workers_reset` puts the pool back, pass or fail."""
    from .conftest import start_worker, worker_call

    p, d = workers_reset["prefill"][0], workers_reset["decode"][0]
    configured = worker_call(d.address, "configure", kv_capacity_tokens=HOLD_CAP, time_scale=HOLD_TIME_SCALE)
    assert configured.get("ok"), configured
    extra = start_worker("decode", worker_tmp, "--profile", "formula", "--formula", "1")
    did, xid = f"decode@{d.address}", f"decode@{extra.address}"
    spec = ",".join([f"prefill@{p.address}", did, xid])
    a = start_gateway(
        tmp_path,
        shared_embedded_redis,
        cluster,
        spec,
        # One poll per worker at start-up and the next 10 minutes later: everything below is
        # routed on snapshots from before the long request was admitted, however slow the box.
        FLEXLB_POLL_INTERVAL_MS="600000",
        FLEXLB_DECODE_STRATEGY="round_robin",
    )
    r = redis.Redis.from_url(shared_embedded_redis)
    keys = Keys(cluster)
    hold_id = f"hold-{cluster}"
    hold_out: list[httpx.Response | httpx.TransportError] = []
    body = {"prompt": "which decode " * 10, "max_new_tokens": 3}

    def send(extra_fields: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(a.url + "/v1/generate", json={**body, **(extra_fields or {})}, timeout=30)

    def hold() -> None:
        req = {"prompt": HOLD_PROMPT, "max_new_tokens": HOLD_NEW, "request_id": hold_id}
        try:
            hold_out.append(httpx.post(a.url + "/v1/generate", json=req, timeout=120))
        except httpx.TransportError as exc:  # the gateway stopped under it: a failed test's cleanup
            hold_out.append(exc)

    holder = threading.Thread(target=hold, daemon=True)
    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="ready")
        wait_for(
            lambda: _snapshot(a, did).get("kv_total_tokens") in (HOLD_CAP, str(HOLD_CAP)),
            30,
            what=f"the gateway to see the decode worker's {HOLD_CAP}-token KV",
        )
        # round_robin goes by id, wrapping: once a request went to the other worker, the next
        # one goes to the pool's
        first = send()
        assert first.status_code == 200, first.text
        if first.json()["decode_worker"] == did:
            first = send()
            assert first.status_code == 200, first.text
        assert first.json()["decode_worker"] == xid, first.text

        holder.start()
        # Its reservation, written by the gateway when it admitted it (read-only poll).
        held = int(
            wait_for(lambda: r.hget(keys.reservations(did), hold_id), 30, what="the long request's hold")
        )
        assert held == len(HOLD_PROMPT) + HOLD_NEW, held  # nothing learned yet: prompt + its maximum
        wait_for(lambda: hold_id in _decoding(d.address), 30, what="the long request decoding")
        spacer = send()  # round_robin's turn of the other worker, so the next turn is the full one's
        assert spacer.status_code == 200 and spacer.json()["decode_worker"] == xid, spacer.text

        before = metric_value(a, "flexlb_decode_reserve_retries_total")
        second = send()
        assert second.status_code == 200, second.text
        assert second.json()["decode_worker"] == xid  # placed on the other worker
        assert not r.hexists(keys.reservations(did), second.json()["request_id"])  # refused: nothing held
        assert metric_value(a, "flexlb_decode_reserve_retries_total") == before + 1
        assert not r.hexists(keys.reservations(xid), second.json()["request_id"])  # released at the end
        # the same with a client request id (recorded first, then handed off: the other code path)
        third = send({"request_id": f"rr-{cluster}"})
        assert third.status_code == 200 and third.json()["decode_worker"] == xid, third.text
        assert metric_value(a, "flexlb_decode_reserve_retries_total") == before + 2
        # The refusals were the long request's doing: still held and decoding, and the router's
        # snapshot never counted it (a poll in between would have skipped the worker, no retry).
        assert r.hget(keys.reservations(did), hold_id) is not None, "the long request ended early"
        assert hold_id in _decoding(d.address), "the long request stopped decoding: box too slow?"
        assert int(float(_snapshot(a, did).get("reserved_tokens", 0) or 0)) == 0, _snapshot(a, did)

        assert a.delete(f"/v1/requests/{hold_id}").status_code == 202
        holder.join(60)
        ended = hold_out[0] if hold_out else None
        assert isinstance(ended, httpx.Response) and ended.status_code == 499, ended  # cancelled
        assert ended.json()["error"]["code"] == "cancelled", ended.text
        wait_for(
            lambda: not r.hexists(keys.reservations(did), hold_id),
            30,
            what="the long request's hold released",
        )
        for wid in (did, xid):  # nothing left held on either worker
            left = {k.decode(): v.decode() for k, v in r.hgetall(keys.reservations(wid)).items()}
            assert set(left) <= {"_total"} and int(float(left.get("_total", 0))) == 0, (wid, left)
    finally:
        a.stop()
        if holder.is_alive():  # its client call ends with the gateway
            holder.join(30)
        extra.stop()
        r.close()


def _snapshot(gw: Gateway, wid: str) -> dict[str, Any]:
    """The gateway's latest snapshot of ``wid`` (what its routing reads)."""
    snap: dict[str, Any] = (
        gw.get("/admin/workers", admin=True).json()["workers"].get(wid, {}).get("snapshot", {})
    )
    return snap


def _decoding(address: str) -> list[str]:
    """Ids the decode worker's engine is generating for now."""
    from .conftest import worker_call

    running: list[str] = worker_call(address, "status")["live"]["running"]
    return running
