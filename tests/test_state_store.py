"""StateStore against real Redis: the embedded server and, if FLEXLB_REDIS_URL is set, that one as well.

Each test uses its own key prefix, and only that prefix's keys are deleted afterwards. A shared
server is never flushed.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.scheduling.commit import owed_ms
from app.state.embedded_redis import EmbeddedRedis, start_embedded_redis
from app.state.keys import Keys
from app.state.store import TERMINAL, FencedOut, StateStore

from .conftest import delete_prefix

P = "prefill@127.0.0.1:9001"
D = "decode@127.0.0.1:9101"


@pytest.fixture(scope="session")
def embedded_redis() -> Iterator[EmbeddedRedis]:
    # idle_s is generous: no replica heartbeats during tests, and stop() ends it anyway.
    er = start_embedded_redis(f"flexlb-test-{uuid.uuid4().hex[:8]}", idle_s=300)
    yield er
    er.stop()


@pytest.fixture(params=["embedded", "env"])
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.param == "env":
        url = os.environ.get("FLEXLB_REDIS_URL")
        if not url:
            pytest.skip("FLEXLB_REDIS_URL not set")
        return url
    return request.getfixturevalue("embedded_redis").url


async def _own(store: StateStore, wid: str, holder: str = "A", fence: int = 1) -> None:
    await store.redis.set(store.keys.owner_lease(wid), f"{holder}|{fence}", px=60_000)


# ---- reservations ------------------------------------------------------------------------------


async def test_reserve_release_exactly_once(store: StateStore) -> None:
    assert await store.reserve(D, "r1", 100, 1000)
    assert await store.reserve(D, "r1", 100, 1000)  # idempotent: no double count
    assert await store.reserve(D, "r1", 999, 1000)  # keeps the original amount
    assert await store.reserved_total(D) == 100
    assert await store.reserve(D, "r2", 50, 1000)
    assert await store.reserved_total(D) == 150
    assert await store.release(D, "r1")
    assert not await store.release(D, "r1")
    assert await store.reserved_total(D) == 50
    assert not await store.release(D, "never")
    # Concurrent duplicate releases: exactly one frees the tokens.
    wins = await asyncio.gather(*(store.release(D, "r2") for _ in range(20)))
    assert sum(wins) == 1
    assert await store.reserved_total(D) == 0
    assert not await store.redis.exists(store.keys.reservations(D))  # nothing left behind


async def test_reserve_capacity_refusal(store: StateStore) -> None:
    assert await store.reserve(D, "a", 60, 100)
    assert not await store.reserve(D, "b", 41, 100)
    assert await store.reserve(D, "b", 40, 100)  # exactly at capacity
    assert not await store.reserve(D, "c", 1, 100)
    assert await store.reserved_total(D) == 100
    await store.release(D, "a")
    # Concurrent reserves against the remaining 60: exactly 6 of 10-token holds fit.
    got = await asyncio.gather(*(store.reserve(D, f"x{i}", 10, 100) for i in range(15)))
    assert sum(got) == 6
    assert await store.reserved_total(D) == 100
    with pytest.raises(ValueError):
        await store.reserve(D, "_total", 1, 100)


# ---- prefill ledger ----------------------------------------------------------------------------


async def test_commit_is_fenced(store: StateStore) -> None:
    with pytest.raises(FencedOut):  # no lease at all
        await store.commit_batch(P, "b1", ["r1"], 10.0, 0.0, 1, "A")
    await _own(store, P, "A", 1)
    assert await store.commit_batch(P, "b1", ["r1", "r2"], 10.0, 0.0, 1, "A") == ["r1", "r2"]
    # The lease moves to B with a newer fence: A's commits (new or retried) are refused.
    await _own(store, P, "B", 2)
    with pytest.raises(FencedOut) as ei:
        await store.commit_batch(P, "b2", ["r3"], 10.0, 0.0, 1, "A")
    assert ei.value.current == "B|2"
    with pytest.raises(FencedOut):
        await store.commit_batch(P, "b1", ["r1", "r2"], 10.0, 0.0, 1, "A")
    with pytest.raises(FencedOut):  # right holder, stale fence
        await store.commit_batch(P, "b2", ["r3"], 10.0, 0.0, 1, "B")
    await _own(store, P, "C", 0)  # fence 0: acquisition in progress, nobody acts under it
    with pytest.raises(FencedOut):
        await store.commit_batch(P, "b2", ["r3"], 10.0, 0.0, 0, "C")
    await _own(store, P, "B", 2)
    assert set(await store.read_ledger(P)) == {"b1"}
    # Idempotent by batch id: a retried commit returns the stored members and writes nothing.
    assert await store.commit_batch(P, "b1", ["zz"], 99.0, 0.0, 2, "B") == ["r1", "r2"]
    assert (await store.read_ledger(P))["b1"]["predicted_ms"] == 10.0


async def test_commit_takes_the_batch_off_the_queued_time_once(store: StateStore) -> None:
    """The committed batch's predicted ms leave `queued_ms` in the commit itself: once, never
    below zero, and not for a fenced-out or retried commit."""
    qkey = store.keys.queued_ms(P)
    await store.redis.set(qkey, "50.000000")
    await _own(store, P, "A", 1)
    await store.commit_batch(P, "b1", ["r1"], 20.0, 0.0, 1, "A", take_ms=20.0)
    assert float(await store.redis.get(qkey)) == 30.0
    await store.commit_batch(P, "b1", ["r1"], 20.0, 0.0, 1, "A", take_ms=20.0)  # retried: no take
    assert float(await store.redis.get(qkey)) == 30.0
    with pytest.raises(FencedOut):
        await store.commit_batch(P, "b2", ["r2"], 20.0, 0.0, 7, "A", take_ms=20.0)
    assert float(await store.redis.get(qkey)) == 30.0
    await store.tombstone(P, "r3", 60_000)  # cancelled while queued: it still left the queue
    assert await store.commit_batch(P, "b3", ["r3"], 40.0, 0.0, 1, "A", take_ms=40.0) == []
    assert float(await store.redis.get(qkey)) == 0.0


async def test_commit_honours_tombstones(store: StateStore) -> None:
    await _own(store, P)
    await store.tombstone(P, "r2", 60_000)
    assert await store.commit_batch(P, "b1", ["r1", "r2", "r3", "r1"], 5.0, 0.0, 1, "A") == ["r1", "r3"]
    assert (await store.read_ledger(P))["b1"]["members"] == ["r1", "r3"]
    # Every member tombstoned: nothing committed.
    assert await store.commit_batch(P, "b2", ["r2"], 5.0, 0.0, 1, "A") == []
    # A tombstoned batch id drops the whole batch.
    await store.tombstone(P, "b3", 60_000)
    assert await store.commit_batch(P, "b3", ["r4"], 5.0, 0.0, 1, "A") == []
    assert set(await store.read_ledger(P)) == {"b1"}
    # Tombstones expire (server clock).
    await store.tombstone(P, "r5", 30)
    await asyncio.sleep(0.1)
    assert await store.commit_batch(P, "b4", ["r5"], 5.0, 0.0, 1, "A") == ["r5"]


async def test_settle_exactly_once(store: StateStore) -> None:
    await _own(store, P)
    await store.commit_batch(P, "b1", ["r1", "r2"], 5.0, 0.0, 1, "A")
    assert await store.settle(P, "b1", "r1")
    assert not await store.settle(P, "b1", "r1")
    assert not await store.settle(P, "b1", "nope")
    assert not await store.settle(P, "nob", "r2")
    assert (await store.read_ledger(P))["b1"]["members"] == ["r2"]
    wins = await asyncio.gather(*(store.settle(P, "b1", "r2") for _ in range(10)))
    assert sum(wins) == 1
    assert await store.read_ledger(P) == {}  # entry gone when empty
    # A late duplicate commit of the finished batch is dropped (its id is tombstoned).
    assert await store.commit_batch(P, "b1", ["r1", "r2"], 5.0, 0.0, 1, "A") == []
    assert await store.read_ledger(P) == {}
    # settle_batch: all at once, exactly once.
    await store.commit_batch(P, "b2", ["r3", "r4", "r5"], 5.0, 0.0, 1, "A")
    assert await store.settle(P, "b2", "r3")
    assert await store.settle_batch(P, "b2") == 2
    assert await store.settle_batch(P, "b2") == 0
    assert not await store.settle(P, "b2", "r4")
    assert await store.read_ledger(P) == {}


async def _owed(store: StateStore, now: float) -> float:
    """The owed time the owner's poller publishes: `commit.owed_ms` over the ledger."""
    ledger = (await store.read_ledger(P)).values()
    return owed_ms(((float(b["predicted_ms"]), float(b["start_ms"])) for b in ledger), now)


