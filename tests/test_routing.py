"""Tests for the routing policies (app/scheduling/routing.py, policy.py and plugins/).

All pure: no Redis, no workers, no clock. Numbers in the cost tests are worked out by hand from the
linear formula ``10 + 0.1*computeTokens`` so a reader can check each expectation.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, compile_formula
from app.scheduling.policy import Policy, PolicyBook, make_decode_policy, make_prefill_policy
from app.scheduling.routing import (
    Choice,
    DecodeQuery,
    NoWorker,
    PrefillQuery,
    WorkerView,
    eligible_prefill,
    top_candidates,
)

PREFILL_STRATEGIES = PolicyBook().names("prefill")
DECODE_STRATEGIES = PolicyBook().names("decode")


def cost_policy(formula: object, **kw: object) -> Policy:
    return make_prefill_policy("cost", formula=formula, **kw)


def prefix_policy(formula: object = None, **kw: object) -> Policy:
    return make_prefill_policy("prefix", formula=formula, **kw)


def kv_policy(**kw: object) -> Policy:
    return make_decode_policy("kv_headroom", **kw)


# predict_ms(L, h) = 10 + 0.1 * (L - h)
LINEAR = compile_formula("10 + 0.1*computeTokens")
BLOCK = 256


def pw(wid: str, **kw: object) -> WorkerView:
    """A prefill worker with plenty of free KV unless the test says otherwise."""
    fields: dict[str, object] = {"kv_total_tokens": 100_000, "kv_free_tokens": 100_000}
    fields.update(kw)
    return WorkerView(wid, "prefill", **fields)  # type: ignore[arg-type]


def dw(wid: str, **kw: object) -> WorkerView:
    fields: dict[str, object] = {"kv_total_tokens": 100_000, "kv_free_tokens": 100_000}
    fields.update(kw)
    return WorkerView(wid, "decode", **fields)  # type: ignore[arg-type]


def pq(size: int, hits: dict[str, int] | None = None, block: int = BLOCK) -> PrefillQuery:
    return PrefillQuery(size, hits or {}, block)


def rng(seed: int = 0) -> random.Random:
    return random.Random(seed)


def picks(strategy: object, q: object, workers: Sequence[WorkerView], seed: int, n: int) -> list[str]:
    r = random.Random(seed)
    return [strategy.choose(q, workers, r).worker_id for _ in range(n)]  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------
# cost


def test_cost_prefers_the_cache_holder_while_it_finishes_sooner() -> None:
    # L = 2000, A holds 6 blocks = 1536 tokens: A's prefill = 10 + 0.1*464 = 56.4 ms, cold = 210 ms,
    # so the prefix saves 153.6 ms, counted CACHE_VALUE = 2 more times for the follow-ups.
    # Finish times within the 1 s budget cost LATENCY_BELOW_BUDGET = 1/4 of their ms.
    # A owes 100 ms: cost(A) = 0.25 * 156.4 - 307.2, cost(B) = 0.25 * 210.
    q = pq(2000, {"A": 6})
    workers = [pw("A", owed_ms=100.0), pw("B")]
    choice = cost_policy(LINEAR).choose(q, workers, rng())
    assert choice.worker_id == "A"
    assert choice.hit_tokens == 1536
    assert choice.predicted_ms == pytest.approx(56.4)
    assert choice.score == pytest.approx(0.25 * 156.4 - 2 * 153.6)
    assert choice.reason == "cost"


def test_cost_keeps_the_prefix_against_a_backlog_within_the_latency_budget() -> None:
    # A owes 400 ms and has 150 ms queued: it would finish at 606.4 ms, within the 1 s budget, so
    # its backlog costs 1/4: cost(A) = 0.25 * 606.4 - 307.2 < cost(B) = 0.25 * 210. At full price
    # (the previous `cost`) A's 299.2 lost to B's 210: the holder gave its prefix away for a
    # latency the SLO does not count, and the cluster paid the cold prefill.
    q = pq(2000, {"A": 6})
    workers = [pw("A", owed_ms=400.0, queued_ms=150.0), pw("B")]
    choice = cost_policy(LINEAR).choose(q, workers, rng())
    assert choice.worker_id == "A"
    assert choice.score == pytest.approx(0.25 * 606.4 - 2 * 153.6)


def test_cost_leaves_a_busy_cache_holder_past_the_latency_budget() -> None:
    # A owes 1,200 ms and has 150 ms queued: it would finish at 1,406.4 ms, 406.4 past the budget:
    # cost(A) = 0.25 * 1406.4 + 0.75 * 406.4 - 307.2 = 349.2 > cost(B) = 0.25 * 210 = 52.5 (+ the
    # 5.25 band): past the budget a backlog costs full price and the idle worker wins.
    q = pq(2000, {"A": 6})
    workers = [pw("A", owed_ms=1200.0, queued_ms=150.0), pw("B")]
    choice = cost_policy(LINEAR).choose(q, workers, rng())
    assert choice.worker_id == "B"
    assert choice.hit_tokens == 0
    assert choice.predicted_ms == pytest.approx(210.0)
    assert choice.score == pytest.approx(52.5)


def test_cost_near_tie_between_holder_and_idle_worker() -> None:
    # A owes 1,056 ms: it finishes at 1,112.4, cost(A) = 1112.4 - 750 - 307.2 = 55.2, cost(B) = 52.5,
    # within max(0.1 * 52.5, 20 * 0.25) = 5.25 (the band is in utility: 20 ms of finish time below
    # the budget) -> both are candidates, and within the band the cache holder keeps the prompt.
    q = pq(2000, {"A": 6})
    workers = [pw("A", owed_ms=1056.0), pw("B")]
    assert set(picks(cost_policy(LINEAR), q, workers, seed=1, n=200)) == {"A"}
    # With ties switched off the strict minimum wins every time.
    strict = cost_policy(LINEAR, tie_pct=0.0, tie_abs=0.0)
    assert set(picks(strict, q, workers, seed=1, n=50)) == {"B"}
    # Equal hits (none here) within the band: drawn at random.
    cold = [pw("A", owed_ms=5.0), pw("B")]
    assert set(picks(cost_policy(LINEAR), pq(2000, {}), cold, seed=1, n=200)) == {"A", "B"}


def test_cost_full_hit_is_capped_to_full_blocks_before_the_last_token() -> None:
    # A 1024-token prompt fully cached (4 blocks of 256) still computes its last block: hit = 3 blocks.
    q = pq(1024, {"A": 4})
    choice = cost_policy(LINEAR).choose(q, [pw("A")], rng())
    assert choice.hit_tokens == 768
    assert choice.predicted_ms == pytest.approx(10 + 0.1 * 256)
    # A mirror claiming more blocks than the prompt has is capped the same way.
    assert cost_policy(LINEAR).choose(pq(1024, {"A": 99}), [pw("A")], rng()).hit_tokens == 768
    # One token past the block boundary: all 4 full blocks count.
    assert cost_policy(LINEAR).choose(pq(1025, {"A": 4}), [pw("A")], rng()).hit_tokens == 1024
    # A prompt shorter than one block can never hit.
    assert cost_policy(LINEAR).choose(pq(200, {"A": 1}), [pw("A")], rng()).hit_tokens == 0


def test_cost_partial_blocks_never_count() -> None:
    # The mirror reports blocks, so a hit is always a multiple of the block size.
    choice = cost_policy(LINEAR).choose(pq(5000, {"A": 3}, block=64), [pw("A")], rng())
    assert choice.hit_tokens == 192


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"up": False}, "no live prefill worker"),
        ({"draining": True}, "no live prefill worker"),
        ({"kv_total_tokens": 1999}, "no worker can hold 2000 tokens"),
        ({"kv_free_tokens": 1000, "kv_evictable_tokens": 999}, "no worker can hold 2000 tokens"),
        ({"queue_len": 5}, "every prefill worker that fits is a hotspot (queue_len > 4)"),
    ],
)
def test_cost_hard_filters(bad: dict[str, object], reason: str) -> None:
    strategy = cost_policy(LINEAR, hotspot_queue_len=4)
    q = pq(2000)
    # The filtered worker would be far cheaper (idle) than the one left: only the filter keeps it out.
    ok = pw("ok", owed_ms=10_000.0, queue_len=4)
    assert strategy.choose(q, [pw("bad", **bad), ok], rng()).worker_id == "ok"
    with pytest.raises(NoWorker) as err:
        strategy.choose(q, [pw("bad", **bad)], rng())
    assert err.value.reason == reason
    assert str(err.value) == reason


def test_kv_filter_counts_the_cached_prefix() -> None:
    # 2000 tokens, 1536 cached: only 464 must be computed, and 500 free tokens suffice for that.
    tight = pw("A", kv_free_tokens=300, kv_evictable_tokens=200)
    assert cost_policy(LINEAR).choose(pq(2000, {"A": 6}), [tight], rng()).worker_id == "A"
    with pytest.raises(NoWorker, match="no worker can hold 2000 tokens"):
        cost_policy(LINEAR).choose(pq(2000), [tight], rng())


def test_filters_ignore_workers_of_the_other_role() -> None:
    with pytest.raises(NoWorker, match="no live prefill worker"):
        cost_policy(LINEAR).choose(pq(100), [dw("d")], rng())
    with pytest.raises(NoWorker, match="no live decode worker"):
        make_decode_policy("kv_headroom").choose(DecodeQuery(10, 10), [pw("p")], rng())


def test_near_tie_randomises_reproducibly_and_ignores_snapshot_order() -> None:
    workers = [pw("A", owed_ms=50.0), pw("B", owed_ms=50.0)]
    q = pq(1000)
    first = picks(cost_policy(LINEAR), q, workers, seed=7, n=200)
    assert set(first) == {"A", "B"}
    assert min(Counter(first).values()) > 60  # roughly even, not merely both present
    assert picks(cost_policy(LINEAR), q, workers, seed=7, n=200) == first
    assert picks(cost_policy(LINEAR), q, workers[::-1], seed=7, n=200) == first
    assert picks(cost_policy(LINEAR), q, workers, seed=8, n=200) != first


def test_unique_winner_consumes_no_randomness() -> None:
    r = random.Random(3)
    before = r.getstate()
    cost_policy(LINEAR).choose(pq(2000, {"A": 6}), [pw("A"), pw("B")], r)
    assert r.getstate() == before


def test_strategy_constructors_validate() -> None:
    with pytest.raises(TypeError):
        cost_policy("10 + inputTokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cost_policy(LINEAR, tie_pct=-0.1)
    with pytest.raises(ValueError):
        cost_policy(LINEAR, hotspot_queue_len=-1)
    with pytest.raises(ValueError):
        prefix_policy(balance_rel=0.5)
    with pytest.raises(ValueError):
        kv_policy(tie_pct=1.0)
    with pytest.raises(ValueError):
        PrefillQuery(10, {}, 0)
    with pytest.raises(ValueError):
        DecodeQuery(10, -1)


# --------------------------------------------------------------------------------------------------
# least_load, round_robin, random (prefill)


def test_prefill_least_load_ignores_the_cache() -> None:
    q = pq(2000, {"A": 6})
    workers = [pw("A", owed_ms=30.0), pw("B", queued_ms=20.0), pw("C", owed_ms=10.0, queued_ms=15.0)]
    choice = make_prefill_policy("least_load", formula=LINEAR).choose(q, workers, rng())
    assert choice.worker_id == "B"
    assert choice.score == 20.0
    assert choice.predicted_ms == pytest.approx(210.0)
    # Exact ties are spread.
    even = [pw("A"), pw("B"), pw("C", owed_ms=1.0)]
    assert set(picks(make_prefill_policy("least_load"), q, even, seed=0, n=100)) == {"A", "B"}


def test_round_robin_cycles_by_id_and_survives_membership_changes() -> None:
    rr = make_prefill_policy("round_robin")
    workers = [pw("c"), pw("a"), pw("b")]
    q = pq(100)
    assert picks(rr, q, workers, seed=0, n=7) == ["a", "b", "c", "a", "b", "c", "a"]
    # "b" goes down after "a": the cycle continues with "c", then wraps.
    assert picks(rr, q, [pw("a"), pw("b", up=False), pw("c")], seed=0, n=3) == ["c", "a", "c"]
    # A newcomer slots into the cycle at its id, nobody is skipped or repeated.
    grown = [pw("a"), pw("b"), pw("c"), pw("bb")]
    assert picks(rr, q, grown, seed=0, n=5) == ["a", "b", "bb", "c", "a"]


def test_decode_round_robin_cycles_over_workers_with_room() -> None:
    rr = make_decode_policy("round_robin")
    workers = [dw("y"), dw("x"), dw("full", kv_free_tokens=10), dw("z")]
    assert picks(rr, DecodeQuery(50, 50), workers, seed=0, n=4) == ["x", "y", "z", "x"]


def test_random_draws_only_eligible_workers() -> None:
    workers = [pw("a"), pw("b"), pw("down", up=False), pw("c"), pw("small", kv_total_tokens=10)]
    seen = set(picks(make_prefill_policy("random"), pq(100), workers, seed=2, n=200))
    assert seen == {"a", "b", "c"}
    dworkers = [dw("a"), dw("b"), dw("full", reserved_tokens=99_950)]
    seen = set(picks(make_decode_policy("random"), DecodeQuery(50, 50), dworkers, seed=2, n=200))
    assert seen == {"a", "b"}


# --------------------------------------------------------------------------------------------------
# prefix


def make_prefix() -> Policy:
    return prefix_policy(LINEAR)


@pytest.mark.parametrize(
    ("holder_load", "other_load", "expected", "reason"),
    [
        (150.0, 0.0, "H", "prefix"),  # 150 over the idlest: within the 200 ms absolute allowance
        (300.0, 0.0, "O", "load_guard"),  # 300 over, and 300 > 1.5 * 0
        (1000.0, 900.0, "H", "prefix"),  # only 100 over
        (2000.0, 1500.0, "H", "prefix"),  # 500 over but only 1.33x
        (2500.0, 1500.0, "O", "load_guard"),  # 1000 over and 1.67x
    ],
)
def test_prefix_load_guard(holder_load: float, other_load: float, expected: str, reason: str) -> None:
    q = pq(4000, {"H": 10})
    workers = [pw("H", owed_ms=holder_load), pw("O", queued_ms=other_load), pw("P", owed_ms=other_load + 1)]
    choice = make_prefix().choose(q, workers, rng())
    assert (choice.worker_id, choice.reason) == (expected, reason)
    if expected == "H":
        assert choice.hit_tokens == 2560


def test_prefix_prefers_the_longest_hit_then_the_least_loaded_holder() -> None:
    q = pq(4000, {"short": 2, "long1": 8, "long2": 8})
    workers = [pw("short"), pw("long1", owed_ms=50.0), pw("long2", owed_ms=20.0), pw("none")]
    choice = make_prefix().choose(q, workers, rng())
    assert (choice.worker_id, choice.hit_tokens, choice.reason) == ("long2", 2048, "prefix")


def test_prefix_without_hits_falls_back_to_least_load() -> None:
    workers = [pw("A", owed_ms=5.0), pw("B")]
    choice = make_prefix().choose(pq(4000, {"A": 0}), workers, rng())
    assert (choice.worker_id, choice.reason) == ("B", "no_hit")


# --------------------------------------------------------------------------------------------------
# decode


def test_kv_headroom_picks_the_most_unreserved_kv() -> None:
    workers = [  # all 100k total
        dw("A", kv_free_tokens=50_000),  # headroom 50k (something else holds KV)
        dw("B", kv_free_tokens=80_000, reserved_tokens=40_000),  # min(80k, 100k - 40k) = 60k
        dw("C", kv_free_tokens=70_000, reserved_tokens=1_000),  # min(70k, 99k) = 70k
    ]
    choice = make_decode_policy("kv_headroom").choose(DecodeQuery(1000, 500), workers, rng())
    assert (choice.worker_id, choice.score, choice.reason) == ("C", 70_000.0, "kv_headroom")


def test_kv_headroom_does_not_count_a_running_sequence_twice() -> None:
    """40k tokens of running sequences are both allocated on the worker (free 60k) and still
    reserved until their streams end: the headroom is 60k, not 60k − 40k."""
    busy = dw("A", kv_free_tokens=60_000, reserved_tokens=40_000)
    choice = make_decode_policy("kv_headroom").choose(DecodeQuery(40_000, 15_000), [busy], rng())
    assert (choice.worker_id, choice.score) == ("A", 60_000.0)


def test_kv_headroom_fit_and_no_worker() -> None:
    q = DecodeQuery(1000, 500)
    fits_exactly = dw("A", kv_total_tokens=2000, kv_free_tokens=2000, reserved_tokens=500)  # 1500 = need
    assert make_decode_policy("kv_headroom").choose(q, [fits_exactly], rng()).worker_id == "A"
    short = dw("A", kv_total_tokens=2000, kv_free_tokens=2000, reserved_tokens=501)
    with pytest.raises(NoWorker) as err:
        make_decode_policy("kv_headroom").choose(q, [short, dw("B", draining=True)], rng())
    assert err.value.reason == "no decode worker has KV headroom for 1500 tokens"
    with pytest.raises(NoWorker, match="no live decode worker"):
        make_decode_policy("kv_headroom").choose(q, [dw("B", up=False)], rng())


def test_a_learned_reservation_never_places_a_request_where_its_maximum_cannot_fit() -> None:
    """`reserve_output_tokens` p90 (the default) reserves input + a learned output length below the
    request's max_new_tokens; a worker whose whole KV is smaller than input + max_new_tokens would
    refuse the sequence (TOO_LONG after its prefill), so it is not eligible, however free it is."""
    q = DecodeQuery(1000, 200, limit_tokens=1000 + 4000)
    small = dw("A", kv_total_tokens=4_000, kv_free_tokens=4_000)  # 1,200 reserved fits, 5,000 never
    big = dw("B", kv_total_tokens=8_000, kv_free_tokens=1_500)  # less free, but can hold the maximum
    choice = make_decode_policy("kv_headroom").choose(q, [small, big], rng())
    assert (choice.worker_id, choice.score) == ("B", 1_500.0)
    with pytest.raises(NoWorker, match="headroom for 1200 tokens"):
        make_decode_policy("kv_headroom").choose(q, [small], rng())
    # Without a limit the reservation alone decides (the query as `max` builds it: limit = need).
    assert make_decode_policy("kv_headroom").choose(DecodeQuery(1000, 200), [small], rng()).worker_id == "A"


def test_kv_headroom_near_tie_within_five_percent() -> None:
    workers = [
        dw("A", kv_free_tokens=100_000),
        dw("B", kv_free_tokens=96_000),
        dw("C", kv_free_tokens=94_000),
    ]
    seen = set(picks(make_decode_policy("kv_headroom"), DecodeQuery(100, 100), workers, seed=4, n=200))
    assert seen == {"A", "B"}


def test_decode_least_load_ranks_by_reserved_then_running() -> None:
    workers = [
        dw("A", reserved_tokens=5000, running=1),
        dw("B", reserved_tokens=3000, running=9),
        dw("C", reserved_tokens=3000, running=4),
        dw("D", reserved_tokens=99_999),  # cannot fit
    ]
    choice = make_decode_policy("least_load").choose(DecodeQuery(100, 100), workers, rng())
    assert (choice.worker_id, choice.score) == ("C", 3000.0)


# --------------------------------------------------------------------------------------------------
# registry


def test_make_strategy_errors_name_the_known_strategies() -> None:
    with pytest.raises(ValueError, match="cost, least_load, prefix, random, round_robin"):
        make_prefill_policy("fastest")
    with pytest.raises(ValueError, match="kv_headroom, least_load, random, round_robin"):
        make_decode_policy("cost")
    with pytest.raises(TypeError):
        make_prefill_policy("cost")  # the formula is required
    with pytest.raises(TypeError):
        make_prefill_policy("random", tie_ms=5)  # a knob that strategy does not have


def test_every_prefill_strategy_accepts_the_common_keywords() -> None:
    for name in PREFILL_STRATEGIES:
        strategy = make_prefill_policy(name, formula=LINEAR, hotspot_queue_len=8)
        assert strategy.name == name
        choice = strategy.choose(pq(2000, {"A": 6}), [pw("A")], rng())
        assert choice == Choice("A", 1536, pytest.approx(56.4), choice.score, choice.reason)
    for name in DECODE_STRATEGIES:
        assert make_decode_policy(name).name == name


def test_the_admin_api_lists_what_the_registry_holds() -> None:
    book = PolicyBook(
        {"sticky": {"role": "prefill", "scorers": {"predicted_finish_ms": 1, "cache_hit_tokens": 0.1}}}
    )
    listed = book.describe()
    assert sorted(listed["policies"]["prefill"]) == sorted([*PREFILL_STRATEGIES, "sticky"])
    assert sorted(listed["policies"]["decode"]) == DECODE_STRATEGIES
    assert "cache_hit_tokens" in listed["plugins"]["scorer"]
    assert listed["plugins"]["filter"]["hotspot"]["params"] == {"hotspot_queue_len": None}


# --------------------------------------------------------------------------------------------------
# top_candidates and properties

worker_ids = st.sampled_from([f"w{i:02d}" for i in range(12)])
prefill_workers = st.lists(
    st.builds(
        WorkerView,
        id=worker_ids,
        role=st.sampled_from(["prefill", "prefill", "prefill", "decode"]),
        up=st.booleans() | st.just(True),
        kv_total_tokens=st.integers(0, 20_000),
        kv_free_tokens=st.integers(0, 20_000),
        kv_evictable_tokens=st.integers(0, 5_000),
        queue_len=st.integers(0, 10),
        # Multiples of 1/4 ms keep sums exact, so equal loads really compare equal.
        queued_ms=st.integers(0, 2000).map(lambda x: x / 4),
        owed_ms=st.integers(0, 2000).map(lambda x: x / 4),
        draining=st.just(False) | st.booleans(),
    ),
    max_size=12,
    unique_by=lambda w: w.id,
)
decode_workers = st.lists(
    st.builds(
        WorkerView,
        id=worker_ids,
        role=st.just("decode"),
        up=st.booleans() | st.just(True),
        kv_free_tokens=st.integers(0, 20_000),
        reserved_tokens=st.integers(0, 10_000),
        running=st.integers(0, 64),
    ),
    max_size=12,
    unique_by=lambda w: w.id,
)
prefill_queries = st.builds(
    PrefillQuery,
    input_tokens=st.integers(0, 12_000),
    hit_blocks=st.dictionaries(worker_ids, st.integers(0, 200), max_size=6),
    block_size=st.sampled_from([16, 64, 256]),
)
decode_queries = st.builds(
    DecodeQuery, input_tokens=st.integers(0, 8000), max_new_tokens=st.integers(0, 4000)
)
DEFAULT = compile_formula(DEFAULT_PREFILL_FORMULA)


def run_many(
    strategy: object, q: object, workers: list[WorkerView], seed: int
) -> tuple[list[object], object]:
    """Three calls in a row (round_robin carries state), then the generator's state."""
    r = random.Random(seed)
    out: list[object] = []
    for _ in range(3):
        try:
            out.append(strategy.choose(q, workers, r))  # type: ignore[attr-defined]
        except NoWorker as exc:
            out.append(("NoWorker", exc.reason))
    return out, r.getstate()


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(PREFILL_STRATEGIES)),
    q=prefill_queries,
    workers=prefill_workers,
    seed=st.integers(0, 2**32),
    hot=st.none() | st.integers(0, 10),
)
def test_prefill_choice_is_deterministic_and_eligible(
    name: str, q: PrefillQuery, workers: list[WorkerView], seed: int, hot: int | None
) -> None:
    first = run_many(make_prefill_policy(name, formula=DEFAULT, hotspot_queue_len=hot), q, workers, seed)
    again = run_many(make_prefill_policy(name, formula=DEFAULT, hotspot_queue_len=hot), q, workers, seed)
    assert first == again
    try:
        eligible, hits = eligible_prefill(q, workers, hot)
    except NoWorker as exc:
        assert all(c == ("NoWorker", exc.reason) for c in first[0])
        return
    hit_of = {w.id: h for w, h in zip(eligible, hits, strict=True)}
    for choice in first[0]:
        assert isinstance(choice, Choice)
        assert choice.worker_id in hit_of
        assert choice.hit_tokens == hit_of[choice.worker_id]
        assert choice.hit_tokens % q.block_size == 0
        assert choice.hit_tokens < max(q.input_tokens, 1)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(DECODE_STRATEGIES)),
    q=decode_queries,
    workers=decode_workers,
    seed=st.integers(0, 2**32),
)
def test_decode_choice_is_deterministic_and_fits(
    name: str, q: DecodeQuery, workers: list[WorkerView], seed: int
) -> None:
    first = run_many(make_decode_policy(name), q, workers, seed)
    assert first == run_many(make_decode_policy(name), q, workers, seed)
    by_id = {w.id: w for w in workers}
    for choice in first[0]:
        if isinstance(choice, Choice):
            w = by_id[choice.worker_id]
            assert w.up
            assert w.kv_free_tokens - w.reserved_tokens >= q.input_tokens + q.max_new_tokens


