"""Each replica's in-process mirror of the global KV-cache index: block key → workers.

Fed by the owners' versioned diff streams (one per worker) after loading each worker's snapshot;
prefix matching runs here, in process, with no Redis round trip on the request path. Speculative
entries (a prefix just routed to a worker, not yet confirmed by its cache) expire after a short
TTL so two requests sharing a prefix land together even before the worker reports it.
Pure: time is passed in, never read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class _WorkerView:
    epoch: str = ""
    version: int = 0
    keys: set[int] = field(default_factory=set)


class CacheMirror:
    def __init__(self, speculative_ttl_ms: float = 2000.0, *, holders_index: bool = False) -> None:
        """`holders_index`: also keep block key -> holders (the simulator's `match_fast` starts
        from block 0's holders among 1,000 workers). The gateway leaves it off: a set per key made
        every block key a container the garbage collector walks (200K keys: a 157 ms full
        collection, a stall of the whole event loop), and one set of keys per worker is all
        `match` reads."""
        self.speculative_ttl_ms = speculative_ttl_ms
        self._index: dict[int, set[str]] | None = {} if holders_index else None
        self._workers: dict[str, _WorkerView] = {}
        self._spec: dict[tuple[int, str], float] = {}  # (key, worker) → expiry ms

    # ---- feeding -------------------------------------------------------------------------
    def version(self, worker: str) -> tuple[str, int]:
        v = self._workers.get(worker)
        return (v.epoch, v.version) if v else ("", 0)

    def load_snapshot(self, worker: str, epoch: str, version: int, keys: Iterable[int]) -> None:
        self.drop_worker(worker)
        view = self._workers[worker] = _WorkerView(epoch, version, set(keys))
        if self._index is not None:
            for k in view.keys:
                self._index.setdefault(k, set()).add(worker)

    def apply_diff(
        self,
        worker: str,
        epoch: str,
        version: int,
        added: Iterable[int],
        removed: Iterable[int],
        full: bool = False,
    ) -> bool:
        """Apply a diff; only-newer-wins. A diff from another epoch is refused (the caller must
        load a snapshot), as is one not newer than what the mirror holds."""
        if full:
            self.load_snapshot(worker, epoch, version, added)
            return True
        view = self._workers.get(worker)
        if view is None or view.epoch != epoch or version <= view.version:
            return False
        if self._index is None:
            view.keys.difference_update(removed)
            view.keys.update(added)
            view.version = version
            return True
        for k in removed:
            if k in view.keys:
                view.keys.discard(k)
                holders = self._index.get(k)
                if holders is not None:
                    holders.discard(worker)
                    if not holders:
                        del self._index[k]
        for k in added:
            if k not in view.keys:
                view.keys.add(k)
                self._index.setdefault(k, set()).add(worker)
        view.version = version
        return True

    def drop_worker(self, worker: str) -> None:
        view = self._workers.pop(worker, None)
        if view is None or self._index is None:
            return
        for k in view.keys:
            holders = self._index.get(k)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._index[k]

    def add_speculative(self, worker: str, keys: Sequence[int], now_ms: float) -> None:
        exp = now_ms + self.speculative_ttl_ms
        for k in keys:
            self._spec[(k, worker)] = exp

    def expire(self, now_ms: float) -> None:
        for kw in [kw for kw, e in self._spec.items() if e <= now_ms]:
            del self._spec[kw]

    # ---- queries -------------------------------------------------------------------------
    def holders(self, key: int, now_ms: float) -> set[str]:
        if self._index is not None:
            out = set(self._index.get(key, ()))
        else:
            out = {w for w, v in self._workers.items() if key in v.keys}
        for (k, w), e in self._spec.items():
            if k == key and e > now_ms:
                out.add(w)
        return out

    def match(self, keys: Sequence[int], workers: Iterable[str], now_ms: float) -> dict[str, int]:
        """Leading blocks of `keys` each worker holds (confirmed or speculative)."""
        out: dict[str, int] = {}
        for w in workers:
            view = self._workers.get(w)
            held = view.keys if view else set()
            n = 0
            for k in keys:
                if k in held:
                    n += 1
                    continue
                e = self._spec.get((k, w))
                if e is not None and e > now_ms:
                    n += 1
                    continue
                break
            out[w] = n
        return out

    def size(self, worker: str) -> int:
        v = self._workers.get(worker)
        return len(v.keys) if v else 0
