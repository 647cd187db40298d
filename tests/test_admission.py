"""SLO admission (pure decision) and the batcher's predicted-time window and deadline drop."""

from __future__ import annotations

import pytest

from app.scheduling.admission import (
    IDLE_EPS_MS,
    AdmissionConfig,
    decide,
    expected_batch_wait_ms,
    fits_on_live,
    max_backlog_ms,
    pick_within,
    predicted_ttft_ms,
)
from app.scheduling.batcher import Batcher, BatcherConfig, Pending
from app.scheduling.formula import BatchItem
from app.scheduling.routing import WorkerView


def view(owed: float = 0.0, queued: float = 0.0) -> WorkerView:
    return WorkerView(id="prefill-0", role="prefill", up=True, owed_ms=owed, queued_ms=queued)


def test_predicted_ttft_is_backlog_plus_wait_plus_own_prefill_scaled() -> None:
    assert predicted_ttft_ms(view(1000, 500), 200, 30) == pytest.approx(1730)
    assert predicted_ttft_ms(view(1000, 500), 200, 30, time_scale=0.1) == pytest.approx(173)


def test_admit_within_budget_refuse_beyond_with_retry_after() -> None:
    cfg = AdmissionConfig(slack=0.0)
    ok = decide(cfg, view(2000, 500), 400, 3000)
    assert ok.admit and ok.predicted_ms == pytest.approx(2900)
    no = decide(cfg, view(4000, 1500), 400, 3000)
    assert not no.admit and no.reason == "slo_unattainable"
    assert no.retry_after_s == pytest.approx(2.9)  # the backlog's excess over the budget
    assert decide(cfg, view(), 10, 0).admit is False  # already late: nothing can meet it
    # slack admits borderline predictions; off admits everything
    assert decide(AdmissionConfig(slack=0.5), view(3000, 500), 400, 3000).admit
    assert decide(AdmissionConfig(mode="off"), view(1e9), 400, 3000).admit
    with pytest.raises(ValueError):
        AdmissionConfig(mode="maybe").validate()


def test_a_prompt_whose_own_prefill_exceeds_the_cluster_slo_runs_on_an_idle_worker() -> None:
    """A 100K-token prompt's own prefill (~7.8 s on the default profile) exceeds the 3 s cluster
    SLO on an idle worker: refusing it 429 "retry later" refused it forever, whatever the load.
    Held to the cluster SLO, its own prefill counts as the whole budget: admitted when nothing
    waits ahead of it, refused with Retry-After = the backlog's drain time while something does.
    A deadline the client set itself is still held as it is."""
    cfg = AdmissionConfig()  # the default headroom (slack -0.15)
    idle = decide(cfg, view(), 7800, 3000, explicit=False)
    assert idle.admit and idle.predicted_ms == pytest.approx(7800)
    busy = decide(cfg, view(2000, 900), 7800, 3000, explicit=False)
    assert not busy.admit and busy.reason == "slo_unattainable"
    assert busy.retry_after_s == pytest.approx(2.9)  # until the 2.9 s ahead of it has drained
    assert decide(cfg, view(), 7800, 3000, batch_wait_ms=30, explicit=False).admit is False
    assert decide(cfg, view(), 7800, 3000, time_scale=0.1, explicit=False).admit  # 780 wall ms
    assert not decide(cfg, view(), 7800, 0, explicit=False).admit  # already late
    # a prompt that fits the SLO by itself is judged as before, backlog and own prefill together
    assert decide(cfg, view(1000, 500), 1000, 3000, explicit=False).admit
    # a client's own deadline shorter than the prompt's prefill alone: no retry can meet it
    short = decide(cfg, view(), 7800, 3000, explicit=True)
    assert not short.admit and short.reason == "deadline_too_short" and short.retry_after_s == 0
    # one its prefill fits, missed only for the backlog ahead: retry later, as before
    later = decide(cfg, view(4000, 0), 1000, 3000, explicit=True)
    assert not later.admit and later.reason == "slo_unattainable" and later.retry_after_s > 0
    assert not decide(cfg, view(1000, 600), 1000, 3000, explicit=False).admit
    # the client's own deadline: unattainable is unattainable; admission off admits all
    assert not decide(cfg, view(), 7800, 3000, explicit=True).admit
    assert decide(AdmissionConfig(mode="off"), view(9000), 7800, 3000, explicit=False).admit


