"""An adopted request whose worker restarts is run again, once, on the new epoch (app/dispatch/adopt.py).

When an owner replica dies, the new lease holder adopts the requests its worker is still running
(DESIGN §6 "Dead owner") and waits for their finished records. If the worker itself restarts
meanwhile, the request is gone with the old process: before the fix its client waited until its
deadline (120 s by default) and then got `worker_error` "adopted request never finished". Now the
adopting owner runs it again on the new epoch, and the client gets its answer.

Everything here is real: two gateway replicas sharing Redis, the owner replica SIGKILLed by PID,
the prefill worker SIGKILLed (its whole process group) and started again on its port. The second
test pins down the dispatch's own guard against a lagging epoch view, with a stale view injected.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import httpx
import numpy as np
import redis

from app import metrics as M
from app.cluster.leases import Lease, acquire_leases
from app.dispatch.owner import OwnerDispatcher
from app.state.handoff import GROUP, pack_tokens
from app.state.keys import Keys

from .conftest import finished_records, handoff_rig, record_mark, running_on, start_worker, worker_call
from .gateways import Gateway, ids_owning, lease_owner, log_messages, metric_value, start_gateway, wait_for

TTL_S = 3.0  # the default owner lease TTL (FLEXLB_LEASE_TTL_MS=3000)
DEADLINE_S = 120.0  # the default request timeout: what the client waited before the fix
SLOW_FORMULA = "600000"  # A's batch runs 600 modelled s: only the restart ends it
ANSWER_AFTER_RESTART_S = 30.0  # a loose wall bound, far below DEADLINE_S (it takes ~1 s idle)


def test_adopted_request_runs_again_once_when_its_worker_restarts(
    worker_pool, shared_embedded_redis, cluster, tmp_path, worker_tmp
) -> None:
    """Origin B ≠ owner A: the client waits on B while A's worker runs its batch. A is SIGKILLed,
    B takes the lease and adopts the running request; then the worker crashes and comes back with
    a new epoch. The client gets a completed answer within seconds of the worker's return (not a
    `worker_error` at its 120 s deadline), and the request ran exactly once on the new epoch."""
    own = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "1")
    port = own.ready["grpc_port"]
    wid = f"prefill@{own.address}"
    dec = f"decode@{worker_pool['decode'][0].address}"
    id_a, id_b = ids_owning([wid, dec], wid, "gw-r")
    keys = Keys(cluster)
    r = redis.Redis.from_url(shared_embedded_redis)
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, f"{wid},{dec}", FLEXLB_REPLICA_ID=id_a)
    b: Gateway | None = None
    th: threading.Thread | None = None
    rid = f"rerun-{cluster}"
    answer: dict[str, Any] = {}

    def call() -> None:
        assert b is not None
        body = {"prompt": "outlives its owner and its worker", "max_new_tokens": 2, "request_id": rid}
        t0 = time.monotonic()
        try:  # no timeout_ms: the default deadline (DEADLINE_S) applies
            answer["resp"] = httpx.post(b.url + "/v1/generate", json=body, timeout=DEADLINE_S + 30)
        except httpx.HTTPError as exc:  # recorded: the assertion below shows it
            answer["resp"] = exc
        answer["t"] = time.monotonic()
        answer["wall_s"] = answer["t"] - t0

    def running_on_worker() -> bool:
        return running_on(own.address, rid)

    try:
        wait_for(lambda: a.readyz()["workers"].get(wid) == "up", 30, what="worker up on A")
        wait_for(lambda: lease_owner(a, wid) == id_a, 10, what="A owns the worker")
        b = start_gateway(tmp_path, shared_embedded_redis, cluster, FLEXLB_REPLICA_ID=id_b)
        wait_for(
            lambda: len(a.get("/admin/leases", admin=True).json()["live_replicas"]) == 2, 10, what="2 live"
        )
        assert lease_owner(b, wid) == id_a
        assert worker_call(own.address, "configure", formula=SLOW_FORMULA)["ok"]
        th = threading.Thread(target=call, daemon=True)
        th.start()
        wait_for(running_on_worker, 30, what="the request's batch running on A's worker")
        assert r.hget(keys.request(rid), "origin") == id_b.encode()  # the client waits on B
        # The owner dies by SIGKILL: no stream end, no drain; B takes over and adopts the request.
        a.kill()
        wait_for(lambda: lease_owner(b, wid) == id_b, 2 * TTL_S + 2, what="B takes over the lease")
        wait_for(
            lambda: metric_value(b, "flexlb_owner_claimed_total", outcome="adopted") == 1,
            10,
            what="B adopts the running request",
        )
        wait_for(
            lambda: f"worker {wid} health unknown -> up" in log_messages(b), 10, what="B polls the worker"
        )
        assert "resp" not in answer and running_on_worker()
        # The worker crashes and comes back on its port with a new epoch: the request is gone.
        old_epoch = own.epoch
        own.kill_hard()
        own = start_worker(
            "prefill", worker_tmp, "--profile", "formula", "--formula", "1", "--grpc-port", str(port)
        )
        back = time.monotonic()
        assert own.epoch != old_epoch
        th.join(DEADLINE_S + 40)
        resp = answer.get("resp")
        assert isinstance(resp, httpx.Response), resp
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert len(out["output_ids"]) == 2 and out["prefill_worker"] == wid, out
        after_restart_s = answer["t"] - back
        print(f"answer {after_restart_s:.2f} s after the worker was back, {answer['wall_s']:.1f} s in all")
        assert after_restart_s < ANSWER_AFTER_RESTART_S < DEADLINE_S, after_restart_s
        # Exactly once on the new epoch, and it is the run that answered the client.
        recs = [x for x in finished_records(own.address) if x["request_id"] == rid]
        assert len(recs) == 1 and recs[0]["status"] == "ok", recs
        assert recs[0]["batch_id"] == out["batch_id"], (recs, out)
        assert worker_call(own.address, "status")["epoch"] == own.epoch
        assert (r.hget(keys.request(rid), "state") or b"").decode() == "completed"
        assert metric_value(b, "flexlb_owner_claimed_total", outcome="rerun") == 1
        assert metric_value(b, "flexlb_owner_claimed_total", outcome="redispatched") == 0
        rerun_line = f"under adopted request {rid}: running it again"
        wait_for(lambda: any(rerun_line in m for m in log_messages(b)), 5, what="the re-run's log line")
        # Nothing left owed: the old-epoch batch settled, the re-run's settled on its reply.
        wait_for(lambda: not r.hlen(keys.ledger(wid)), 10, what="an empty ledger")
    finally:
        a.kill()
        if b is not None:
            b.stop()
        if th is not None:
            th.join(30)
        own.stop()
        r.close()


async def test_a_batch_refused_for_a_stale_epoch_is_sent_again_under_the_workers(
    clients, shared_embedded_redis
) -> None:
    """A dispatch carries the owner's view of the worker's epoch (its poller's): one that raced a
    restart is refused `epoch_mismatch` before the engine sees it. The owner sends it once more
    under the epoch the refusal names instead of failing its request, so it runs exactly once.

    The stale view is injected (the dispatcher is given an epoch the worker never had): a
    dispatch landing between a real restart and the poller's next poll cannot be caused on
    demand. Redis, the worker and the owner are real."""
    p = clients["prefill"][0]
    epoch = (await p.status())["epoch"]
    mark = await asyncio.to_thread(record_mark, p.address)
    keys, wid, r, store, handoff = await handoff_rig(shared_embedded_redis, "t-stale", p.address)
    rid = f"st-{uuid.uuid4().hex[:8]}"
    lease = Lease(keys.owner_lease(wid), "gw-own", 3000, 1000)
    assert await acquire_leases(r, keys.fence_counter, [lease])
    d = OwnerDispatcher(wid, "gw-own", lease, store, p, shared_embedded_redis, epoch=lambda: "0stale0epoch")
    before = M.DISPATCH_EPOCH_RETRIES._value.get()
    d.start()
    try:
        await asyncio.wait_for(d._claimed_once.wait(), 15)
        meta = {"rid": rid, "origin": "gw-origin", "pred": 5.0}
        await handoff.append(wid, meta, pack_tokens(np.arange(64) + 7), 5.0, 1000)
        got: dict[str, dict[bytes, bytes]] = {}
        end = time.monotonic() + 15
        while time.monotonic() < end and rid not in got:
            await lease.renew(r)
            got = {f[b"rid"].decode(): f for _, f in await r.xrange(keys.replies("gw-origin"))}
            await asyncio.sleep(0.1)
        reply = got[rid]
        assert reply[b"status"] == b"ok" and reply[b"epoch"].decode() == epoch, reply
        assert M.DISPATCH_EPOCH_RETRIES._value.get() == before + 1
        recs = [
            x for x in await asyncio.to_thread(finished_records, p.address, mark) if x["request_id"] == rid
        ]
        assert len(recs) == 1 and recs[0]["batch_id"] == reply[b"batch_id"].decode(), recs
        assert not await r.hlen(keys.ledger(wid))  # the refused batch settled, the retry on reply
        assert not (await r.xpending(keys.queue(wid), GROUP))["pending"]
    finally:
        await d.stop()
        await r.aclose()
