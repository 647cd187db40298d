"""One shared way for background loops to fail: log the first failure and the recovery, count
every failure (`flexlb_loop_errors_total{loop}`), back off exponentially with jitter up to a cap,
and tell `/readyz` which loop cannot run (issue 14, DESIGN §13 "No silent loop death").

Each loop keeps its own shape (a poll period, a blocking read, a wake event); what it shares is
`LoopHealth`: `ok(name)` after a good iteration, `await failed(name, exc)` after a bad one (it
sleeps the backoff), and `watch(task, name)` so a loop task that ends by an unexpected exception
is reported instead of vanishing as "Task exception was never retrieved".
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from app import metrics as M

log = logging.getLogger("flexlb.loops")


@dataclass
class _State:
    failures: int = 0  # consecutive
    since: float = 0.0  # monotonic time of the first failure of this run
    last_error: str = ""
    dead: bool = False  # the task ended by an exception (watch)


class Backoff:
    """Capped exponential backoff with full jitter: attempt n waits U(base·2ⁿ/2, base·2ⁿ), ≤ cap.

    Half-jitter (not 0..x): a retry storm spreads out, yet a loop never spins at 0 s."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        top = min(self.cap_s, self.base_s * (2 ** min(attempt, 30)))
        return self.rng.uniform(top / 2, top)


class LoopHealth:
    """Per-replica registry of its background loops' health.

    A loop is "not running" (and named by `problems()`, hence `/readyz`) when it failed
    `unready_after` times in a row *and* has been failing for at least `unready_after_s`, or when
    its task died. One success clears it. Thresholds are loose on purpose: a single Redis blip
    must not flap readiness, a Redis that is gone for seconds must.
    """

    def __init__(
        self,
        *,
        backoff: Backoff | None = None,
        unready_after: int = 3,
        unready_after_s: float = 2.0,
    ) -> None:
        self.backoff = backoff or Backoff()
        self.unready_after = unready_after
        self.unready_after_s = unready_after_s
        self._loops: dict[str, _State] = {}

    def ok(self, name: str) -> None:
        st = self._loops.get(name)
        if st is None or (st.failures == 0 and not st.dead):
            return
        log.info(
            "loop %s recovered after %d failures in %.1f s",
            name,
            st.failures,
            time.monotonic() - st.since,
            extra={"event": "loop_recovered", "loop": name},
        )
        st.failures, st.dead, st.last_error = 0, False, ""

    def record(self, name: str, exc: BaseException) -> float:
        """Count one failure and return the backoff to wait before the next try (no sleep)."""
        st = self._loops.setdefault(name, _State())
        if st.failures == 0:
            st.since = time.monotonic()
            log.warning(
                "loop %s failing: %r (retrying with backoff)",
                name,
                exc,
                extra={"event": "loop_failing", "loop": name},
            )
        else:
            log.debug("loop %s failed again (%d): %r", name, st.failures + 1, exc)
        st.failures += 1
        st.last_error = f"{type(exc).__name__}: {exc}"[:200]
        M.LOOP_ERRORS.labels(_metric_label(name)).inc()
        return self.backoff.delay(st.failures - 1)

    async def failed(self, name: str, exc: BaseException) -> None:
        """`record` then sleep the backoff."""
        await asyncio.sleep(self.record(name, exc))

    def watch(self, task: asyncio.Task[object], name: str) -> None:
        """Report a loop task that ended by an exception (it should never: loops catch and retry)."""

        def done(t: asyncio.Task[object]) -> None:
            if t.cancelled():
                return
            exc = t.exception()
            if exc is None:
                return
            st = self._loops.setdefault(name, _State())
            st.dead, st.last_error = True, f"{type(exc).__name__}: {exc}"[:200]
            st.since = st.since or time.monotonic()
            M.LOOP_ERRORS.labels(_metric_label(name)).inc()
            log.error("loop %s died: %r", name, exc, exc_info=exc, extra={"event": "loop_died", "loop": name})

        task.add_done_callback(done)

    def forget(self, name: str) -> None:
        """The loop was stopped on purpose (a lease moved): it no longer counts for readiness."""
        self._loops.pop(name, None)

    def failures(self, name: str) -> int:
        st = self._loops.get(name)
        return st.failures if st else 0

    def problems(self) -> list[str]:
        """One line per loop that cannot run, for `/readyz`."""
        now = time.monotonic()
        out = []
        for name, st in sorted(self._loops.items()):
            if st.dead:
                out.append(f"loop {name} died: {st.last_error}")
            elif st.failures >= self.unready_after and now - st.since >= self.unready_after_s:
                out.append(f"loop {name} failing for {now - st.since:.1f} s: {st.last_error}")
        return out


def _metric_label(name: str) -> str:
    """Loop names may carry an instance (`poller:prefill@h:1`); the metric label is the kind only,
    so its cardinality stays bounded."""
    return name.split(":", 1)[0]
