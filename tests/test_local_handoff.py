"""Origin and owner in one replica skip Redis hops without changing what a crash leaves behind
(issue 20): the hand-off's round trip delivers the entry to the owner's consumer (it is in the
stream and in that consumer's pending list exactly as a read would leave it, and the owner's
blocked read does not deliver it again), the owner answers its own origin in process once the
settlement is written, and the members' `dispatched` marks ride in the commit's round trip.
Real Redis (both flavours for the script), a real Triton worker, a real owner."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from app.cluster.leases import Lease, acquire_leases
from app.dispatch.owner import OwnerDispatcher
from app.state import scripts
from app.state.handoff import GROUP, Handoff, pack_tokens
from app.state.keys import Keys
from app.state.resp import RespConnection, stream_entries
from app.state.store import StateStore

from .conftest import handoff_rig
from .gateways import start_gateway, wait_for


def _own_handoff_cmd(keys: Keys, wid: str, rid: str, lease: str, consumer: str = "me") -> list[Any]:
    """The arguments of an owner's own `handoff` call (as `HandoffRoundTrip._record_and_append`)."""
    meta = f'{{"rid":"{rid}","origin":"{consumer}","pred":1.0}}'
    return [
        [keys.queue(wid), keys.queued_ms(wid), keys.ledger(wid), keys.owner_lease(wid)],
        [100, "1.000000", meta, pack_tokens(np.arange(8)), "1", b"", GROUP, consumer, lease],
    ]


async def _parked(r: aioredis.Redis, name: str) -> bool:
    """Whether the connection named `name` is blocked (parked in its XREADGROUP)."""
    return any(c.get("name") == name and "b" in c.get("flags", "") for c in await r.client_list())


async def test_an_owners_own_handoff_is_delivered_once_and_left_pending(redis_url: str, cluster: str) -> None:
    """Delivered to the owner's consumer in the hand-off's round trip, with the entries other
    origins appended that the owner had not read yet (in stream order); the owner's read loop,
    parked in its blocked XREADGROUP when the entry lands, is not woken with it; the entries are
    pending for that consumer, delivered once (a crash now leaves them to the next owner's claim).
    A lease value Redis does not hold (we lost the lease) takes nothing: the blocked read gets the
    entry as before. A queue without the group (the owner never read) takes nothing, and the
    hand-off itself still happens."""
    r = aioredis.from_url(redis_url)
    name = f"parked-{uuid.uuid4().hex[:6]}"
    reader = aioredis.from_url(redis_url, client_name=name)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    h = Handoff(st)
    wid = "prefill@127.0.0.1:9"
    q = keys.queue(wid)
    try:
        await h.ensure_group(wid)
        await r.set(keys.owner_lease(wid), "me|3", px=60_000)
        other, _, _ = await h.append(wid, {"rid": "o1", "origin": "x"}, pack_tokens([1, 2]), 1.0, 100)
        res = await st.run_script("handoff", *_own_handoff_cmd(keys, wid, "a1", "me|3"))
        mine = res[0].decode()
        assert int(res[3]) == 1
        assert [(e.decode(), f[b"m"]) for e, f in stream_entries([(b"", res[4])])] == [
            (other, b'{"rid":"o1","origin":"x"}')
        ]
        assert float(res[1]) == 2.0  # the queued ms counted both, as a plain hand-off does

        # the owner's read loop parked in its blocked read, then our next hand-off lands
        blocked = asyncio.create_task(
            reader.xreadgroup(GROUP, "me", {q: ">"}, count=256, block=1500)  # type: ignore[arg-type]
        )
        for _ in range(200):
            if await _parked(r, name):
                break
            await asyncio.sleep(0.01)
        assert await _parked(r, name)
        res2 = await st.run_script("handoff", *_own_handoff_cmd(keys, wid, "a2", "me|3"))
        second = res2[0].decode()
        assert int(res2[3]) == 1 and res2[4] == []
        assert not await blocked, "the blocked read must not deliver what the hand-off took"

        pending = await r.xpending_range(q, GROUP, min="-", max="+", count=10)
        assert [
            (p["message_id"].decode(), p["consumer"].decode(), p["times_delivered"]) for p in pending
        ] == [
            (other, "me", 1),
            (mine, "me", 1),
            (second, "me", 1),
        ]
        assert await r.xlen(q) == 3

        # a stale lease value: nothing taken, the owner's read gets it as before
        res3 = await st.run_script("handoff", *_own_handoff_cmd(keys, wid, "a3", "me|2"))
        assert int(res3[3]) == 0 and res3[4] == []
        got = await reader.xreadgroup(GROUP, "me", {q: ">"}, count=10)  # type: ignore[arg-type]
        assert [e.decode() for e, _ in got[0][1]] == [res3[0].decode()]

        # no group on the queue: the hand-off still happens, nothing is taken, no error
        wid2 = "prefill@127.0.0.1:10"
        await r.set(keys.owner_lease(wid2), "me|3", px=60_000)
        res4 = await st.run_script("handoff", *_own_handoff_cmd(keys, wid2, "a4", "me|3"))
        assert int(res4[3]) == 0 and await r.xlen(keys.queue(wid2)) == 1
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()
        await reader.aclose()


