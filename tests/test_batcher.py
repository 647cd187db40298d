"""The batcher's decisions on a virtual clock (pure code, no I/O)."""

from __future__ import annotations

import pytest

from app.scheduling.batcher import Batcher, BatcherConfig, Pending
from app.scheduling.formula import compile_formula

F = compile_formula("10 + sum(0.01*computeTokens)")


def mk(cfg: BatcherConfig | None = None, **kw) -> Batcher:
    return Batcher(cfg or BatcherConfig(**kw), F.predict_batch)


def item(i: int, n: int = 1000, t: float = 0.0, hit: int = 0) -> Pending:
    return Pending(f"r{i}", n, hit, t, F.predict_one(n, hit))


def test_idle_worker_flushes_a_lone_item_at_once() -> None:
    b = mk()
    b.add(item(0))
    d = b.decide(0.0)
    assert d.reason == "idle" and [p.id for p in d.items] == ["r0"]


def test_busy_worker_accumulates_until_full_or_timeout() -> None:
    b = mk(algorithm="fixed_window", max_size=4, wait_ms=30)
    b.batch_started()  # something in flight: the worker is busy
    for i in range(3):
        b.add(item(i, t=float(i)))
    d = b.decide(5.0)
    assert not d.items and d.wake_at_ms == pytest.approx(30.0)
    b.add(item(3, t=6.0))
    d = b.decide(6.0)
    assert d.reason == "full" and len(d.items) == 4
    b.add(item(4, t=10.0))
    assert not b.decide(39.0).items
    d = b.decide(40.0)
    assert d.reason == "timeout" and [p.id for p in d.items] == ["r4"]


def test_predict_threshold_flushes_early() -> None:
    b = mk(algorithm="fixed_window", max_size=16, wait_ms=1000, predict_threshold_ms=40)
    b.batch_started()
    b.add(item(0, n=1000))  # 10 + 10 = 20 ms
    assert not b.decide(1.0).items
    b.add(item(1, n=2000))  # 10 + 30 = 40 ms
    d = b.decide(2.0)
    assert d.reason == "predict_threshold" and len(d.items) == 2


def test_never_more_than_max_inflight() -> None:
    b = mk(max_inflight_batches=2, max_size=1)
    for i in range(5):
        b.add(item(i))
    sent = 0
    while b.decide(0.0).items:
        b.batch_started()
        sent += 1
    assert sent == 2 and b.inflight == 2
    b.batch_finished()
    assert len(b.decide(1.0).items) == 1


def test_skip_not_block_and_impossible_items_fail_at_once() -> None:
    b = mk(max_size=8, max_batch_tokens=3000)
    b.add(item(0, n=2500))
    b.add(item(1, n=2000))  # does not fit beside r0: skipped, not blocking r2
    b.add(item(2, n=400))
    b.add(item(3, n=5000))  # can never fit
    d = b.decide(0.0)
    assert [p.id for p in d.items] == ["r0", "r2"]
    assert [(p.id, code) for p, code in d.failed] == [("r3", "too_long")]
    assert [p.id for p in b.pending] == ["r1"]


def test_direct_mode_is_batches_of_one() -> None:
    b = mk(mode="direct")
    for i in range(3):
        b.add(item(i))
    d = b.decide(0.0)
    assert d.reason == "direct" and len(d.items) == 1


def test_slo_orders_by_deadline_and_fails_expired() -> None:
    b = mk(algorithm="slo", slo_ttft_ms=100, guard_ms=5, max_size=8)
    b.batch_started()
    b.add(item(0, n=1000, t=0.0))  # predicted 20 → deadline 80
    b.add(item(1, n=100, t=10.0))  # predicted 11 → deadline 99
    d = b.decide(50.0)
    assert not d.items and d.wake_at_ms == pytest.approx(75.0)
    d = b.decide(76.0)
    assert d.reason == "deadline" and d.items[0].id == "r0"
    b2 = mk(algorithm="slo", slo_ttft_ms=100)
    b2.add(item(9, t=0.0))
    d = b2.decide(150.0)
    assert [(p.id, c) for p, c in d.failed] == [("r9", "deadline_exceeded")]


def test_knobs_are_modelled_ms_scaled_by_time_scale() -> None:
    c = BatcherConfig(wait_ms=30, predict_threshold_ms=100, slo_ttft_ms=2000).scaled(0.1)
    assert (c.wait_ms, c.predict_threshold_ms, c.slo_ttft_ms) == pytest.approx((3.0, 10.0, 200.0))


@pytest.mark.parametrize(
    "bad",
    [{"algorithm": "fifo"}, {"mode": "x"}, {"max_size": 0}, {"wait_ms": -1}, {"max_inflight_batches": 0}],
)
def test_bad_config_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        BatcherConfig(**bad).validate()