def test_an_over_slo_prompt_is_admitted_only_if_the_worker_is_idle_on_the_live_state() -> None:
    """The snapshot a verdict reads may be stale (another replica just handed a long prompt or
    short ones to the same worker): an over-SLO prompt's admission says `require_idle`, and the
    hand-off (live: its script, atomically with queueing it; sim: the exact state) confirms the
    worker idle on the live queued + owed ms with `fits_on_live`, or refuses it with Retry-After
    that live backlog's drain time. Every other admission is checked there against its own
    allowance (`test_every_admission_is_checked_on_the_live_backlog`)."""
    cfg = AdmissionConfig()
    idle = decide(cfg, view(), 7800, 3000, explicit=False)
    assert idle.admit and idle.require_idle
    assert fits_on_live(cfg, idle, 0.0, 0.0) == idle
    assert fits_on_live(cfg, idle, IDLE_EPS_MS, 0.0) == idle  # the counter's text residue
    busy = fits_on_live(cfg, idle, 7800.0, 1200.0)  # another origin's long prompt got there first
    assert not busy.admit and busy.reason == "slo_unattainable" and not busy.require_idle
    assert busy.retry_after_s == pytest.approx(9.0)  # the live backlog's drain time
    assert busy.predicted_ms == pytest.approx(7800 + 9000)
    scaled = decide(cfg, view(), 7800, 500, time_scale=0.1, explicit=False)  # 780 wall ms > 500
    assert scaled.admit and scaled.require_idle
    assert fits_on_live(cfg, scaled, 20000.0, 0.0, time_scale=0.1).retry_after_s == pytest.approx(2.0)
    assert fits_on_live(cfg, scaled, 1.0, 0.0, time_scale=0.1).retry_after_s == cfg.retry_after_s  # floor
    # requests that fit the SLO, or carry their own deadline, never ask for an idle worker: they
    # carry the live backlog they still fit behind (3000 x 0.85 - 1000 = 1550 ms)
    fits = decide(cfg, view(1000, 500), 1000, 3000, explicit=False)
    assert fits.admit and not fits.require_idle
    assert fits.max_backlog_ms == pytest.approx(1550.0)
    assert fits_on_live(cfg, fits, 1000.0, 550.0) == fits
    late = fits_on_live(cfg, fits, 5000.0, 5000.0)
    assert not late.admit and late.reason == "slo_unattainable"
    assert late.retry_after_s == pytest.approx((10000 - 1550) / 1000)
    assert not decide(cfg, view(), 1000, 3000, explicit=True).require_idle
    assert not decide(AdmissionConfig(mode="off"), view(), 7800, 3000, explicit=False).require_idle


def test_every_admission_is_checked_on_the_live_backlog() -> None:
    """Replicas bursting at one worker each admit on a view that lacks the others' hand-offs:
    every admission carries the largest live backlog at which it still fits its budget
    (`max_backlog_ms`: budget x (1 + slack) / time scale - batcher window - own prefill, the
    inverse of `decide`), and `fits_on_live` refuses it beyond that, Retry-After the time the
    backlog needs to fall back within it (at least the floor)."""
    cfg = AdmissionConfig()  # slack -0.15
    v = decide(cfg, view(), 600, 3000, explicit=False, batch_wait_ms=0.0, window_ms=40.0)
    assert v.admit and v.max_backlog_ms == pytest.approx(3000 * 0.85 - 40 - 600)
    # the decision and the allowance are the same inequality: a view just within it is admitted
    edge = v.max_backlog_ms or 0.0
    assert decide(cfg, view(edge, 0.0), 600, 3000, explicit=False, batch_wait_ms=40.0).admit
    assert not decide(cfg, view(edge + 1.0, 0.0), 600, 3000, explicit=False, batch_wait_ms=40.0).admit
    assert fits_on_live(cfg, v, edge - 100.0, 100.0) == v
    over = fits_on_live(cfg, v, edge + 2500.0, 0.0)
    assert not over.admit and over.reason == "slo_unattainable" and over.retry_after_s == pytest.approx(2.5)
    assert fits_on_live(cfg, v, edge + 10.0, 0.0).retry_after_s == cfg.retry_after_s  # the floor
    # time scale: the budget is wall ms, the backlog modelled ms (10 wall ms per modelled ms)
    assert max_backlog_ms(cfg, 60, 3000, time_scale=10.0) == pytest.approx(3000 * 0.85 / 10 - 60)
    # fits only without the batcher's window: an idle worker dispatches at once
    assert max_backlog_ms(cfg, 2540, 3000, window_ms=40.0) == IDLE_EPS_MS
    # longer than the budget: only an idle worker (the cluster SLO), none (the client's deadline)
    assert max_backlog_ms(cfg, 7800, 3000) == IDLE_EPS_MS
    assert max_backlog_ms(cfg, 7800, 3000, explicit=True) < 0
    assert max_backlog_ms(cfg, 100, 0) < 0
    # admission off: nothing to check
    off = decide(AdmissionConfig(mode="off"), view(9000), 600, 3000)
    assert off.max_backlog_ms is None and fits_on_live(cfg, off, 1e9, 0.0) == off


