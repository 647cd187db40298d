"""Ledger accounting: owed time runs from the batch's real start on the engine, a batch owes its
batch prediction (not the sum of its members' singles), in the owner's timeline model and in the
simulator's ledger."""

from __future__ import annotations

import pytest

from app.scheduling.accounting import EngineTimeline
from app.scheduling.batcher import BatcherConfig, Pending
from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig
from app.sim.polls import poll_owners
from app.traces import synthetic_trace


def test_timeline_anchors_a_queued_batch_behind_the_running_one() -> None:
    t = EngineTimeline(tolerance_ms=1.0)
    assert t.commit("a", 1000.0, 200.0) == 1000.0
    # dispatched 10 ms later while `a` runs: it starts when `a` ends, not at its dispatch
    assert t.commit("b", 1010.0, 300.0) == 1200.0
    assert t.accepted("b", 1, 1011.0) == []  # queued behind a: nothing moves
    # `a` ended early: `b` starts now
    assert t.finish("a", 1150.0) == [("b", 1150.0)]
    assert t.commit("c", 1160.0, 50.0) == 1450.0
    # the worker says `c` runs at once (b ended early and we have not heard yet)
    assert t.accepted("c", 0, 1300.0) == [("c", 1300.0)]
    assert t.finish("b", 1301.0) == []  # c already started
    assert t.finish("c", 1350.0) == []
    assert len(t) == 0 and t.free_at(2000.0) == 2000.0


def test_timeline_ignores_small_moves_and_forgets_uncommitted() -> None:
    t = EngineTimeline(tolerance_ms=5.0)
    t.commit("a", 0.0, 100.0)
    t.commit("b", 1.0, 100.0)
    assert t.finish("a", 98.0) == []  # 2 ms early: within tolerance, no ledger write
    t.forget("b")
    assert t.free_at(50.0) == 50.0


def _sim(batching_mode: str = "batch") -> ClusterSim:
    trace = synthetic_trace(
        4, 10.0, prefix_groups=1, prefix_blocks=2, unique_blocks=4, block_size=64, output_len=4, seed=1
    )
    cfg = SimConfig(prefill=1, decode=1, profile="fitted")
    return ClusterSim(trace, cfg, "cost", BatcherConfig(mode=batching_mode))


def test_sim_ledger_owes_batch_prediction_from_the_engine_start() -> None:
    sim = _sim()
    one = sim.formula.predict_batch([Pending("x", sim.trace.requests[0].input_len, 0, 0.0).item])
    trs = sim.trace.requests
    items = [Pending(f"r{i}", trs[i].input_len, 0, 0.0, one, i) for i in range(4)]
    sim.queue_items[0] += len(items)
    sim._dispatch(0, items[:2])  # runs at once
    sim._dispatch(0, items[2:])  # queued behind the first on the engine
    pred = sim.formula.predict_batch([items[0].item, items[1].item])
    single = items[0].predicted_ms
    assert pred < 2 * single  # the fixed per-batch cost counts once
    entries = list(sim.ledger[0].values())
    assert [e[0] for e in entries] == pytest.approx([pred, pred])
    sim.now = 10.0
    sim.p_dirty[0] = True
    poll_owners(sim)
    owed = sim.p_pub[0][5]
    # first batch started at 0 and has 10 ms behind it; the second has not started: owes it all
    started = entries[0][1]
    assert started == 0.0
    assert owed == pytest.approx((pred - 10.0) + pred, abs=1e-3)
