"""The prefill engine core on a virtual clock: exact modelled times, cache, pins, cancel."""

from __future__ import annotations

import pytest

from app.protocol.blocks import block_keys
from app.protocol.codes import EngineStatus
from app.scheduling.formula import BatchItem, compile_formula
from workers.engine.effects import BatchDone, BatchStarted, ExitRequested, KvReleased, PrefillResult
from workers.engine.faults import Faults
from workers.engine.prefill import PrefillEngine, PrefillRequest
from workers.engine.profiles import formula_profile

B = 64
FORMULA = "10 + sum(0.01*computeTokens) + 2*batchSize"


def req(rid: str, tokens: list[int]) -> PrefillRequest:
    return PrefillRequest(rid, len(tokens), tuple(block_keys(tokens, B)))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 200 + 32 for i in range(n)]


def make(**kw) -> PrefillEngine:
    kw.setdefault("kv_capacity_tokens", 100_000)
    return PrefillEngine(formula_profile(FORMULA), block_size=B, **kw)


def run_all(e: PrefillEngine) -> list:
    out = []
    while (t := e.next_event_time()) is not None and t < 1e12:
        if e.kv_view()["kv_pinned_tokens"] and not any(isinstance(x, PrefillResult) for x in out) and t > 1e6:
            break
        out.extend(e.advance_to(t))
        if not e.live_view():
            break
    return out


def results(effects) -> list[PrefillResult]:
    return [x for x in effects if isinstance(x, PrefillResult)]


def test_batch_time_equals_formula_exactly() -> None:
    e = make()
    reqs = [req(f"r{i}", prompt(i, 1000 + 100 * i)) for i in range(4)]
    out = e.submit("b1", reqs, 0.0)
    assert out.accepted and out.queue_position == 0
    started = [x for x in out.effects if isinstance(x, BatchStarted)]
    expected = compile_formula(FORMULA).predict_batch([BatchItem(r.input_tokens, 0) for r in reqs])
    assert started[0].predicted_ms == pytest.approx(expected)
    eff = e.advance_to(expected - 0.001)
    assert not results(eff)
    eff = e.advance_to(expected)
    res = results(eff)
    assert [r.request_id for r in res] == ["r0", "r1", "r2", "r3"]
    assert all(r.status == "ok" and r.start_ms == 0.0 and r.end_ms == pytest.approx(expected) for r in res)
    assert any(isinstance(x, BatchDone) for x in eff)
    assert [r.seq for r in res] == [1, 2, 3, 4]


def test_fifo_one_batch_at_a_time() -> None:
    e = make()
    e.submit("a", [req("a1", prompt(1, 640))], 0.0)
    out = e.submit("b", [req("b1", prompt(2, 640))], 1.0)
    assert out.queue_position == 1
    ta = 10 + 6.4 + 2
    res = results(e.advance_to(100.0))
    assert [(r.request_id, r.start_ms, r.end_ms) for r in res] == [
        ("a1", 0.0, pytest.approx(ta)),
        ("b1", pytest.approx(ta), pytest.approx(2 * ta)),
    ]


def test_max_live_batches_is_the_high_water_mark_of_batches_held_at_once() -> None:
    """Two overlapping batches, both finished, then three at once: the mark is the most held at
    once (running + queued), kept after the work drains; `reset` returns it to 0 (tests share one
    worker)."""
    e = make()
    assert e.max_live_batches == 0
    e.submit("a", [req("a1", prompt(1, 640))], 0.0)
    e.submit("b", [req("b1", prompt(2, 640))], 1.0)
    assert e.max_live_batches == 2
    e.advance_to(1000.0)
    assert e.live_view() == [] and e.max_live_batches == 2
    for i, name in enumerate("cde"):
        e.submit(name, [req(f"{name}1", prompt(3 + i, 640))], 1000.0)
    assert e.max_live_batches == 3
    e.reset(2000.0)
    assert e.max_live_batches == 0


