"""The decode pick prefers the worker that already holds a request's prompt
(`FLEXLB_DECODE_PREFER_HELD`, issue 15).

With shared decode holds (`FLEXLB_DECODE_SHARED_PREFIX`) a request costs a worker only the blocks
no hold there names, but the pick ranked on headroom alone, so an application's or a session's
requests shared their prompt only where they landed by chance. Pinned here: the origin's view of
its own holds (`DecodeHoldMirror`), the pick's headroom for this request (headroom + the tokens
held there) and its bound (a fuller holder is not preferred), the holder winning a near-tie, and
the simulated origin placing a session's overlapping turns together.
"""

from __future__ import annotations

import random

import pytest

from app.scheduling.policy import PolicyBook
from app.scheduling.reserve import DecodeHoldMirror
from app.scheduling.routing import DECODE, DecodeQuery, WorkerView, eligible_decode
from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig, batcher_config
from app.traces.model import Trace, TraceRequest

CAP = 100_000


def _w(i: int, reserved: int) -> WorkerView:
    return WorkerView(f"d{i}", DECODE, kv_total_tokens=CAP, kv_free_tokens=CAP, reserved_tokens=reserved)


def test_the_mirror_counts_what_our_holds_name_per_worker() -> None:
    m = DecodeHoldMirror()
    assert m.held(512, [1, 2, 3]) == {}
    m.hold("a", "d0", 512, [1, 2])
    m.hold("b", "d1", 512, [1])
    m.hold("c", "d0", 512, [1, 2, 5])
    assert m.held(512, [1, 2, 3]) == {"d0": 1024, "d1": 512}
    m.drop("c")
    assert m.held(512, [1, 2, 3]) == {"d0": 1024, "d1": 512}  # a still names 1 and 2 on d0
    m.hold("a", "d1", 512, [1, 2])  # a hold moved (retried elsewhere) replaces the first
    assert m.held(512, [1, 2]) == {"d1": 1024}
    m.drop("a")
    m.drop("b")
    m.drop("b")  # idempotent
    assert not m.index and not m.of and len(m) == 0


def test_the_headroom_counts_the_tokens_held_there_bounded_by_the_shareable_part() -> None:
    ws = [_w(0, 10_000), _w(1, 20_000)]
    q = DecodeQuery(8_000, 1_000, 9_000, 6_144, held={"d1": 8_192})
    _, heads = eligible_decode(q, ws)
    assert heads == [90_000, 80_000 + 6_144]  # never more than the shareable part
    _, heads = eligible_decode(DecodeQuery(8_000, 1_000, 9_000, 6_144), ws)
    assert heads == [90_000, 80_000]


def _pick(q: DecodeQuery, ws: list[WorkerView], seed: int = 0) -> str:
    policy = PolicyBook().build(DECODE, "kv_headroom")
    return policy.choose(q, ws, random.Random(seed)).worker_id


def test_kv_headroom_sends_a_request_where_its_prompt_is_held() -> None:
    # d1 has 10,000 less headroom (outside the 5 % band) but holds 16,384 of the prompt: after the
    # reservation it keeps more room than d0 would (by more than the band), so it is the place.
    ws = [_w(0, 10_000), _w(1, 20_000)]
    q = DecodeQuery(17_000, 1_000, 18_000, 16_384, held={"d1": 16_384})
    assert all(_pick(q, ws, s) == "d1" for s in range(20))
    assert all(_pick(DecodeQuery(17_000, 1_000, 18_000, 16_384), ws, s) == "d0" for s in range(20))


def test_a_fuller_holder_is_not_preferred_beyond_what_it_saves() -> None:
    # No herding: d1 holds 4,096 of the prompt but has 20,000 less headroom; it stays the worse place.
    ws = [_w(0, 10_000), _w(1, 30_000)]
    q = DecodeQuery(5_000, 1_000, 6_000, 4_096, held={"d1": 4_096})
    assert all(_pick(q, ws, s) == "d0" for s in range(20))


