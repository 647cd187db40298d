"""A TCP proxy in front of the real Redis, for faults that happen on the wire: the connection
drops (`down()`: every open connection is reset and new ones are refused), a share of the
traffic is lost (`flaky(p)`: each chunk forwarded resets its connection with probability p), or
the next commands are lost (`drop_next(n)`: the next n chunks a client sends reset their
connections instead of reaching Redis).

This is not a fake Redis: every command reaches the real server, and what the gateway sees is what
it sees when a network path or a Redis restart breaks its sockets (ConnectionError, timeouts,
half-applied pipelines). Used by tests/test_faults.py case 7 and the loop tests.
"""

from __future__ import annotations

import asyncio
import random
import threading
from urllib.parse import urlparse

from app.netports import free_port


class FaultProxy:
    def __init__(self, target_url: str, seed: int = 7) -> None:
        u = urlparse(target_url)
        self.target = (u.hostname or "127.0.0.1", u.port or 6379)
        self.db = u.path or "/0"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}{self.db}"
        self.rng = random.Random(seed)
        self.loss = 0.0  # probability that a forwarded chunk resets its connection
        self.resets = 0
        self.drops = 0  # client chunks still to drop (drop_next)
        self._down = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fault-proxy")
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("fault proxy did not start")

    # ---- control (from the test's thread) ------------------------------------------------
    def down(self) -> None:
        """Reset every open connection and refuse new ones until `up()`."""
        self._down = True
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(5)

    def up(self) -> None:
        self._down = False

    def flaky(self, loss: float) -> None:
        self.loss = loss

    def drop_next(self, n: int = 1) -> None:
        """The next `n` chunks a client sends reset their connection: an open, healthy-looking
        pooled socket whose next command fails, which no client can detect before sending."""
        self.drops = n

    def close(self) -> None:
        self._down = True
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # ---- the proxy ------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()

    async def _reset_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self._down:
            cw.transport.abort()
            return
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.transport.abort()
            return
        self._writers.update((cw, sw))

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, upstream: bool) -> None:
            try:
                while data := await r.read(65536):
                    dropped = upstream and self.drops > 0
                    if dropped:
                        self.drops -= 1
                    if self._down or dropped or (self.loss and self.rng.random() < self.loss):
                        self.resets += 1
                        break
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass  # the other side went away: close both below
            finally:
                cw.transport.abort()
                sw.transport.abort()
                self._writers.discard(cw)
                self._writers.discard(sw)

        await asyncio.gather(pump(cr, sw, True), pump(sr, cw, False))