def test_prefix_hit_counts_full_blocks_and_never_whole_prompt() -> None:
    e = make()
    base = prompt(5, 64 * 10)
    e.submit("a", [req("a", base)], 0.0)
    e.advance_to(1000.0)
    # Shares 10 full blocks + its own tail.
    e.submit("b", [req("b", base + prompt(6, 100))], 1000.0)
    res = results(e.advance_to(5000.0))
    assert res[0].cached_tokens == 640
    assert res[0].end_ms - res[0].start_ms == pytest.approx(10 + 0.01 * (740 - 640) + 2)
    # The identical prompt again: all 10 blocks cached, but one block must be recomputed.
    e.submit("c", [req("c", base)], 5000.0)
    res = results(e.advance_to(9000.0))
    assert res[0].cached_tokens == 576


def test_lru_eviction_bounded_by_capacity() -> None:
    e = make(kv_capacity_tokens=64 * 20, kv_handle_ttl_ms=1.0)
    for i in range(5):
        e.submit(f"b{i}", [req(f"r{i}", prompt(100 + i, 64 * 8))], float(i * 1000))
        e.advance_to(i * 1000 + 500.0)
    assert e.cache.used_tokens <= 64 * 20
    # The most recent prompt is still cached, the first one was evicted.
    assert e.cache.match_prefix(block_keys(prompt(104, 64 * 8), B)) == 8
    assert e.cache.match_prefix(block_keys(prompt(100, 64 * 8), B)) == 0
    d = e.cache_diff(0)
    assert not d.full and set(d.added) == set(e.cache.keys())


def test_pinned_kv_blocks_new_work_until_released() -> None:
    e = make(kv_capacity_tokens=1000, kv_handle_ttl_ms=10_000.0)
    e.submit("a", [req("a", prompt(1, 600))], 0.0)
    e.advance_to(100.0)
    assert e.kv_view()["kv_pinned_tokens"] == 600
    out = e.submit("b", [req("b", prompt(2, 600))], 100.0)
    assert out.accepted
    assert not [x for x in out.effects if isinstance(x, BatchStarted)]  # waits for room
    assert e.live_view()[0]["phase"] == "queued"
    status, eff = e.release("a", 200.0)
    assert status == "ok" and any(isinstance(x, KvReleased) for x in eff)
    assert any(isinstance(x, BatchStarted) and x.t_ms == 200.0 for x in eff)
    assert e.release("a", 201.0)[0] == EngineStatus.UNKNOWN


def test_kv_handle_expiry() -> None:
    e = make(kv_handle_ttl_ms=50.0)
    e.submit("a", [req("a", prompt(1, 128))], 0.0)
    eff = e.advance_to(1000.0)
    rel = [x for x in eff if isinstance(x, KvReleased)]
    assert rel and rel[0].reason == "expired"
    r = results(eff)[0]
    assert rel[0].t_ms == pytest.approx(r.kv_expiry_ms)
    assert e.release("a", 1000.0)[0] == EngineStatus.KV_EXPIRED
    assert e.kv_view()["kv_pinned_tokens"] == 0


def test_cancel_before_arrival_queued_running_and_finished() -> None:
    e = make()
    assert e.cancel("late", 0.0)[0] == "tombstoned"
    out = e.submit("b0", [req("late", prompt(1, 100)), req("ok", prompt(2, 100))], 0.0)
    res = results(out.effects)
    assert [(r.request_id, r.status) for r in res] == [("late", "cancelled")]
    # running member
    what, eff = e.cancel("ok", 1.0)
    assert what == "cancelled" and results(eff)[0].status == "cancelled"
    assert any(isinstance(x, BatchDone) for x in eff)  # all members gone: engine moves on
    # queued
    e.submit("b1", [req("x", prompt(3, 100))], 2.0)
    e.submit("b2", [req("y", prompt(4, 100))], 2.0)
    what, eff = e.cancel("b2", 3.0)
    assert what == "cancelled" and [r.request_id for r in results(eff)] == ["y"]
    assert [b["batch_id"] for b in e.live_view()] == ["b1"]
    # a cancelled batch id never runs if it arrives again
    assert e.submit("b2", [req("y", prompt(4, 100))], 4.0).duplicate
    e.advance_to(1000.0)
    assert e.cancel("x", 1000.0)[0] == "released"  # finished: cancel releases its KV
    assert e.kv_view()["kv_pinned_tokens"] == 0
    assert e.cancel("b1", 1001.0)[0] == "finished"