async def test_what_a_handoff_took_reaches_the_owner_when_its_request_is_cancelled(
    redis_url: str, cluster: str
) -> None:
    """The entries a hand-off took for our owner (ours and other origins' it had not read) are
    handed over as the reply arrives, also when the request that sent it was cancelled before then
    (its client gone, its deadline): they are pending for our consumer, and otherwise nothing but
    the periodic re-claim, `reclaim_idle_ms` later, would admit them — the other origins' requests
    would wait that long. Over the lean connection the request path uses."""
    r = aioredis.from_url(redis_url)
    fast = RespConnection.from_url(redis_url)
    assert fast is not None
    keys = Keys(cluster)
    st = StateStore(r, keys, fast=fast)
    await st.load_scripts()
    h = Handoff(st)
    wid = "prefill@127.0.0.1:11"
    try:
        await h.ensure_group(wid)
        await r.set(keys.owner_lease(wid), "me|3", px=60_000)
        other, _, _ = await h.append(wid, {"rid": "o1", "origin": "x"}, pack_tokens([1, 2]), 1.0, 100)
        ks, args = _own_handoff_cmd(keys, wid, "c1", "me|3")
        taken: list[Any] = []
        trip = asyncio.create_task(
            st.execute_scripts([["EVALSHA", st.sha("handoff"), len(ks), *ks, *args]], taken.append)
        )
        await asyncio.sleep(0)  # the round trip is written; its reply cannot have been read yet
        assert not taken
        trip.cancel()
        with pytest.raises(asyncio.CancelledError):
            await trip
        deadline = time.monotonic() + 5
        while not taken and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert len(taken) == 1, "the reply's hand-over was dropped with its cancelled request"
        out = taken[0]
        assert int(out[3]) == 1
        assert [e.decode() for e, _ in stream_entries([(b"", out[4])])] == [other]
        pending = await r.xpending_range(keys.queue(wid), GROUP, min="-", max="+", count=10)
        assert [(x["message_id"].decode(), x["consumer"].decode()) for x in pending] == [
            (other, "me"),
            (out[0].decode(), "me"),
        ]
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()
        await fast.close()


async def test_an_owner_serves_its_own_origin_in_fewer_round_trips(clients, shared_embedded_redis) -> None:
    """A real owner on a real worker, its origin in the same process (as `HandoffStage` drives it):
    each entry the hand-off delivered is admitted once (`take_local`), dispatched once and
    answered in process, never through the reply stream; the stream and the pending list end
    empty and the ledger settled. The owner's Redis cost per request at batch size 1: the commit
    with the `dispatched` mark (one round trip, two commands) and the settlement (one command) —
    was four round trips and five commands (its blocked read, the commit, the mark, the reply
    with the settlement)."""
    p = clients["prefill"][0]
    await p.configure(formula="0")
    epoch = (await p.status())["epoch"]
    keys, wid, r, store, _ = await handoff_rig(shared_embedded_redis, "t-local", p.address)
    lease = Lease(keys.owner_lease(wid), "gw-me", 3000, 1000)
    assert await acquire_leases(r, keys.fence_counter, [lease])
    got: list[dict[str, str]] = []
    names = {store.sha(name): name for name in scripts.ALL}
    trips: list[list[str]] = []  # each round trip the store makes: its commands by script name
    execute = store.execute

    async def counted(cmds: Any) -> list[Any]:
        trips.append([names.get(c[1], c[0]) if c[0] == "EVALSHA" else c[0] for c in cmds])
        return await execute(cmds)

    store.execute = counted  # type: ignore[method-assign]
    own = OwnerDispatcher(
        wid, "gw-me", lease, store, p, shared_embedded_redis, epoch=lambda: epoch, local_reply=got.append
    )
    own.start()
    n = 5
    try:
        await asyncio.wait_for(own._claimed_once.wait(), 15)
        for i in range(n):
            value = own.local_lease()
            assert value == lease.value
            rid = f"loc-{i}-{uuid.uuid4().hex[:6]}"
            await r.hset(keys.request(rid), mapping={"state": "queued", "origin": "gw-me"})
            ks, args = _own_handoff_cmd(keys, wid, rid, value, consumer="gw-me")
            res = await store.run_script("handoff", ks, args)
            assert int(res[3]) == 1 and res[4] == []
            fields = {b"m": args[2].encode(), b"ids": args[3]}
            del trips[:]
            own.take_local([(res[0], fields)])
            deadline = time.monotonic() + 15
            while len(got) <= i and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert len(got) == i + 1 and got[i]["rid"] == rid and got[i]["status"] == "ok", got
            assert trips == [["commit_batch", "transition"], ["settle_ack"]], trips
            rec = await r.hgetall(keys.request(rid))
            assert rec[b"state"] == b"dispatched" and rec[b"prefill_worker"].decode() == wid
        assert own.local_taken == n and own.dispatched == n
        assert await r.xlen(keys.queue(wid)) == 0
        assert (await r.xpending(keys.queue(wid), GROUP))["pending"] == 0
        assert await r.hlen(keys.ledger(wid)) == 0
        assert not await r.exists(keys.replies("gw-me")), "no reply went through the stream"
    finally:
        await own.stop()
        left = await r.keys(f"{keys.prefix}*")
        if left:
            await r.delete(*left)
        await r.aclose()