@settings(max_examples=150, deadline=None)
@given(q=prefill_queries, workers=prefill_workers, seed=st.integers(0, 2**32))
def test_cost_choice_is_within_the_tie_band_of_the_best(
    q: PrefillQuery, workers: list[WorkerView], seed: int
) -> None:
    strategy = cost_policy(DEFAULT)
    try:
        choice = strategy.choose(q, workers, random.Random(seed))
    except NoWorker:
        return
    eligible, hits = eligible_prefill(q, workers)
    costs = [
        DEFAULT.predict_one(q.input_tokens, h) + w.owed_ms + w.queued_ms
        for w, h in zip(eligible, hits, strict=True)
    ]
    best = min(costs)
    assert choice.score <= best + max(0.10 * best, 20.0) + 1e-9
    assert choice.predicted_ms == DEFAULT.predict_one(q.input_tokens, choice.hit_tokens)


@settings(max_examples=150, deadline=None)
@given(
    q=prefill_queries,
    workers=prefill_workers,
    k=st.integers(1, 4),
    name=st.sampled_from(["cost", "prefix", "least_load"]),
)
def test_top_candidates_keeps_the_best_score(
    q: PrefillQuery, workers: list[WorkerView], k: int, name: str
) -> None:
    kw: dict[str, object] = {"tie_pct": 0.0, "tie_abs": 0.0} if name == "cost" else {}
    strategy = make_prefill_policy(name, formula=DEFAULT, **kw)
    try:
        full = strategy.choose(q, workers, random.Random(0))
    except NoWorker as exc:
        with pytest.raises(NoWorker) as err:
            top_candidates(q, workers, k)
        assert err.value.reason == exc.reason
        return
    kept = top_candidates(q, workers, k)
    eligible, hits = eligible_prefill(q, workers)
    holders = {w.id for w, h in zip(eligible, hits, strict=True) if h > 0}
    kept_ids = [w.id for w in kept]
    assert holders <= set(kept_ids)
    assert len(kept) <= len(holders) + k
    assert kept_ids == [w.id for w in eligible if w.id in set(kept_ids)]  # original order
    pruned = strategy.choose(q, kept, random.Random(0))
    assert pruned.score == full.score
    assert pruned.hit_tokens == full.hit_tokens


