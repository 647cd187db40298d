"""Decode holds that count a shared prompt block once (`FLEXLB_DECODE_SHARED_PREFIX`).

A decode engine with paged KV holds a full prompt block its running sequences share once; the
origin's reservation counted it once per request and refused decode workers whose KV was a third
duplicates (chat_agents, issue 15). One semantics in three places, each pinned here: the pure
accounting the simulator uses (`SharedBlockHolds`), the live `reserve` / `release` scripts in real
Redis (checked against that model on random operations), and the simulator's origin.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.scheduling.reserve import SHARE_CHUNK_TOKENS, SharedBlockHolds, share_chunk_size, share_chunks
from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig, batcher_config
from app.state.store import StateStore
from app.traces.model import Trace, TraceRequest

BS = 100
CAP = 1_000


def test_shared_block_holds_count_a_block_once() -> None:
    h = SharedBlockHolds(BS)
    assert h.held_tokens((1, 2, 3)) == 0
    h.hold("a", (1, 2, 3))
    assert h.held_tokens((1, 2, 4)) == 2 * BS
    h.hold("b", (1, 2, 4))
    assert h.drop("a") == 2 * BS  # 1 and 2 stay held by b: not freed
    assert h.held_tokens((1, 2, 3)) == 2 * BS
    assert h.drop("b") == 0
    assert h.drop("b") == 0 and not h.count and not h.of


def test_a_hold_names_one_chained_key_per_chunk() -> None:
    # Each named key costs the RESERVE / RELEASE scripts a Redis call: at a 64-token block a hold
    # names every 8th block's key (a chained key names its whole prefix), whole chunks only.
    keys = list(range(100, 120))  # 20 full blocks of 64
    assert share_chunk_size(64) == SHARE_CHUNK_TOKENS == 512
    assert share_chunks(64, keys) == (512, [107, 115])
    assert share_chunks(512, keys) == (512, keys)
    assert share_chunks(1024, keys[:3]) == (1024, keys[:3])
    assert share_chunks(64, keys[:7]) == (512, [])  # no whole chunk: nothing shared
    assert share_chunks(0, keys) == (0, [])


async def test_the_reserve_script_holds_a_shared_block_once(store: StateStore) -> None:
    # Two requests with the same 3-block prompt (300 of 350 tokens) and 100 tokens of output on a
    # 1,000-token worker: 450 + 450 fit only when the blocks are held once (450 + 150).
    assert await store.reserve("d", "a", 450, 700, BS, [11, 12, 13])
    assert await store.reserve("d", "b", 450, 700, BS, [11, 12, 13])
    assert await store.reserved_total("d") == 600
    assert not await store.reserve("d", "c", 450, 700, BS, [21, 22, 23])  # other blocks: 1,050 > 700
    assert await store.release("d", "a")
    assert await store.reserved_total("d") == 450  # b's prompt stays held in full
    assert not await store.release("d", "a")
    assert await store.reserved_total("d") == 450
    assert await store.release("d", "b")
    assert await store.reserved_total("d") == 0
    assert await store.redis.hgetall(store.keys.reservation_blocks("d")) == {}
    # Without blocks (the setting off) a hold is its tokens, as before.
    assert await store.reserve("d", "e", 450, 700)
    assert not await store.reserve("d", "f", 450, 700, BS, [11, 12, 13])
    assert await store.release("d", "e")
    with pytest.raises(ValueError):
        store.reserve_cmd("d", "g", 250, 700, BS, [1, 2, 3])  # blocks beyond the tokens


PROMPTS = [(1, 2, 3), (1, 2, 4), (5, 6), (1,), ()]
op_st = st.one_of(
    st.tuples(
        st.just("reserve"), st.sampled_from("abcd"), st.sampled_from(range(len(PROMPTS))), st.integers(0, 80)
    ),
    st.tuples(st.just("release"), st.sampled_from("abcd")),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(op_st, min_size=1, max_size=30))
async def test_the_scripts_match_the_pure_model(store: StateStore, ops: list[tuple]) -> None:
    wid = f"d{uuid.uuid4().hex[:8]}"  # fresh per example: the fixture is shared by all examples
    model = SharedBlockHolds(BS)
    tokens: dict[str, int] = {}
    total = 0
    for op in ops:
        if op[0] == "reserve":
            _, rid, k, extra = op
            keys = PROMPTS[k]
            need = BS * len(keys) + extra
            got = await store.reserve(wid, rid, need, CAP // 2, BS, list(keys))
            if rid in tokens:
                assert got
                continue
            add = need - model.held_tokens(keys)
            assert got == (total + add <= CAP // 2)
            if got:
                model.hold(rid, keys)
                tokens[rid] = need
                total += add
        else:
            rid = op[1]
            assert await store.release(wid, rid) == (rid in tokens)
            if rid in tokens:
                total -= tokens.pop(rid) - model.drop(rid)
        assert await store.reserved_total(wid) == total
    for rid in list(tokens):
        await store.release(wid, rid)
    assert await store.reserved_total(wid) == 0
    assert await store.redis.hgetall(store.keys.reservation_blocks(wid)) == {}


def _sessions_trace() -> Trace:
    """Six requests 10 ms apart whose 100,000-token prompts share 190 of their 195 blocks (one
    session's overlapping turns): 600,000+ tokens of decode KV counted per request, ~126,000 held."""
    reqs = []
    for i in range(6):
        keys = tuple(range(190)) + tuple(1_000 * (i + 1) + b for b in range(5))
        reqs.append(TraceRequest(i, 10.0 * i, 100_000, 2_000, keys))
    return Trace("sessions", "mooncake", 512, reqs)


@pytest.mark.parametrize("shared", [False, True])
def test_the_simulated_origin_reserves_a_shared_block_once(shared: bool) -> None:
    # An SLO no prefill misses: only the decode hold decides.
    cfg = SimConfig(prefill=1, decode=1, slo_ttft_ms=600_000.0, decode_shared_prefix=shared)
    res = ClusterSim(_sessions_trace(), cfg, "cost", batcher_config("window", cfg.slo_ttft_ms, None)).run()
    refused = res.rejections.get("decode_reserve_refused", 0) + res.rejections.get("decode_no_kv_headroom", 0)
    if shared:
        assert refused == 0 and all(r.error is None for r in res.records), res.rejections
    else:
        assert refused >= 2, res.rejections  # 450,000 tokens of KV hold four 102,000-token holds
