"""Where the owner's batches start on the engine, for the ledger's owed time (pure, no clock).

The ledger owes each committed batch's predicted time counted from its *start on the engine*
(app/state/store.py `commit_batch` / `owed_ms`). The engine runs batches one at a time in FIFO
order, and the owner keeps up to `max_inflight_batches` of them on the worker, so a batch
dispatched while another runs starts only when that one ends. Anchoring it at its dispatch (as
before) had the published owed time run down while the batch was still waiting: the load every
replica routes on read well below the real backlog exactly when the worker was busiest.

`EngineTimeline` is the owner's model of its worker's FIFO. At commit a batch is anchored at the
predicted end of the batches ahead of it; when the worker answers `accepted` at queue position 0
the batch has started *now*; when a batch ends, the next one starts now. Each of those facts that
moves an anchor by more than `tolerance_ms` comes back as a (batch id, new start) to write to the
ledger. All times are in the driver's clock (wall ms for the live owner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineTimeline"]


@dataclass
class _Entry:
    start_ms: float
    duration_ms: float
    started: bool = False


@dataclass
class EngineTimeline:
    tolerance_ms: float = 5.0
    _batches: dict[str, _Entry] = field(default_factory=dict)  # in dispatch (= engine FIFO) order

    def free_at(self, now_ms: float) -> float:
        """When the engine is predicted to have finished every batch we gave it."""
        end = now_ms
        for e in self._batches.values():
            end = max(end, e.start_ms + e.duration_ms)
        return end

    def commit(self, batch_id: str, now_ms: float, duration_ms: float) -> float:
        """Anchor a new batch behind ours still on the engine; returns its predicted start."""
        start = self.free_at(now_ms)
        self._batches[batch_id] = _Entry(start, max(0.0, duration_ms), started=start <= now_ms)
        return start

    def accepted(self, batch_id: str, queue_position: int, now_ms: float) -> list[tuple[str, float]]:
        """The worker took the batch; position 0 means it runs now (earlier ones ended early)."""
        e = self._batches.get(batch_id)
        if e is None or queue_position != 0 or e.started:
            return []
        return self._start(batch_id, now_ms)

    def finish(self, batch_id: str, now_ms: float) -> list[tuple[str, float]]:
        """The batch ended (answered or failed): the next one of ours starts now."""
        if self._batches.pop(batch_id, None) is None:
            return []
        nxt = next((b for b, e in self._batches.items() if not e.started), None)
        return self._start(nxt, now_ms) if nxt is not None else []

    def forget(self, batch_id: str) -> None:
        """A batch that never reached the engine (fenced out, nothing kept)."""
        self._batches.pop(batch_id, None)

    def _start(self, batch_id: str, now_ms: float) -> list[tuple[str, float]]:
        """Mark `batch_id` started at `now_ms` and move the anchors of the batches behind it."""
        moves: list[tuple[str, float]] = []
        at = now_ms
        seen = False
        for bid, e in self._batches.items():
            if bid == batch_id:
                seen = True
                e.started = True
            elif not seen or e.started:
                continue
            if abs(e.start_ms - at) > self.tolerance_ms:
                moves.append((bid, at))
            e.start_ms = at
            at += e.duration_ms
        return moves

    def __len__(self) -> int:
        return len(self._batches)