def test_top_candidates_on_a_large_fleet() -> None:
    workers = [pw(f"w{i:04d}", owed_ms=float((i * 37) % 1000)) for i in range(1000)]
    q = pq(3000, {"w0500": 5, "w0999": 2})
    kept = top_candidates(q, workers, 8)
    ids = {w.id for w in kept}
    assert {"w0500", "w0999"} <= ids
    assert len(kept) == 10
    strategy = cost_policy(DEFAULT, tie_pct=0.0, tie_abs=0.0)
    assert strategy.choose(q, kept, rng()).score == strategy.choose(q, workers, rng()).score
    # Equal loads at the cut are settled by id, whatever the order of the list.
    flat = [pw(f"w{i}") for i in range(6)]
    assert [w.id for w in top_candidates(pq(100), flat[::-1], 2)] == ["w1", "w0"]
    with pytest.raises(ValueError):
        top_candidates(q, workers, 0)


# --------------------------------------------------------------------------------------------------
# declared policies (FLEXLB_POLICIES)


def test_a_declared_policy_composes_plugins_with_weights() -> None:
    # Finish time plus a cache bonus of 0.05 ms per cached token: A's 1536 cached tokens are worth
    # 76.8 ms, more than its 6.4 ms extra cost (A: 56.4 + 160 = 216.4, B: cold 210), so A wins only
    # with it.
    book = PolicyBook(
        {
            "greedy": {"role": "prefill", "scorers": {"predicted_finish_ms": 1.0}},
            "sticky": {
                "role": "prefill",
                "scorers": [{"name": "predicted_finish_ms"}, {"name": "cache_hit_tokens", "weight": 0.05}],
            },
        }
    )
    q = pq(2000, {"A": 6})
    workers = [pw("A", owed_ms=160.0), pw("B")]
    plain = book.build("prefill", "greedy", LINEAR).choose(q, workers, rng())
    sticky = book.build("prefill", "sticky", LINEAR).choose(q, workers, rng())
    assert (plain.worker_id, sticky.worker_id) == ("B", "A")
    assert sticky.score == pytest.approx(216.4 - 0.05 * 1536)