async def test_owed_ms_arithmetic(store: StateStore) -> None:
    await _own(store, P)
    now = 1_700_000_000_000.0
    assert await _owed(store, now) == 0.0
    await store.commit_batch(P, "run", ["a", "b"], 100.0, now - 30.0, 1, "A")  # running: 70 left
    await store.commit_batch(P, "done", ["c"], 100.0, now - 250.0, 1, "A")  # overdue: 0
    await store.commit_batch(P, "next", ["d"], 40.0, now + 70.0, 1, "A")  # not started: all 40
    assert await _owed(store, now) == pytest.approx(110.0)
    assert await _owed(store, now + 50.0) == pytest.approx(20.0 + 40.0)
    assert await _owed(store, now + 90.0) == pytest.approx(0.0 + 20.0)
    # Whole batch until its last member settles (one forward pass), then nothing.
    await store.settle(P, "run", "a")
    assert await _owed(store, now) == pytest.approx(110.0)
    await store.settle(P, "run", "b")
    assert await _owed(store, now) == pytest.approx(40.0)
    # Precision survives the re-encode on settle (start anchors are ~1e12 ms).
    await store.commit_batch(P, "p", ["x", "y"], 12.5, now + 0.25, 1, "A")
    await store.settle(P, "p", "x")
    assert await _owed(store, now + 10.25) == pytest.approx(40.0 + 2.5, abs=0.01)


