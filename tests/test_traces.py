"""Trace loading, transformations and the hit-ratio bounds (hand-made traces checked by hand, and the
figures the shipped traces' README (data/traces/README.md) publishes)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from app.traces import (
    Trace,
    TraceError,
    TraceRequest,
    load_trace,
    parse_slice,
    pooled_lru_hit_ratio,
    pooled_lru_token_hit_ratio,
    replicate,
    save_trace,
    scale_time,
    slice_trace,
    synthetic_trace,
    theoretical_hit_ratio,
    theoretical_token_hit_ratio,
    trace_bounds,
)

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"  # shipped in the repository


def hand_trace() -> Trace:
    # block size 4; hits with an infinite cache: 0, 2, 0, 1, 2 of 10 blocks; tokens 0+8+0+4+8 of 39.
    rows = [(8, (1, 2)), (10, (1, 2, 3)), (4, (5,)), (9, (1, 7)), (8, (1, 2))]
    return Trace(
        "hand",
        "synthetic",
        4,
        [TraceRequest(i, 10.0 * i, il, 3, bh) for i, (il, bh) in enumerate(rows)],
    )


def test_theoretical_bounds_of_hand_trace() -> None:
    t = hand_trace()
    assert theoretical_hit_ratio(t) == pytest.approx(5 / 10)
    assert theoretical_token_hit_ratio(t) == pytest.approx(20 / 39)


def test_pooled_lru_of_hand_trace() -> None:
    t = hand_trace()
    # 3 blocks of room: block 3 is evicted by 5, block 2 by 7, so the last request hits only block 1:
    # hits 0, 2, 0, 1, 1.
    assert pooled_lru_hit_ratio(t, 12) == pytest.approx(4 / 10)
    assert pooled_lru_token_hit_ratio(t, 12) == pytest.approx(16 / 39)
    assert pooled_lru_hit_ratio(t, 0) == 0.0
    # Unlimited room is the theoretical bound; a finite LRU can never beat it.
    assert pooled_lru_hit_ratio(t, 10_000) == pytest.approx(theoretical_hit_ratio(t))
    b = trace_bounds(t, 12)
    assert b["hit_ratio_theoretical"] == pytest.approx(20 / 39)
    assert b["hit_ratio_theoretical_blocks"] == pytest.approx(0.5)
    assert b["hit_ratio_pooled_lru"] == pytest.approx(16 / 39)
    assert b["hit_ratio_pooled_lru_blocks"] == pytest.approx(0.4)


def test_pooled_lru_holds_full_blocks_only() -> None:
    # Block size 4, room for 2 blocks. The first two prompts end in a partial block (9, 8) that the
    # engine never caches: it must take no room, so both full heads 1 and 2 stay and the third
    # prompt hits block 1. Counting the partial blocks evicted 1 and read the bound low.
    t = Trace(
        "t",
        "mooncake",
        4,
        [TraceRequest(0, 0, 6, 1, (1, 9)), TraceRequest(1, 1, 6, 1, (2, 8)), TraceRequest(2, 2, 4, 1, (1,))],
    )
    assert pooled_lru_token_hit_ratio(t, 8) == pytest.approx(4 / 16)
    assert pooled_lru_hit_ratio(t, 8) == pytest.approx(1 / 5)


def test_lru_evicts_chain_tail_first() -> None:
    # Room for 2 blocks: after [1,2,3] the LRU keeps the head 1,2 (touched last-first), so [1,2,9] hits 2.
    t = Trace("t", "synthetic", 1, [TraceRequest(0, 0, 3, 1, (1, 2, 3)), TraceRequest(1, 1, 3, 1, (1, 2, 9))])
    assert pooled_lru_hit_ratio(t, 2) == pytest.approx(2 / 6)


def _write(path: Path, rows: list[dict], gz: bool) -> None:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def test_load_flexlb_and_mooncake_auto(tmp_path: Path) -> None:
    flex = [
        {"ts": 100, "il": 2100, "ol": 0, "bh": ["18446744073709551", "7"], "pep": "prefill-1"},
        {"ts": 50, "il": 10, "ol": 5, "bh": []},
    ]
    p = tmp_path / "f.jsonl.gz"
    _write(p, flex, gz=True)
    t = load_trace(p)
    assert (t.format, t.block_size, t.name) == ("flexlb", 1024, "f")
    # sorted by arrival, re-based to the first, decimal strings as ints
    assert [r.arrival_ms for r in t.requests] == [0.0, 50.0]
    assert t.requests[1].block_hashes == (18446744073709551, 7)
    assert t.requests[1].output_len == 0 and t.requests[1].index == 1
    moon = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}]
    q = tmp_path / "m.jsonl"
    _write(q, moon, gz=False)
    m = load_trace(q)
    assert (m.format, m.block_size) == ("mooncake", 512)
    # the partial last block is hashed by Mooncake but an engine caches full blocks only
    assert m.full_block_keys(m.requests[0]) == (0,)
    with pytest.raises(TraceError, match="flexlb"):
        load_trace(q, "flexlb")


def test_bad_rows_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"ts": 0, "il": 1, "ol": 1, "bh": []}\n{"ts": 1, "il": "x", "ol": 1, "bh": []}\n')
    with pytest.raises(TraceError, match=":2:"):
        load_trace(p)
    q = tmp_path / "odd.jsonl"
    q.write_text('{"foo": 1}\n')
    with pytest.raises(TraceError, match="unknown trace row"):
        load_trace(q)


def test_save_and_reload_synthetic(tmp_path: Path) -> None:
    t = synthetic_trace(
        20, 5.0, prefix_groups=2, prefix_blocks=3, unique_blocks=1, block_size=16, output_len=4, seed=3
    )
    p = tmp_path / "s.jsonl.gz"
    save_trace(t, p)
    back = load_trace(p)
    assert back.format == "synthetic" and back.block_size == 16
    assert back.requests == t.requests


def test_slice_scale_replicate() -> None:
    t = hand_trace()
    s = slice_trace(t, 1, 3)
    assert [r.index for r in s.requests] == [0, 1]
    assert [r.arrival_ms for r in s.requests] == [0.0, 10.0]
    assert s.requests[0].block_hashes == (1, 2, 3)
    assert parse_slice("1:3") == (1, 3) and parse_slice(":5") == (0, 5) and parse_slice("4:") == (4, None)
    with pytest.raises(ValueError):
        parse_slice("5:2")
    f = scale_time(t, 2.0)
    assert [r.arrival_ms for r in f.requests] == [0.0, 5.0, 10.0, 15.0, 20.0]
    r3 = replicate(t, 3, seed=1)
    assert len(r3) == 15
    arr = [r.arrival_ms for r in r3.requests]
    assert arr == sorted(arr) and [r.index for r in r3.requests] == list(range(15))
    # namespaces: no block id shared across copies, so the bounds per copy are unchanged
    assert theoretical_hit_ratio(r3) == pytest.approx(theoretical_hit_ratio(t))
    assert replicate(t, 3, seed=1).requests == r3.requests
    assert replicate(t, 3, seed=2).requests != r3.requests
    # building only the first N merged arrivals gives the same requests as slicing the whole merge
    big = synthetic_trace(
        300, 20.0, prefix_groups=3, prefix_blocks=2, unique_blocks=1, block_size=4, output_len=2, seed=5
    )
    full = replicate(big, 7, seed=4)
    for n in (1, 50, 333, 2100):
        assert replicate(big, 7, seed=4, max_requests=n).requests == slice_trace(full, 0, n).requests


def test_synthetic_shape() -> None:
    t = synthetic_trace(
        200, 10.0, prefix_groups=4, prefix_blocks=5, unique_blocks=2, block_size=8, output_len=7, seed=1
    )
    assert len(t) == 200 and all(r.input_len == 56 and len(r.block_hashes) == 7 for r in t.requests)
    # after each group's first request, 5 of 7 blocks hit: ratio = 5/7 * (200 - 4) / 200
    assert theoretical_hit_ratio(t) == pytest.approx(5 / 7 * 196 / 200)
    rate = len(t) / (t.span_ms / 1000)
    assert 7.0 < rate < 13.0
    assert (
        t.requests
        == synthetic_trace(
            200, 10.0, prefix_groups=4, prefix_blocks=5, unique_blocks=2, block_size=8, output_len=7, seed=1
        ).requests
    )


def test_published_figures_flexlb() -> None:
    t = load_trace(TRACES / "trace_30min.jsonl.gz")
    assert len(t) == 8332 and t.format == "flexlb"
    assert sum(1 for r in t.requests if r.output_len == 0) == 2290
    assert round(100 * theoretical_hit_ratio(t), 2) == 22.31
    assert round(100 * theoretical_token_hit_ratio(t), 2) == 20.56


def test_published_figures_mooncake() -> None:
    t = load_trace(TRACES / "conversation_trace.jsonl.gz")
    assert len(t) == 12031 and t.format == "mooncake"
    assert round(t.span_ms) == 3_536_999
    assert round(100 * theoretical_hit_ratio(t), 2) == 36.64
    assert round(100 * theoretical_token_hit_ratio(t), 2) == 37.36
