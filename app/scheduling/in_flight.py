"""This origin's hand-offs whose round trip has not answered yet, per prefill worker.

Why: an origin ranks and admits on the queued ms its last hand-off's answer read (the overlay,
`routing.current_loads`). Under a burst, hand-offs overlap: B is sent while A's round trip is
out, then A's answer arrives and says the queue is A's length, without B. Taking that answer as
the queue dropped B (and every later hand-off sent before it) from this origin's view until B's
own answer came back, and a request routed in that window was admitted against a backlog missing
them: test_overload_live's burst admitted 7 requests where 6 fit the SLO, in two CI runs on a
loaded box. The fix keeps what was sent apart from what was answered: views add the hand-offs
still in flight to whichever queued time they start from (overlay or snapshot).

An answer may already include a hand-off that is still in flight here (its script ran first,
its answer is not read yet): that one is counted twice until its answer is read. That errs
towards refusing, for one round trip; counting it zero times erred towards admitting past the
deadline.

Pure: no I/O, no clock. The simulator's hand-off script answers at once, so it has none."""

from __future__ import annotations

__all__ = ["HandoffsInFlight"]


class HandoffsInFlight:
    def __init__(self) -> None:
        self._by_worker: dict[str, dict[int, float]] = {}
        self._next = 0

    def sent(self, wid: str, predicted_ms: float) -> int:
        """A hand-off of ``predicted_ms`` to ``wid`` goes out; the token ends it (`answered`)."""
        self._next += 1
        self._by_worker.setdefault(wid, {})[self._next] = predicted_ms
        return self._next

    def answered(self, wid: str, token: int) -> None:
        """Its round trip answered, failed or was cancelled: from now on the answer (or nothing)
        stands for it. Idempotent."""
        pending = self._by_worker.get(wid)
        if pending is not None:
            pending.pop(token, None)
            if not pending:
                del self._by_worker[wid]

    def ms(self, wid: str) -> float:
        """Predicted ms of ``wid``'s hand-offs still in flight from this origin."""
        pending = self._by_worker.get(wid)
        return sum(pending.values()) if pending else 0.0

    def count(self, wid: str) -> int:
        return len(self._by_worker.get(wid, ()))