# ---- snapshots ---------------------------------------------------------------------------------


async def test_snapshot_only_newer_wins(store: StateStore) -> None:
    assert await store.read_snapshot(P) == {}
    assert await store.write_snapshot(P, "e1", 5, {"queue_len": 3, "health": "up"})
    assert not await store.write_snapshot(P, "e1", 5, {"queue_len": 9})  # same seq
    assert not await store.write_snapshot(P, "e1", 4, {"queue_len": 9})  # older
    assert await store.write_snapshot(P, "e1", 6, {"queue_len": 1})  # newer, merged
    assert await store.read_snapshot(P) == {"epoch": "e1", "seq": "6", "queue_len": "1", "health": "up"}
    # The worker restarted: a new epoch wins even with a lower seq and replaces the whole view.
    assert await store.write_snapshot(P, "e2", 0, {"queue_len": 0})
    assert await store.read_snapshot(P) == {"epoch": "e2", "seq": "0", "queue_len": "0"}
    # A straggler from the retired epoch never wins again.
    assert not await store.write_snapshot(P, "e1", 1000, {"queue_len": 9})
    assert (await store.read_snapshot(P))["epoch"] == "e2"
    # Concurrent writers: the highest seq ends up stored.
    await asyncio.gather(*(store.write_snapshot(P, "e2", i, {"i": i}) for i in range(1, 30)))
    snap = await store.read_snapshot(P)
    assert snap["seq"] == "29" and snap["i"] == "29"
    with pytest.raises(ValueError):
        await store.write_snapshot(P, "e2", 99, {"seq": 1})
    # Owner-derived fields merge without touching epoch/seq; the worker's next report still wins.
    await store.update_snapshot_fields(P, {"health": "down"})
    assert (await store.read_snapshot(P))["health"] == "down"
    assert await store.write_snapshot(P, "e2", 30, {"health": "up"})
    snap = await store.read_snapshot(P)
    assert (snap["epoch"], snap["seq"], snap["health"]) == ("e2", "30", "up")


# ---- lifecycle ---------------------------------------------------------------------------------


async def test_lifecycle_reducer(store: StateStore) -> None:
    assert not await store.transition("q1", "dispatched")  # missing
    assert await store.create_request("q1", "rep-A", {"prompt_tokens": 12})
    assert not await store.create_request("q1", "rep-B")
    rec = await store.get_request("q1")
    assert rec is not None and rec["state"] == "queued" and rec["origin"] == "rep-A"
    assert rec["prompt_tokens"] == "12"
    assert await store.redis.ttl(store.keys.request("q1")) == -1  # no TTL while live
    assert await store.transition("q1", "dispatched", {"prefill_worker": P, "batch_id": "b1"})
    assert not await store.transition("q1", "dispatched")  # not forward
    assert not await store.transition("q1", "queued")  # backwards
    assert await store.transition("q1", "decoding")  # skipping prefilled is fine
    assert not await store.transition("q1", "prefilled")
    assert await store.transition("q1", "completed", {"tokens_out": 7}, outcome={"finish": "stop"})
    assert not await store.transition("q1", "failed")
    assert not await store.transition("q1", "completed")
    assert not await store.transition("q1", "decoding")
    rec = await store.get_request("q1")
    assert rec is not None
    assert rec["state"] == "completed" and rec["tokens_out"] == "7" and rec["prefill_worker"] == P
    assert rec["outcome"] == {"state": "completed", "finish": "stop"}
    assert 0 < await store.redis.ttl(store.keys.request("q1")) <= 120
    assert await store.get_request("nope") is None
    with pytest.raises(ValueError):
        await store.transition("q1", "bogus")


