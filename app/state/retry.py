"""The bounded local retry queue for terminal writes (issue 14, DESIGN §13).

A terminal write — the origin's final round trip (release the decode hold, leave the live set,
the terminal lifecycle state), an owner's reply + settle, a cancel tombstone — must not be lost
because Redis blinked at that moment: a lost one leaks a hold, leaves a record non-terminal
forever, or hangs a request until its deadline. A write that fails with a transient error is
queued here and retried in order, with backoff, until Redis answers or the entry's TTL passes
(after which the reconciler repairs what it left; the `expired` counter says it happened).

Every write queued here must be safe to repeat (the first try may have applied before the
connection broke): releases, settlements and terminal transitions are idempotent by request /
batch id (app/state/store.py); a repeated reply is ignored by the origin (a reply names the
hand-off it answers, and a request waits for one reply per hand-off).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app import metrics as M
from app.cluster.loops import LoopHealth

log = logging.getLogger("flexlb.retry")

#: Failures that mean "Redis did not answer now", so the write is worth trying again: the
#: connection broke or timed out (BusyLoadingError while a restarted Redis loads its AOF is a
#: ConnectionError), a Sentinel-demoted master answers READONLY, a flushed server lost its scripts.
#: A script error, a bad argument or a programming error is not: retrying would fail the same way,
#: and would hold up every write queued behind it.
TRANSIENT: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    NoScriptError,
    OSError,
    TimeoutError,
)


@dataclass
class _Write:
    what: str  # for logs: "finish req-1", "reply req-1"
    run: Callable[[], Awaitable[Any]]
    expires: float  # monotonic


class TerminalWrites:
    """A FIFO of idempotent writes to retry; one background task drains it."""

    def __init__(
        self, loops: LoopHealth | None = None, *, max_len: int = 10_000, ttl_s: float = 600.0
    ) -> None:
        self.loops = loops or LoopHealth()
        self.max_len = max_len
        self.ttl_s = ttl_s
        self._q: deque[_Write] = deque()
        self._names: dict[str, int] = {}  # what → queued count, for `pending`
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def __len__(self) -> int:
        return len(self._q)

    def pending(self, what: str) -> bool:
        """A write of this name waits in the queue (its effect is still to come)."""
        return what in self._names

    def _forget(self, w: _Write) -> None:
        n = self._names.get(w.what, 0) - 1
        if n > 0:
            self._names[w.what] = n
        else:
            self._names.pop(w.what, None)

    async def run_or_queue(
        self, what: str, run: Callable[[], Awaitable[Any]], ttl_s: float | None = None
    ) -> bool:
        """Try the write now; on a transient failure queue it. True when it applied now."""
        try:
            await run()
            return True
        except TRANSIENT as exc:
            self.add(what, run, ttl_s, exc)
            return False

    def add(
        self,
        what: str,
        run: Callable[[], Awaitable[Any]],
        ttl_s: float | None = None,
        exc: BaseException | None = None,
    ) -> None:
        if len(self._q) >= self.max_len:
            # Bounded: the oldest goes (its TTL is the nearest); the reconciler repairs it.
            old = self._q.popleft()
            self._forget(old)
            M.TERMINAL_WRITES.labels("dropped_full").inc()
            log.error("terminal write queue full (%d): dropped %s", self.max_len, old.what)
        self._q.append(_Write(what, run, time.monotonic() + (self.ttl_s if ttl_s is None else ttl_s)))
        self._names[what] = self._names.get(what, 0) + 1
        M.TERMINAL_WRITES.labels("queued").inc()
        log.warning("terminal write %s failed (%r): queued for retry", what, exc)
        self._wake.set()
        if self._task is None or self._task.done():
            self.start()

    def start(self) -> None:
        if self._stopping:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="terminal-writes")
        except RuntimeError:  # no running loop (sync caller in a test): drained by flush()
            return
        self.loops.watch(self._task, "terminal_writes")

    async def flush(self) -> int:
        """Try every queued write once, in order; stop at the first transient failure (Redis is
        still away, the rest would fail too). Returns how many are left."""
        while self._q:
            w = self._q[0]
            if time.monotonic() > w.expires:
                self._forget(self._q.popleft())
                M.TERMINAL_WRITES.labels("expired").inc()
                log.error("terminal write %s expired unapplied; the reconciler repairs it", w.what)
                continue
            try:
                await w.run()
            except TRANSIENT as exc:
                await self.loops.failed("terminal_writes", exc)
                return len(self._q)
            except Exception:
                # Not Redis being away: the write itself fails (a script error, a bug), so a retry
                # would fail the same way, and left at the head it would stall every write behind
                # it (the drain task used to die here). It goes, counted and logged with its
                # traceback; the reconciler repairs what it would have written, as for `expired`.
                self._forget(self._q.popleft())
                M.TERMINAL_WRITES.labels("failed").inc()
                log.exception("terminal write %s failed for good; dropped, the reconciler repairs it", w.what)
                continue
            self._forget(self._q.popleft())
            M.TERMINAL_WRITES.labels("applied").inc()
            self.loops.ok("terminal_writes")
        return 0

    async def _run(self) -> None:
        while not self._stopping:
            if not self._q:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self.flush()

    async def stop(self, deadline_s: float = 2.0) -> None:
        """Give queued writes a last bounded chance, then stop."""
        end = time.monotonic() + deadline_s
        while self._q and time.monotonic() < end:
            await asyncio.sleep(0.05)
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
        if self._q:
            log.error("stopping with %d terminal writes unapplied", len(self._q))