def test_the_fresh_pick_takes_the_candidate_whose_allowance_fits() -> None:
    """`HANDOFF_PICK`'s rule (the script and the simulator): the ranking's winner when its live
    backlog is within its own allowance; else the other when it is within its own and its queue
    is not full; else none (429 slo_unattainable, nothing written)."""
    assert pick_within(0, (100.0, 0.0), (500.0, 500.0), (False, False)) == 0
    assert pick_within(0, (900.0, 0.0), (500.0, 500.0), (False, False)) == 1
    assert pick_within(1, (0.0, 900.0), (500.0, 500.0), (False, False)) == 0
    assert pick_within(0, (900.0, 400.0), (500.0, 300.0), (False, False)) is None  # own allowances
    assert pick_within(0, (900.0, 0.0), (500.0, 500.0), (False, True)) is None  # the other is full
    assert pick_within(0, (900.0, 0.0), (None, None), (False, False)) == 0  # no check


def test_batch_wait_only_counts_for_a_busy_windowed_worker() -> None:
    assert expected_batch_wait_ms(view(), 30, True) == 0.0
    assert expected_batch_wait_ms(view(10), 30, True) == 30.0
    assert expected_batch_wait_ms(view(10), 30, False) == 0.0


def _predict(items: list[BatchItem]) -> float:
    return 100.0 + sum(i.input_tokens - i.hit_tokens for i in items) * 0.1  # 100 ms per batch


def test_window_is_work_conserving_and_batches_what_accumulates_while_full() -> None:
    b = Batcher(BatcherConfig(algorithm="window", max_inflight_batches=1), _predict)
    b.add(Pending("a", 100, 0, 0.0))
    d = b.decide(0.0)
    assert [p.id for p in d.items] == ["a"] and d.reason == "idle"  # idle worker: at once
    b.batch_started(d.items, 0.0)  # predicted 110 ms on the engine
    b.add(Pending("b", 100, 0, 10.0))
    b.add(Pending("c", 100, 0, 20.0))
    assert not b.decide(20.0).items  # the worker is full: they accumulate (no timer needed)
    b.batch_finished(90.0)  # `a` ended early: b and c go now, as one batch (it pays)
    d = b.decide(90.0)
    assert [p.id for p in d.items] == ["b", "c"] and d.reason == "idle"
    b.batch_started(d.items, 90.0)
    assert b.busy_until(100.0) == pytest.approx(90.0 + 120.0)
    # behind a busy worker with room for another batch, an item goes at once (never held back)
    b = Batcher(BatcherConfig(algorithm="window", max_inflight_batches=2), _predict)
    b.batch_started([Pending("x", 100, 0, 0.0)], 0.0)
    b.add(Pending("y", 100, 0, 1.0))
    d = b.decide(1.0)
    assert [p.id for p in d.items] == ["y"] and d.reason == "window"