async def test_concurrent_terminal_transitions(store: StateStore) -> None:
    assert await store.create_request("q2", "rep-A")
    await store.transition("q2", "dispatched")
    terminals = sorted(TERMINAL)
    attempts = [(terminals[i % len(terminals)], i) for i in range(20)]
    results = await asyncio.gather(*(store.transition("q2", s, outcome={"by": i}) for s, i in attempts))
    assert sum(results) == 1
    (winner_state, winner_i) = next(a for a, ok in zip(attempts, results, strict=True) if ok)
    rec = await store.get_request("q2")
    assert rec is not None and rec["state"] == winner_state
    assert rec["outcome"] == {"state": winner_state, "by": winner_i}


# ---- cluster epoch -----------------------------------------------------------------------------


async def test_cluster_epoch_detects_empty_redis(store: StateStore) -> None:
    epoch, created = await store.ensure_cluster_epoch()
    assert created
    assert await store.ensure_cluster_epoch() == (epoch, False)
    await store.reserve(D, "r1", 1, 10)
    # "Redis came back empty" for this cluster: delete only this prefix's keys.
    await delete_prefix(store.redis, store.keys.prefix)
    epoch2, created2 = await store.ensure_cluster_epoch()
    assert created2 and epoch2 != epoch
    assert await store.reserved_total(D) == 0


async def test_commands_counted_one_per_call(store: StateStore) -> None:
    await _own(store, P)
    await store.load_scripts()  # so no NOSCRIPT reload muddies the count
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: store.ensure_cluster_epoch(),
        lambda: store.reserve(D, "r", 1, 10),
        lambda: store.reserved_total(D),
        lambda: store.release(D, "r"),
        lambda: store.commit_batch(P, "b", ["r"], 1.0, 0.0, 1, "A"),
        lambda: store.settle(P, "b", "r"),
        lambda: store.settle_batch(P, "b"),
        lambda: store.tombstone(P, "t", 100),
        lambda: store.write_snapshot(P, "e", 1, {}),
        lambda: store.read_snapshot(P),
        lambda: store.create_request("q", "o"),
        lambda: store.transition("q", "failed"),
        lambda: store.get_request("q"),
    ]
    before = store.commands_total
    for i, call in enumerate(calls, 1):
        await call()
        assert store.commands_total == before + i


# ---- property: reservations + ledger vs a Python model ----------------------------------------

RIDS = ["r1", "r2", "r3", "r4"]
BIDS = ["b1", "b2", "b3"]
CAP = 100

op_st = st.one_of(
    st.tuples(st.just("reserve"), st.sampled_from(RIDS), st.integers(0, 60)),
    st.tuples(st.just("release"), st.sampled_from(RIDS)),
    st.tuples(
        st.just("commit"), st.sampled_from(BIDS), st.lists(st.sampled_from(RIDS), min_size=1, max_size=4)
    ),
    st.tuples(st.just("settle"), st.sampled_from(BIDS), st.sampled_from(RIDS)),
    st.tuples(st.just("settle_batch"), st.sampled_from(BIDS)),
    st.tuples(st.just("tombstone"), st.sampled_from(RIDS + BIDS)),
)


class Model:
    def __init__(self) -> None:
        self.resv: dict[str, int] = {}
        self.ledger: dict[str, list[str]] = {}
        self.tomb: set[str] = set()

    def apply(self, op: tuple) -> object:
        kind = op[0]
        if kind == "reserve":
            _, rid, t = op
            if rid in self.resv:
                return True
            if sum(self.resv.values()) + t > CAP:
                return False
            self.resv[rid] = t
            return True
        if kind == "release":
            return self.resv.pop(op[1], None) is not None
        if kind == "commit":
            _, bid, members = op
            if bid in self.ledger:
                return self.ledger[bid]
            if bid in self.tomb:
                return []
            kept = [m for m in dict.fromkeys(members) if m not in self.tomb]
            if kept:
                self.ledger[bid] = kept
            return kept
        if kind == "settle":
            _, bid, rid = op
            if rid not in self.ledger.get(bid, []):
                return False
            self.ledger[bid].remove(rid)
            if not self.ledger[bid]:
                del self.ledger[bid]
                self.tomb.add(bid)
            return True
        if kind == "settle_batch":
            n = len(self.ledger.pop(op[1], []))
            if n:
                self.tomb.add(op[1])
            return n
        if kind == "tombstone":
            self.tomb.add(op[1])
            return None
        raise AssertionError(kind)


