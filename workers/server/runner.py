"""Drives a pure engine core in real time on one engine thread.

Triton's async infer functions never touch the core directly: they `call()` a function that
runs on the engine thread (so the core needs no locks) and `subscribe()` to the effects for their
batch or request, which arrive on their own asyncio loop. The modelled clock is wall time divided
by `time_scale`, so every modelled duration takes `time_scale` times as long in reality while the
core and every reported timestamp stay in modelled milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger("flexlb.worker.runner")
T = TypeVar("T")

# How long a core's deferred work (`advance_early`: a completed prefill batch's cache inserts, only
# when no batch waits for them) waits while the thread sleeps: long enough for the results, routed
# first, to leave this process and its stub without that work taking the GIL or a core from them
# (~2-5 ms on a loaded 2-core box; at 2 ms the work still met the results' ZMQ send). Nothing
# observes the wait: a command arriving meanwhile settles first, at the completion's modelled time.
SETTLE_S = 0.005


class Core(Protocol):
    def advance_to(self, t: float) -> list[Any]: ...
    def next_event_time(self) -> float | None: ...


class Subscriber:
    """Receives effects on the subscriber's event loop; bounded only by the work it asked for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.last_seen = time.monotonic()

    def push(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: the consumer is gone
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def push_many(self, items: list[Any]) -> None:
        """Items queued by one callback: the consumer wakes with all of them there, so it can see
        that a batch's last results are followed by `final` and send both as one event."""
        if len(items) == 1:
            self.push(items[0])
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._put_all, items)

    def _put_all(self, items: list[Any]) -> None:
        for item in items:
            self.queue.put_nowait(item)


class EngineRunner:
    def __init__(
        self,
        core: Core,
        *,
        time_scale: float = 1.0,
        tick_ms: float | None = None,
        on_effects: Callable[[list[Any]], None] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.time_scale = time_scale
        self.tick_ms = tick_ms  # wall ms between forced advances (decode chunk coalescing)
        self.on_effects = on_effects
        self.on_tick = on_tick  # after every wake-up (decode flushes coalesced chunks here)
        self._wall0 = time.monotonic()
        self._model0 = 0.0
        # (command, its future, the modelled time it was queued at); () wakes the thread only
        # (`wake`), None stops it
        self._cmds: queue.SimpleQueue[tuple[Callable[[], Any], cf.Future[Any], float] | tuple[()] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stopping = False
        self.lag_ms = 0.0  # how far behind the modelled schedule the thread woke (wall ms)
        self.max_lag_ms = 0.0
        # Results before the work that does not change them (PrefillEngine.advance_early).
        self._early: Callable[[float], list[Any]] | None = getattr(core, "advance_early", None)

    # ---- clock ---------------------------------------------------------------------------
    def model_now(self) -> float:
        return self._model0 + (time.monotonic() - self._wall0) * 1000.0 / self.time_scale

    def set_time_scale(self, scale: float) -> None:
        """Called on the engine thread: rebase so the modelled clock stays continuous."""
        now = self.model_now()
        self._model0, self._wall0, self.time_scale = now, time.monotonic(), scale

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._cmds.put(None)
        self._thread.join(timeout=5)

    # ---- API for infer functions ---------------------------------------------------------
    def call_sync(self, fn: Callable[[], T]) -> cf.Future[T]:
        fut: cf.Future[T] = cf.Future()
        self._cmds.put((fn, fut, self.model_now()))
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call_sync(fn))

    def wake(self) -> None:
        """Any thread: advance the core now (a real engine's compute ended). Not a command, so
        it does not settle deferred work early (`advance_early`): the results it completes
        still leave before that work."""
        self._cmds.put(())

    # ---- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            timeout = self._wait_s()
            try:
                item = (
                    self._cmds.get(timeout=timeout)
                    if timeout is None or timeout > 0
                    else self._cmds.get_nowait()
                )
            except queue.Empty:
                item = ()
            if item is None:
                break
            batch = [item] if item else []
            while True:  # drain everything queued so one wake-up serves many callers
                try:
                    nxt = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stopping = True
                    break
                if nxt:
                    batch.append(nxt)
            now = self.model_now()
            nt = self.core.next_event_time()
            if nt is not None and nt <= now:
                self.lag_ms = (now - nt) * self.time_scale
                self.max_lag_ms = max(self.max_lag_ms, self.lag_ms)
            # Commands see the core as of the first one's arrival, not of when this thread got to
            # them (it may have been busy, e.g. settling a completion's cache work): a prefill
            # batch starts at its arrival (prefill_model.py). What is due after it is advanced
            # to on the next turn, at once.
            t = min(now, min((c[2] for c in batch), default=now))
            try:
                self._emit(self._early(t) if self._early is not None else self.core.advance_to(t))
                if batch and self._unsettled():  # commands see the core settled
                    self._emit(self.core.advance_to(t))
            except Exception:  # a core bug must not kill the engine thread silently
                log.exception("engine advance failed")
            for fn, fut, _ in batch:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # delivered to the awaiting infer function
                    fut.set_exception(exc)
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:
                    log.exception("engine tick hook failed")

    def _wait_s(self) -> float | None:
        nt = self.core.next_event_time()
        waits = []
        if nt is not None:
            waits.append((nt - self.model_now()) * self.time_scale / 1000.0)
        if self.tick_ms is not None and getattr(self.core, "has_running", lambda: False)():
            waits.append(self.tick_ms / 1000.0)
        if self._unsettled():
            waits.append(SETTLE_S)
        if not waits:
            return 0.5  # idle: wake now and then so stopping is prompt
        return max(0.0, min(waits))

    def _unsettled(self) -> bool:
        return bool(getattr(self.core, "unsettled", False))

    def _emit(self, effects: list[Any]) -> None:
        if effects and self.on_effects is not None:
            self.on_effects(effects)