def test_the_held_tokens_never_override_the_band_draw() -> None:
    # Within kv_headroom's 5 % band the draw stays: breaking near-ties for the holder piled an
    # application's sequences onto one worker (TPOT p99 +6-8 ms on chat_agents at loads 4-5).
    ws = [_w(0, 10_000), _w(1, 13_000), _w(2, 11_000)]
    q = DecodeQuery(2_000, 500, 2_500, 1_024, held={"d1": 1_024})
    assert {_pick(q, ws, s) for s in range(40)} == {"d0", "d1", "d2"}


def test_the_decode_held_tokens_scorer_reads_the_query() -> None:
    # Not in a built-in policy: for declared ones (e.g. a tie-break that keeps the holder).
    picker = {"name": "best", "tie_pct": 0.05, "tie_break": ["decode_held_tokens"]}
    book = PolicyBook(
        {"holder": {"role": "decode", "scorers": {"kv_headroom_tokens": 1.0}, "picker": picker}}
    )
    policy = book.build(DECODE, "holder")
    ws = [_w(0, 10_000), _w(1, 13_000), _w(2, 11_000)]
    q = DecodeQuery(2_000, 500, 2_500, 1_024, held={"d1": 1_024})
    assert {policy.choose(q, ws, random.Random(s)).worker_id for s in range(20)} == {"d1"}


def _two_apps_trace() -> Trace:
    """Two applications' requests alternating 20 ms apart, each a 100,000-token prompt of which
    194 blocks (99,328 tokens) are its application's and one block its own, decoding 5,000
    tokens: all eight run at once on two decode workers."""
    reqs = []
    for i in range(8):
        app = i % 2
        keys = (*(10_000 * (app + 1) + b for b in range(194)), 100_000 + i)
        reqs.append(TraceRequest(i, 20.0 * i, 100_000, 5_000, keys))
    return Trace("apps", "mooncake", 512, reqs)


@pytest.mark.parametrize("prefer", [False, True])
def test_the_simulated_origin_keeps_an_application_on_the_worker_holding_its_prompt(prefer: bool) -> None:
    # Once each application holds its prompt on one worker, both workers have the same headroom:
    # only the held tokens tell them apart (~99,000 tokens, far beyond the 5 % band).
    cfg = SimConfig(prefill=2, decode=2, slo_ttft_ms=600_000.0, decode_prefer_held=prefer)
    res = ClusterSim(_two_apps_trace(), cfg, "cost", batcher_config("window", cfg.slo_ttft_ms, None)).run()
    assert all(r.error is None for r in res.records), res.rejections
    per_app = [{r.decode_worker for r in res.records if int(r.request_id[1:]) % 2 == a} for a in (0, 1)]
    if prefer:
        assert [len(s) for s in per_app] == [1, 1] and per_app[0] != per_app[1], per_app
    else:
        assert sum(len(s) for s in per_app) >= 3, per_app  # drawn between equal headrooms


def test_the_all_holds_view_is_one_mirror_shared_by_every_replica() -> None:
    # `SimConfig.decode_held_view` (an evaluation, `+dall` in bench/cliff.py): "own" gives each
    # replica the mirror of its own holds, as live; "all" one mirror of every replica's holds.
    trace = _two_apps_trace()
    bc = batcher_config("window", 600_000.0, None)
    own = ClusterSim(trace, SimConfig(prefill=2, decode=2, replicas=2), "cost", bc)
    assert own.replicas[0].dholds is not own.replicas[1].dholds
    shared = ClusterSim(trace, SimConfig(prefill=2, decode=2, replicas=2, decode_held_view="all"), "cost", bc)
    assert shared.replicas[0].dholds is shared.replicas[1].dholds
    with pytest.raises(ValueError, match="decode_held_view"):
        SimConfig(decode_held_view="some").validate()