async def _apply(store: StateStore, wid_d: str, wid_p: str, op: tuple) -> object:
    kind = op[0]
    if kind == "reserve":
        return await store.reserve(wid_d, op[1], op[2], CAP)
    if kind == "release":
        return await store.release(wid_d, op[1])
    if kind == "commit":
        return await store.commit_batch(wid_p, op[1], op[2], 10.0, 0.0, 1, "A")
    if kind == "settle":
        return await store.settle(wid_p, op[1], op[2])
    if kind == "settle_batch":
        return await store.settle_batch(wid_p, op[1])
    if kind == "tombstone":
        return await store.tombstone(wid_p, op[1], 600_000)
    raise AssertionError(kind)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(op_st, min_size=1, max_size=40))
async def test_property_matches_model(store: StateStore, ops: list[tuple]) -> None:
    # Fresh worker ids per example: the fixture (and its prefix) is shared by all examples.
    tag = uuid.uuid4().hex[:8]
    wid_d, wid_p = f"decode@{tag}:1", f"prefill@{tag}:1"
    await _own(store, wid_p)
    model = Model()
    for op in ops:
        got = await _apply(store, wid_d, wid_p, op)
        want = model.apply(op)
        assert got == want, (op, got, want)
        total = await store.reserved_total(wid_d)
        assert total == sum(model.resv.values()) >= 0
    ledger = await store.read_ledger(wid_p)
    assert {b: e["members"] for b, e in ledger.items()} == model.ledger
    # Concurrent duplicates of the final state's releases: each held id frees exactly once.
    held = list(model.resv)
    res = await asyncio.gather(*(store.release(wid_d, r) for r in held for _ in range(3)))
    assert sum(res) == len(held)
    assert await store.reserved_total(wid_d) == 0


async def test_anchor_batch_moves_only_the_start(store: StateStore) -> None:
    """The owner moves a queued batch's anchor to the engine's real start; members and the
    prediction stay byte for byte, and a settled batch is left alone."""
    await _own(store, P)
    now = 1_700_000_000_000.0
    from app.scheduling.commit import owed_ms

    async def owed(at: float) -> float:
        ledger = await store.read_ledger(P)
        return owed_ms(((b["predicted_ms"], b["start_ms"]) for b in ledger.values()), at)

    await store.commit_batch(P, "q", ["a", "b"], 40.0, now + 1000.0, 1, "A")
    assert await owed(now + 10.0) == pytest.approx(40.0)  # not started: owes it all
    assert await store.anchor_batch(P, "q", now)
    assert await owed(now + 10.0) == pytest.approx(30.0)
    entry = (await store.read_ledger(P))["q"]
    assert entry["members"] == ["a", "b"] and entry["predicted_ms"] == 40.0 and entry["start_ms"] == now
    await store.settle(P, "q", "a")
    await store.settle(P, "q", "b")
    assert not await store.anchor_batch(P, "q", now)
    assert await store.read_ledger(P) == {}


async def test_a_flushed_script_is_loaded_and_only_its_call_rerun(embedded_redis: EmbeddedRedis) -> None:
    """After SCRIPT FLUSH (a restarted, empty server) every EVALSHA answers NOSCRIPT: the store
    loads the script and reruns just the calls that never ran, not the rest of the round trip.
    (On the embedded server only: flushing the shared one would disturb other test runs.)"""
    r = aioredis.from_url(embedded_redis.url)
    store = StateStore(r, Keys(f"t-{uuid.uuid4().hex[:8]}"))
    try:
        await store.redis.script_flush()
        before = store.commands_total
        assert await store.reserve(D, "r1", 10, 100)  # NOSCRIPT, then SCRIPT LOAD + EVALSHA
        assert store.commands_total == before + 3
        assert await store.reserved_total(D) == 10
        await store.redis.script_flush()
        marker = store.keys.prefix + ":marker"
        cmds = [["INCR", marker], ["EVALSHA", store.sha("release"), 1, store.keys.reservations(D), "r1"]]
        incr, released = await store.execute_scripts(cmds)
        assert (incr, int(released)) == (1, 1)
        assert int(await r.get(marker)) == 1  # the INCR ran once, not again with the retry
        assert await store.reserved_total(D) == 0
    finally:
        await delete_prefix(r, store.keys.prefix)
        await r.aclose()
