"""The hand-off queue scripts against both Redis flavours. Regression: Redis 6.2 (the embedded
server) crashed on the first version of the hand-off script (a long unpack()ed XADD)."""

from __future__ import annotations

import time

import numpy as np
import redis.asyncio as aioredis

from app.state.handoff import GROUP, OVER_BACKLOG, Handoff, pack_tokens, unpack_tokens
from app.state.keys import Keys
from app.state.store import StateStore


async def test_handoff_take_settle_ack_roundtrip(redis_url: str, cluster: str) -> None:
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    h = Handoff(st)
    wid = "prefill@127.0.0.1:1"
    try:
        await h.ensure_group(wid)
        await h.ensure_group(wid)  # idempotent
        toks = np.arange(4096, dtype=np.int32)
        for i in range(50):
            entry, queued, _owed = await h.append(
                wid, {"rid": f"r{i}", "origin": "o"}, pack_tokens(toks), 2.5, 1000
            )
            assert entry is not None and queued == 2.5 * (i + 1)
        full, queued, _owed = await Handoff(st).append(wid, {"rid": "x"}, b"", 1.0, 50)
        assert full is None and queued == 125.0  # refused at the bound, nothing added
        res = await r.xreadgroup(GROUP, "c1", {keys.queue(wid): ">"}, count=100)
        entries = res[0][1]
        assert len(entries) == 50
        assert np.array_equal(unpack_tokens(entries[0][1][b"ids"]), toks)
        for i, (eid, _f) in enumerate(entries):
            await h.settle_ack(wid, "b", f"r{i}", eid.decode())
        assert await r.xlen(keys.queue(wid)) == 0
        assert (await r.xpending(keys.queue(wid), GROUP))["pending"] == 0
    finally:
        await r.delete(*[k async for k in r.scan_iter(f"{cluster}:*")] or ["_"])
        await r.aclose()


async def test_handoff_reads_the_ledgers_owed_time_in_its_round_trip(redis_url: str, cluster: str) -> None:
    """The origin's view of a worker is fresh as of each hand-off: the script answers the
    ledger's owed ms (a batch not started owes it all; a running one what is left, in modelled
    ms at the worker's time scale), so a batch that left the queue for the ledger since the last
    poll is not lost from the origin's load until the next snapshot."""
    import time

    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    wid = "prefill@127.0.0.1:2"
    try:
        await r.set(keys.owner_lease(wid), "A|1", px=60_000)
        now = time.time() * 1000
        await st.commit_batch(wid, "run", ["a"], 400.0, now - 20.0, 1, "A")  # 20 wall = 200 modelled ms ago
        await st.commit_batch(wid, "next", ["b"], 300.0, now + 60_000.0, 1, "A")  # not started: 300
        entry, queued, owed = await Handoff(st).append(wid, {"rid": "c"}, b"", 5.0, 100, 0.1)
        assert entry is not None and queued == 5.0
        # 200 left of the running one (less what the box took between the calls) + 300 not started
        assert 300.0 <= owed <= 520.0, owed  # (Redis's clock and ours may differ by < 2 ms)
    finally:
        keys_left = await r.keys(f"{cluster}*")
        if keys_left:
            await r.delete(*keys_left)
        await r.aclose()