def test_tombstoned_batch_id_refused() -> None:
    e = make()
    e.cancel("bx", 0.0)
    out = e.submit("bx", [req("r", prompt(1, 100))], 1.0)
    assert not out.accepted and out.error == "cancelled"


def test_idempotent_submit_by_batch_id() -> None:
    e = make()
    e.submit("b", [req("r", prompt(1, 100))], 0.0)
    again = e.submit("b", [req("r", prompt(1, 100))], 1.0)
    assert again.duplicate and not results(again.effects)
    assert len(results(e.advance_to(1000.0))) == 1


def test_bad_members_fail_alone() -> None:
    e = make(kv_capacity_tokens=1000)
    out = e.submit(
        "b",
        [
            PrefillRequest("empty", 0, ()),
            req("huge", prompt(1, 2000)),
            PrefillRequest("badkeys", 128, (1,)),
            req("good", prompt(2, 100)),
            req("good", prompt(2, 100)),
        ],
        0.0,
    )
    codes = {(r.request_id, r.status) for r in results(out.effects)}
    assert codes == {
        ("empty", "invalid_request"),
        ("huge", "too_long"),
        ("badkeys", "invalid_request"),
        ("good", "duplicate"),
    }
    assert [r.request_id for r in results(e.advance_to(100.0))] == ["good"]
    assert not e.submit("e", [], 0.0).accepted


def test_faults_error_rate_latency_exit() -> None:
    e = make(seed=3)
    e.configure(0.0, faults=Faults(error_rate=1.0, extra_latency_ms=100.0, exit_after_batches=1))
    e.submit("b", [req("r", prompt(1, 100))], 0.0)
    eff = e.advance_to(200.0)
    r = results(eff)[0]
    assert r.status == "engine_error" and r.end_ms == pytest.approx(10 + 1 + 2 + 100)
    assert any(isinstance(x, ExitRequested) for x in eff)


def test_hang_stops_progress_until_cleared() -> None:
    e = make()
    e.configure(0.0, faults=Faults(hang=True))
    e.submit("b", [req("r", prompt(1, 100))], 0.0)
    assert e.next_event_time() is None
    assert not results(e.advance_to(10_000.0))
    e.configure(10_000.0, faults=Faults())
    assert len(results(e.advance_to(20_000.0))) == 1


def test_history_window_and_resync() -> None:
    e = make(history_limit=10)
    for i in range(25):
        e.submit(f"b{i}", [req(f"r{i}", prompt(i, 64))], float(i * 100))
    e.advance_to(10_000.0)
    resync, recs = e.records_since(0)
    assert resync and [r.seq for r in recs] == list(range(16, 26))
    resync, recs = e.records_since(20)
    assert not resync and [r.seq for r in recs] == [21, 22, 23, 24, 25]


def test_same_seed_same_tokens_different_seed_differs() -> None:
    def first_tokens(seed: int) -> list[int]:
        e = make(seed=seed)
        e.submit("b", [req(f"r{i}", prompt(i, 100)) for i in range(20)], 0.0)
        return [r.first_token for r in results(e.advance_to(1000.0))]

    assert first_tokens(1) == first_tokens(1)
    assert first_tokens(1) != first_tokens(2)
    assert all(32 <= t <= 126 for t in first_tokens(1))
