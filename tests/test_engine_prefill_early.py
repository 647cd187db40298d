"""`PrefillEngine.advance_early`: a completed batch's results before its cache work, with the same
modelled outcome as `advance_to` (the worker's engine thread routes the results first, then
settles: workers/server/runner.py)."""

from __future__ import annotations

import random
from typing import Any

from app.protocol.blocks import block_keys
from workers.engine.effects import BatchDone, PrefillResult
from workers.engine.faults import Faults
from workers.engine.prefill import PrefillEngine, PrefillRequest
from workers.engine.profiles import formula_profile

B = 16
FORMULA = "5 + sum(0.01*computeTokens) + 2*batchSize"


def make() -> PrefillEngine:
    # Small enough that batches queue for room, evict, and hit each other's prefixes.
    return PrefillEngine(
        formula_profile(FORMULA), block_size=B, kv_capacity_tokens=4_000, kv_handle_ttl_ms=40.0
    )


def state(e: PrefillEngine) -> dict[str, Any]:
    return {
        "lru": list(e.cache._lru.items()),
        "version": e.cache.version,
        "log": list(e.cache._log),
        "held": e._held,
        "handles": {rid: (p.keys, p.outside_tokens, p.expiry_ms) for rid, p in e.handles.pinned.items()},
        "kv": e.kv_view(),
        "live": e.live_view(),
        "seq": e.seq,
        "now": e.now,
    }


def test_advance_early_reaches_advance_to_s_outcome_with_the_results_first() -> None:
    """The same random workload (overlapping prompts, queueing for room, handle releases and
    expiries, cancels, injected engine errors) through two engines, one driven by `advance_to`,
    the other as the worker's engine thread drives it: `advance_early`, then settling by the
    next call. Same effects in the same order (the deferred ones only later), same state after
    every settled step."""
    rng = random.Random(7)
    ref, early = make(), make()
    for e in (ref, early):
        e.configure(0.0, faults=Faults(error_rate=0.1))
    base = [rng.randrange(32, 200) for _ in range(400)]
    got_ref: list[Any] = []
    got_early: list[Any] = []
    now = 0.0
    deferred = 0
    for step in range(300):
        now += rng.choice([0.0, 1.0, 5.0, 20.0])
        roll = rng.random()
        if roll < 0.35:
            reqs = []
            for j in range(rng.randint(1, 4)):
                n = rng.randint(1, 300)
                toks = base[:n] if rng.random() < 0.5 else [rng.randrange(32, 200) for _ in range(n)]
                reqs.append(PrefillRequest(f"r{step}-{j}", n, tuple(block_keys(toks, B))))
            got_ref.extend(ref.submit(f"b{step}", reqs, now).effects)
            got_early.extend(early.submit(f"b{step}", reqs, now).effects)
        elif roll < 0.45 and ref.handles.pinned:
            rid = rng.choice(sorted(ref.handles.pinned))
            got_ref.extend(ref.release(rid, now)[1])
            got_early.extend(early.release(rid, now)[1])
        elif roll < 0.5:
            some = f"b{rng.randrange(step + 1)}"
            got_ref.extend(ref.cancel(some, now)[1])
            got_early.extend(early.cancel(some, now)[1])
        else:
            got_ref.extend(ref.advance_to(now))
            out = early.advance_early(now)
            got_early.extend(out)
            if early.unsettled:
                deferred += 1
                completed = [x for x in out if isinstance(x, BatchDone)]
                assert completed and out[-1] is completed[-1]  # it stopped at the completion
                got_early.extend(early.advance_to(now))  # what the runner does after routing
        assert not early.unsettled
        assert state(early) == state(ref)
        assert got_early == got_ref
    assert deferred >= 10
    assert sum(isinstance(x, PrefillResult) and x.status == "ok" for x in got_ref) > 100


def test_unsettled_work_is_done_by_any_mutator_at_the_completion_s_time() -> None:
    """A release arriving while a completion's work waits finds the KV handle pinned (with the
    expiry the results announced), and a batch submitted then starts at its own time."""
    e = make()
    e.submit("A", [PrefillRequest("a", 320, tuple(block_keys(list(range(32, 352)), B)))], 0.0)
    end_a = e.next_event_time()
    assert end_a is not None
    out = e.advance_early(end_a + 3.0)
    assert [type(x) for x in out] == [PrefillResult, BatchDone] and e.unsettled
    assert "a" not in e.handles and e.kv_view()["kv_pinned_tokens"] == 0  # not done yet
    status, eff = e.release("a", end_a + 3.0)
    assert status == "ok" and not e.unsettled and "a" not in e.handles
    assert [type(x).__name__ for x in eff] == ["KvReleased"]
    e.submit("C", [PrefillRequest("c", 64, tuple(block_keys(list(range(40, 104)), B)))], end_a + 3.0)
    assert e.live_view()[0]["start_ms"] == end_a + 3.0


def test_no_deferral_while_a_batch_waits_for_the_work() -> None:
    """A queued batch may need the room the completion frees: the work is done at once and the
    batch starts at the completion's time, as with `advance_to`."""
    e = make()
    a = [PrefillRequest("a", 320, tuple(block_keys(list(range(32, 352)), B)))]
    b = [PrefillRequest("b", 3_600, tuple(block_keys([(i * 7) % 150 + 32 for i in range(3_600)], B)))]
    e.submit("A", a, 0.0)
    e.submit("B", b, 0.0)  # queued: A's compute and B's do not fit together
    assert [x["phase"] for x in e.live_view()] == ["running", "queued"]
    end_a = e.next_event_time()
    assert end_a is not None
    out = e.advance_early(end_a)
    assert not e.unsettled and "a" in e.handles
    started = [x for x in out if type(x).__name__ == "BatchStarted"]
    assert [(x.batch_id, x.t_ms) for x in started] == [("B", end_a)]


def test_advance_to_never_leaves_work_unsettled() -> None:
    e = make()
    e.submit("A", [PrefillRequest("a", 64, tuple(block_keys(list(range(32, 96)), B)))], 0.0)
    t = e.next_event_time()
    assert t is not None
    out = e.advance_to(t)
    assert any(isinstance(x, PrefillResult) for x in out) and not e.unsettled and "a" in e.handles