async def test_a_handoff_queues_only_within_its_max_backlog(redis_url: str, cluster: str) -> None:
    """`max_backlog` (`Verdict.max_backlog_ms`, every SLO admission): the script hands off only
    while the worker's live queued + owed ms are at most it, checked and added in one step, so
    hand-offs from origins whose views lacked each other's fill the worker up to the deadline and
    no further; beyond, nothing is written and the answer is `OVER_BACKLOG` with the live load."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    h = Handoff(st)
    wid = "prefill@127.0.0.1:5"
    try:
        await h.ensure_group(wid)
        # 600 ms each against an allowance of 3000 x 0.85 - 600 = 1950 ms: four fit (0, 600,
        # 1200, 1800 ahead), the fifth (2400 ahead) does not
        got = [await h.append(wid, {"rid": f"s{i}"}, b"", 600.0, 100, 1.0, b"", 1950.0) for i in range(6)]
        assert [e not in (None, OVER_BACKLOG) for e, _, _ in got] == [True] * 4 + [False] * 2
        assert [q for _, q, _ in got] == [600.0, 1200.0, 1800.0, 2400.0, 2400.0, 2400.0]
        assert got[4][0] == OVER_BACKLOG and got[4][2] == 0.0
        assert await r.xlen(keys.queue(wid)) == 4 and float(await r.get(keys.queued_ms(wid))) == 2400.0
        # the bound is inclusive, and exact (not rounded to 6 significant digits): 2400 fits 2400.0
        edge, q, _ = await h.append(wid, {"rid": "edge"}, b"", 0.5, 100, 1.0, b"", 2400.0)
        assert edge not in (None, OVER_BACKLOG) and q == 2400.5
        over, q, _ = await h.append(wid, {"rid": "over"}, b"", 0.5, 100, 1.0, b"", 2400.499999)
        assert over == OVER_BACKLOG and q == 2400.5
        # owed ms of a running batch count as backlog too
        other = "prefill@127.0.0.1:6"
        await r.set(keys.owner_lease(other), "A|1", px=60_000)
        await st.commit_batch(other, "run", ["x"], 2000.0, time.time() * 1000 + 600_000, 1, "A")
        busy, queued, owed = await h.append(other, {"rid": "o"}, b"", 600.0, 100, 1.0, b"", 1950.0)
        assert busy == OVER_BACKLOG and queued == 0.0 and owed == 2000.0
        assert await r.xlen(keys.queue(other)) == 0
    finally:
        await r.delete(*[k async for k in r.scan_iter(f"{cluster}:*")] or ["_"])
        await r.aclose()


async def test_a_require_idle_handoff_queues_only_onto_an_idle_worker(redis_url: str, cluster: str) -> None:
    """`max_backlog` of `IDLE_EPS_MS` (a prompt longer than the cluster SLO, `require_idle`): the script
    hands off only while the worker's live queued + owed ms are within it, and otherwise writes
    nothing and answers `OVER_BACKLOG` with that live backlog, queued and owed (the ledger's)."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    h = Handoff(st)
    wid = "prefill@127.0.0.1:3"
    try:
        await h.ensure_group(wid)
        first, queued, _ = await h.append(wid, {"rid": "long1"}, b"", 7800.0, 100, 1.0, b"", 0.01)
        assert first not in (None, OVER_BACKLOG) and queued == 7800.0
        second, queued, owed = await h.append(wid, {"rid": "long2"}, b"", 7800.0, 100, 1.0, b"", 0.01)
        assert second == OVER_BACKLOG and (queued, owed) == (7800.0, 0.0)
        assert await r.xlen(keys.queue(wid)) == 1 and float(await r.get(keys.queued_ms(wid))) == 7800.0
        # a short request is not asked to find the worker idle
        short, queued, _ = await h.append(wid, {"rid": "short"}, b"", 100.0, 100)
        assert short not in (None, OVER_BACKLOG) and queued == 7900.0
        # the queue drained into a running batch: its owed ms still count as waiting ahead
        other = "prefill@127.0.0.1:4"
        await r.set(keys.owner_lease(other), "A|1", px=60_000)
        await st.commit_batch(other, "run", ["x"], 5000.0, time.time() * 1000, 1, "A")
        busy, queued, owed = await h.append(other, {"rid": "long3"}, b"", 7800.0, 100, 1.0, b"", 0.01)
        assert busy == OVER_BACKLOG and queued == 0.0 and 4000.0 < owed <= 5000.0
        assert await r.xlen(keys.queue(other)) == 0
    finally:
        await r.delete(*[k async for k in r.scan_iter(f"{cluster}:*")] or ["_"])
        await r.aclose()