def test_window_caps_the_batch_by_its_members_deadlines_and_drops_the_late() -> None:
    b = Batcher(BatcherConfig(algorithm="window", guard_ms=0.0), _predict)
    b.add(Pending("a", 1000, 0, 0.0))
    b.batch_started(b.decide(0.0).items, 0.0)  # busy until 200: x's batch starts then
    # x's deadline (345) fits x+y (ends 200 + 100 + 40 = 340), not x+y+z (ends 350)
    b.add(Pending("x", 200, 0, 1.0, deadline_ms=345.0))
    b.add(Pending("y", 200, 0, 2.0, deadline_ms=5000.0))
    b.add(Pending("z", 100, 0, 3.0, deadline_ms=5000.0))
    d = b.decide(200.0)
    assert [p.id for p in d.items] == ["x", "y"]
    # a queued item whose deadline passed ends typed instead of running
    b.add(Pending("late", 1000, 0, 4.0, deadline_ms=250.0, drop_late=True))
    b.add(Pending("kept", 1000, 0, 4.0, deadline_ms=250.0))  # held to the SLO, not dropped: it runs
    d = b.decide(300.0)
    assert [(p.id, code) for p, code in d.failed] == [("late", "deadline_exceeded")]
    assert "kept" in [p.id for p in b.pending] + [p.id for p in d.items]


def test_fixed_window_timer_fires_at_its_own_wake_time() -> None:
    # 0.1 + 0.2 != 0.3 in floats: deciding at the returned wake time must flush, or a driver that
    # sleeps until exactly then (the simulator) would spin on the same instant forever.
    b = Batcher(BatcherConfig(algorithm="fixed_window", wait_ms=0.2), _predict)
    b.add(Pending("a", 10, 0, 0.0))
    b.batch_started(b.decide(0.0).items, 0.0)
    b.add(Pending("b", 10, 0, 0.1))
    d = b.decide(0.1)
    assert not d.items and d.wake_at_ms is not None
    d = b.decide(d.wake_at_ms)
    assert [p.id for p in d.items] == ["b"] and d.reason == "timeout"


def test_window_batches_only_what_pays() -> None:
    # Long prompts share little (100 ms fixed vs 200 ms each): a batch would make the first wait
    # for all of them, so they go one at a time; short ones share the fixed cost and batch.
    b = Batcher(BatcherConfig(algorithm="window", guard_ms=0.0), _predict)
    b.add(Pending("a", 10, 0, 0.0))
    b.batch_started(b.decide(0.0).items, 0.0)
    for i in range(3):
        b.add(Pending(f"long{i}", 2000, 0, 1.0))
    assert [p.id for p in b.decide(101.0).items] == ["long0"]
    b = Batcher(BatcherConfig(algorithm="window", guard_ms=0.0), _predict)
    b.add(Pending("a", 10, 0, 0.0))
    b.batch_started(b.decide(0.0).items, 0.0)
    for i in range(3):
        b.add(Pending(f"short{i}", 100, 0, 1.0))
    assert [p.id for p in b.decide(101.0).items] == ["short0", "short1", "short2"]


def test_output_reservation_learns_mean_or_percentile_capped_by_max() -> None:
    from app.scheduling.reserve import OutputLengthEstimator

    est = OutputLengthEstimator("p90", min_samples=10)
    assert est.reserve(500) == 500  # nothing learned yet: the maximum
    for n in range(1, 101):
        est.observe(n)
    assert est.reserve(500) == 90 and est.reserve(40) == 40
    mean = OutputLengthEstimator("mean", min_samples=10)
    for n in range(1, 101):
        mean.observe(n)
    assert mean.reserve(500) == 51  # ceil(50.5)
    assert OutputLengthEstimator("max").reserve(500) == 500
    with pytest.raises(ValueError):
        OutputLengthEstimator("p0")


def test_a_full_worker_wakes_the_batcher_at_the_first_droppable_deadline() -> None:
    b = Batcher(BatcherConfig(algorithm="window", max_inflight_batches=1), _predict)
    b.batch_started([Pending("x", 100, 0, 0.0)], 0.0)
    b.add(Pending("soon", 100, 0, 1.0, deadline_ms=50.0, drop_late=True))
    b.add(Pending("capped", 100, 0, 1.0, deadline_ms=20.0))  # not droppable: no timer for it
    d = b.decide(1.0)
    assert not d.items and d.wake_at_ms == 50.0
    d = b.decide(50.5)
    assert [(p.id, code) for p, code in d.failed] == [("soon", "deadline_exceeded")]
