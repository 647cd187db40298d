"""The owner's old-epoch sweep (`Ownership.settle_epoch`) reached for real: a batch that outlived
both its stream and its owner, on a worker that then restarted.

With a live owner the batch's stream breaks when the worker dies and the owner settles it at once
(tests/test_gateway_cluster_state.py::test_worker_down_on_kill_and_hang_back_with_new_epoch), so the
sweep never has anything left to do there. It only has work when nobody was there to see the
stream break: the owner replica is SIGKILLed while its batch runs, a peer takes over the lease and
*adopts* the request (the worker still has it running, so the claim neither settles the batch nor
redispatches it), and then the worker restarts. From there the old batch will never finish: the
adoption sees the new epoch and, the request being ended by its dead origin's reaper, answers it
without running it again; it leaves the old batch to the sweep (settling it itself only when no
sweep did within seconds, app/dispatch/adopt.py), and so does the ledger audit with an older
epoch's batch (app/dispatch/ledger.py). The log and counters below show the sweep settled it.
Nothing here writes state the product would not write.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import redis

from app.state.handoff import GROUP
from app.state.keys import Keys

from .conftest import finished_records, running_on, start_worker, worker_call
from .gateways import Gateway, ids_owning, lease_owner, log_messages, start_gateway, wait_for

TTL_S = 3.0  # the default owner lease TTL (FLEXLB_LEASE_TTL_MS=3000)
TIMEOUT_MS = 300_000  # the request's deadline: the adoption waits this long for a finished record


def test_new_owner_sweeps_a_dead_owners_batch_when_the_worker_restarts(
    worker_pool, shared_embedded_redis, cluster, tmp_path, worker_tmp
) -> None:
    own = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "1")
    port = own.ready["grpc_port"]
    wid = f"prefill@{own.address}"
    dec = f"decode@{worker_pool['decode'][0].address}"
    id_a, id_b = ids_owning([wid, dec], wid, "gw-e")
    keys = Keys(cluster)
    r = redis.Redis.from_url(shared_embedded_redis)
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, f"{wid},{dec}", FLEXLB_REPLICA_ID=id_a)
    b: Gateway | None = None
    th: threading.Thread | None = None
    rid = f"swept-{cluster}"

    def call() -> None:
        body = {
            "prompt": "outlives its owner",
            "max_new_tokens": 2,
            "request_id": rid,
            "timeout_ms": TIMEOUT_MS,
        }
        with contextlib.suppress(httpx.HTTPError):  # A dies under it, and its client's connection
            a.post("/v1/generate", json=body)

    def held_batch() -> dict | None:
        for raw in r.hvals(keys.ledger(wid)):
            entry = json.loads(raw)
            if rid in entry.get("members", []):
                return entry  # type: ignore[no-any-return]
        return None

    try:
        wait_for(lambda: a.readyz()["workers"].get(wid) == "up", 30, what="worker up on A")
        wait_for(lambda: lease_owner(a, wid) == id_a, 10, what="A owns the worker")
        b = start_gateway(tmp_path, shared_embedded_redis, cluster, FLEXLB_REPLICA_ID=id_b)
        wait_for(
            lambda: len(a.get("/admin/leases", admin=True).json()["live_replicas"]) == 2, 10, what="2 live"
        )
        assert lease_owner(b, wid) == id_a
        # A's batch, held running by a slow formula (600 s), committed by A under the first epoch.
        assert worker_call(own.address, "configure", formula="600000")["ok"]
        th = threading.Thread(target=call, daemon=True)
        th.start()
        entry = wait_for(held_batch, 30, what="the request's batch in the ledger")
        assert entry["epoch"] == own.epoch, entry
        wait_for(lambda: running_on(own.address, rid), 30, what="the batch running on the worker")
        # The owner dies by SIGKILL: no stream end, no drain, nobody settles the batch.
        a.kill()
        wait_for(lambda: lease_owner(b, wid) == id_b, 2 * TTL_S + 2, what="B takes over the lease")
        # B's claim finds the request still running on the worker and adopts it: the batch stays
        # in the ledger, owed, and B's poller knows the worker under its first epoch.
        wait_for(
            lambda: 'flexlb_owner_claimed_total{outcome="adopted"} 1.0' in b.get("/metrics").text,
            10,
            what="B adopts the running request",
        )
        wait_for(
            lambda: f"worker {wid} health unknown -> up" in log_messages(b), 10, what="B polls the worker"
        )
        assert held_batch() is not None
        # A was the request's origin too: the master's reaper ends it `owner_lost` (DESIGN §6).
        wait_for(lambda: r.hget(keys.request(rid), "state") == b"owner_lost", 15, what="the reaper ends it")
        old_epoch = own.epoch
        # The snapshot every replica routes by counts it as committed to the worker.
        wait_for(lambda: int(r.hget(keys.snapshot(wid), "inflight_batches") or 0) == 1, 5, what="counted")
        # The worker crashes and comes back on its port with a new epoch: the batch is gone with it.
        own.kill_hard()
        own = start_worker(
            "prefill", worker_tmp, "--profile", "formula", "--formula", "1", "--grpc-port", str(port)
        )
        assert own.epoch != old_epoch
        t0 = time.monotonic()
        # B's poller sees the new epoch and sweeps the old-epoch batch from the ledger, long before
        # the adoption's deadline (TIMEOUT_MS) or the audit's TTL would.
        wait_for(lambda: held_batch() is None, 15, what="the old-epoch batch swept")
        swept_s = time.monotonic() - t0
        assert swept_s < 15 < TIMEOUT_MS / 1000
        assert not r.hlen(keys.ledger(wid)), r.hgetall(keys.ledger(wid))
        wait_for(
            lambda: (
                r.hget(keys.snapshot(wid), "epoch") == own.epoch.encode()
                and int(r.hget(keys.snapshot(wid), "inflight_batches") or 0) == 0
                and float(r.hget(keys.snapshot(wid), "owed_ms") or 0) == 0
            ),
            5,
            what="nothing owed under the new epoch",
        )
        metrics = b.get("/metrics").text
        assert f'flexlb_worker_epoch_changes_total{{worker="{wid}"}} 1.0' in metrics
        # the log is written by a background writer (batches every 50 ms): poll for the line
        swept = f"worker {wid} restarted (old epoch {old_epoch}): settled 1 batches"
        wait_for(lambda: swept in log_messages(b), 5, what="the sweep's log line")
        # The sweep, not the claim or the audit, settled it.
        assert 'flexlb_owner_claimed_total{outcome="redispatched"} 0.0' in metrics
        # Ended, it is not run again on the new epoch (app/dispatch/adopt.py): its claimed entry
        # is answered `cancelled` at once, not at its deadline, and nothing of it ran there.
        wait_for(lambda: not r.xpending(keys.queue(wid), GROUP)["pending"], 10, what="the entry answered")
        assert 'flexlb_owner_claimed_total{outcome="rerun"} 0.0' in b.get("/metrics").text
        assert r.hget(keys.request(rid), "state") == b"owner_lost"
        assert not [x for x in finished_records(own.address) if x["request_id"] == rid]
        assert "flexlb_ledger_late_settled_total{" not in metrics or all(
            ln.endswith(" 0.0")
            for ln in metrics.splitlines()
            if ln.startswith("flexlb_ledger_late_settled_total{")
        )
    finally:
        a.kill()
        if b is not None:
            b.stop()
        if th is not None:
            th.join(30)
        own.stop()
