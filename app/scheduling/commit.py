"""The owner's commit step and the ledger arithmetic, shared by the live owner and the simulator.

The live owner (`app/dispatch/owner.py`) asks its batcher what to dispatch, counts a released batch
in flight at once (so the next decision already sees it, before the commit's round trip), commits it
to the fenced ledger with its predicted ms, and the owner's poller (`app/cluster/poller.py`)
publishes the worker's owed ms from that ledger. The simulator (`app/sim/cluster.py`) makes the same
three steps on its virtual clock through these functions, so a simulated owner batches and accounts
exactly as a live one. Pure: time is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from app.scheduling.batcher import Batcher, Decision

__all__ = ["commit_step", "committed_ms", "owed_ms"]


class _Predicted(Protocol):
    predicted_ms: float


def commit_step(batcher: Batcher, now_ms: float) -> Decision:
    """The batcher's decision at ``now_ms``; a released batch is counted in flight before returning
    (the caller dispatches ``items``, refuses ``failed`` and, when nothing was released, waits until
    ``wake_at_ms`` or new work)."""
    d = batcher.decide(now_ms)
    if d.items:
        batcher.batch_started(d.items, now_ms)  # its predicted end: where the next batch starts
    return d


def committed_ms(items: Iterable[_Predicted]) -> float:
    """The sum of a batch's members' predicted ms: what their hand-offs added to the worker's
    queued ms, and what the commit takes off it. The ledger entry itself is the batch's own
    prediction (`Formula.predict_batch`): one forward pass pays the per-batch cost once."""
    return sum(i.predicted_ms for i in items)


def owed_ms(batches: Iterable[tuple[float, float]], now_ms: float, time_scale: float = 1.0) -> float:
    """Predicted ms a worker still owes for its committed batches, (predicted ms, start ms) each.

    A batch owes ``max(0, predicted − elapsed)``, elapsed counted from its start in modelled time
    (wall elapsed ÷ ``time_scale``); one not started yet owes its whole prediction. A batch owes its
    whole time until its last member settles: it is one forward pass, and settling some members
    early does not make the pass shorter."""
    scale = max(time_scale, 1e-9)
    owed = 0.0
    for predicted, start in batches:
        elapsed = max(0.0, now_ms - start) / scale
        owed += max(0.0, predicted - elapsed)
    return owed