async def test_the_fresh_pick_delivers_to_the_winners_owner_when_it_is_ours(
    redis_url: str, cluster: str
) -> None:
    """`HANDOFF_PICK` (the default with two or more prefill workers): the caller owns B only. When
    B wins, the entry is delivered to our consumer of B in the round trip; when A wins, nothing is
    taken and A's owner reads it from its queue as before."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    a, b = "prefill@127.0.0.1:1", "prefill@127.0.0.1:2"
    try:
        for w in (a, b):
            await Handoff(st).ensure_group(w)
        await r.set(keys.owner_lease(b), "me|4", px=60_000)
        ks = [keys.queue(a), keys.queued_ms(a), keys.ledger(a), keys.queue(b), keys.queued_ms(b)]
        ks += [keys.ledger(b), keys.request("none"), keys.owner_lease(a), keys.owner_lease(b)]
        for u0_b, winner in (("1000", 2), ("-1000", 1)):
            terms = ["0", "0", "0", u0_b, "0", "0", "1", "0", "0"]
            args = [100, b"ids", '{"w":"a"}', '{"w":"b"}', "1", "1", "1", "1", *terms, 1, b, b""]
            args += ["0", "0", "0", "0", GROUP, "", "", "me", "me|4"]
            res = await st.run_script("handoff_pick", ks, args)
            assert int(res[3]) == winner
            if winner == 2:
                assert len(res) == 10 and int(res[8]) == 1 and res[9] == []
            else:
                assert len(res) == 8
        pend_b = await r.xpending_range(keys.queue(b), GROUP, min="-", max="+", count=10)
        assert [p["consumer"] for p in pend_b] == [b"me"]
        assert (await r.xpending(keys.queue(a), GROUP))["pending"] == 0 and await r.xlen(keys.queue(a)) == 1
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()


def test_a_single_replica_takes_both_in_process_steps_for_every_request(
    workers_reset, shared_embedded_redis, tmp_path
) -> None:
    """Through a real gateway (one replica: origin and owner of every worker): each request's entry
    comes to the owner in the hand-off's round trip and its reply in process, so the counters move
    by one per request each, no reply stream is written, and nothing is left pending."""
    pool = workers_reset
    p, d = pool["prefill"][0], pool["decode"][0]
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, f"prefill@{p.address},decode@{d.address}")
    keys = Keys(cluster)
    wid = f"prefill@{p.address}"

    def counted() -> dict[str, float]:
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        out = {}
        for step in ("entry", "reply"):
            m = re.search(rf'^flexlb_handoff_in_process_total\{{step="{step}"\}} (\S+)$', text, re.M)
            out[step] = float(m.group(1)) if m else 0.0
        return out

    n = 12
    try:
        wait_for(lambda: gw.readyz()["ready"], 60, what="ready")

        def warm() -> bool:  # until the owner's first claim ended, entries go through its read
            body = {"prompt": "warm", "max_new_tokens": 2}
            resp = httpx.post(gw.url + "/v1/generate", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            return counted()["entry"] > 0

        wait_for(warm, 30, what="the first in-process hand-off")
        before = counted()
        for i in range(n):
            body = {"prompt": f"in-process hand-off {i} " * 20, "max_new_tokens": 2}
            resp = httpx.post(gw.url + "/v1/generate", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
        after = counted()
        assert {k: after[k] - before[k] for k in after} == {"entry": n, "reply": n}
        r = redis.Redis.from_url(shared_embedded_redis)
        try:
            assert not r.exists(keys.replies(gw.replica_id)), "no reply went through the stream"
            wait_for(lambda: r.xlen(keys.queue(wid)) == 0, 5, what="queue emptied")
            assert r.xpending(keys.queue(wid), GROUP)["pending"] == 0
        finally:
            r.close()
    finally:
        gw.stop()