def test_predicted_late_ms_is_zero_within_the_budget_and_the_overrun_past_it() -> None:
    # L = 2000 cold = 210 ms; A's cached 1536 tokens make it 56.4 ms. Budget 500 ms.
    book = PolicyBook(
        {"late": {"role": "prefill", "scorers": [{"name": "predicted_late_ms", "budget_ms": 500}]}}
    )
    pol = book.build("prefill", "late", LINEAR)
    q = pq(2000, {"A": 6})
    # A finishes at 56.4 + 400 (within), B at 210 + 350 = 560 (60 past), C at 210 + 1000 (710 past).
    workers = [pw("A", owed_ms=400.0), pw("B", queued_ms=350.0), pw("C", owed_ms=1000.0)]
    assert pol.choose(q, workers, rng()).score == pytest.approx(0.0)
    assert pol.choose(q, workers[1:], rng()).score == pytest.approx(60.0)
    assert pol.choose(q, workers[2:], rng()).score == pytest.approx(710.0)
    with pytest.raises(ValueError, match="budget_ms must be >= 0"):
        PolicyBook({"bad": {"role": "prefill", "scorers": [{"name": "predicted_late_ms", "budget_ms": -1}]}})


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({"role": "both", "scorers": {"prefill_load_ms": 1}}, "role must be prefill or decode"),
        ({"role": "prefill"}, "picker 'best' needs at least one scorer"),
        ({"role": "prefill", "scorers": {"prefill_load_ms": 1}, "picker": "random"}, "ignores scorers"),
        ({"role": "prefill", "scorers": {"prefill_load_ms": 0}}, "weight must be finite and > 0"),
        ({"role": "prefill", "scorers": {"fastest": 1}}, "unknown scorer 'fastest'"),
        ({"role": "decode", "scorers": {"prefill_load_ms": 1}}, "does not apply to decode"),
        (
            {"role": "prefill", "scorers": {"prefill_load_ms": 1}, "batching": "eager"},
            "batching must be one of",
        ),
        ({"role": "prefill", "scorers": {"prefill_load_ms": 1}, "colour": 1}, "unknown field"),
    ],
)
def test_a_malformed_declared_policy_is_refused_at_start_up(raw: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        PolicyBook({"mine": raw})


def test_a_declared_policy_cannot_take_a_builtin_name_or_an_unknown_parameter() -> None:
    with pytest.raises(ValueError, match="built-in"):
        PolicyBook({"cost": {"role": "prefill", "scorers": {"prefill_load_ms": 1}}})
    with pytest.raises(TypeError, match="parameters: hotspot_queue_len"):
        PolicyBook(
            {
                "hot": {
                    "role": "prefill",
                    "filters": [{"name": "hotspot", "limit": 3}],
                    "scorers": {"prefill_load_ms": 1},
                }
            }
        )


def test_the_simulator_runs_declared_policies_with_their_batching() -> None:
    from app.sim.cli import parse_policies

    book = PolicyBook(
        {"direct_cost": {"role": "prefill", "scorers": {"predicted_finish_ms": 1}, "batching": "direct"}}
    )
    specs = parse_policies("direct_cost,direct_cost@slo,cost", "fixed_window", book)
    assert [(s.name, s.strategy, s.batching) for s in specs] == [
        ("direct_cost", "direct_cost", "direct"),
        ("direct_cost@slo", "direct_cost", "slo"),
        ("cost", "cost", "fixed_window"),
    ]
    known = "cost, dynamo_kv, least_load, llmd_precise, prefix, random, round_robin, sglang_cache_aware"
    with pytest.raises(ValueError, match=rf"known: {known}, vllm_cache_aware$"):
        parse_policies("direct_cost", "fixed_window")


def test_second_look_reranks_the_pick_and_runner_up_on_fresh_load() -> None:
    # Two replicas' snapshot says A and B are idle; in fact another replica just queued 500 ms on
    # A. The stale pick is A or B at random; the second look moves a stale A pick to B, and never
    # moves a request off B.
    q = pq(2000)
    stale = [pw("A"), pw("B"), pw("C", owed_ms=900.0)]
    live = {"A": (500.0, 0.0), "B": (0.0, 0.0), "C": (0.0, 900.0)}
    pol = cost_policy(LINEAR)
    r = rng(3)
    firsts, finals = set(), set()
    for _ in range(40):
        first = pol.choose(q, stale, r)
        firsts.add(first.worker_id)
        finals.add(pol.second_look(q, stale, first, live.__getitem__, r).worker_id)
    assert firsts == {"A", "B"}
    assert finals == {"B"}


def test_second_look_ranks_by_the_policy_so_a_cache_holder_keeps_its_prompt() -> None:
    # Fresh load says the holder A owes 200 ms more than B: finish time alone would move the prompt
    # (56.4 + 200 > 210 + 21), but the policy's own ranking counts the prefix for its follow-ups
    # (56.4 + 200 - 307.2 < 210), so the second look keeps it where `choose` put it.
    q = pq(2000, {"A": 6})
    views = [pw("A"), pw("B")]
    live = {"A": (0.0, 200.0), "B": (0.0, 0.0)}
    pol = cost_policy(LINEAR)
    first = pol.choose(q, views, rng())
    assert first.worker_id == "A"
    assert pol.second_look(q, views, first, live.__getitem__, rng()).worker_id == "A"
    # A backlog beyond what the prefix is worth moves it (past the 1 s budget: 1,256.4 - 750 -
    # 307.2 > 52.5 + 20).
    far = {"A": (0.0, 1200.0), "B": (0.0, 0.0)}
    assert pol.second_look(q, views, first, far.__getitem__, rng()).worker_id == "B"
