"""Each replica's in-process mirror of the global KV-cache index: block key → workers.

Fed by the owners' versioned diff streams (one per worker) after loading each worker's snapshot;
prefix matching runs here, in process, with no Redis round trip on the request path. Speculative
entries (a prefix just routed to a worker, not yet confirmed by its cache) live in a `SpecIndex` for
a short TTL so two requests sharing a prefix land together even before the worker reports it.
Pure: time is passed in, never read.

One implementation for the live gateway and the simulator (`app/sim/`): the gateway's replica owns
one mirror with its own speculative index, fed by its own hand-offs and, with
`FLEXLB_SHARED_SPECULATIVE`, by the owners' records of every replica's (app/cache/shared_spec.py);
the simulator shares one mirror of confirmed keys between its replicas and gives each replica its
own `SpecIndex` (`SimConfig.shared_speculative` publishes into all of them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_SPEC_MAX_ENTRIES", "CacheMirror", "SpecIndex"]

# Speculative (key, worker) entries one index keeps at most, whatever the TTL. At 100 req/s, a 2 s
# TTL and ~50 blocks per prompt about 10,000 are live at once; the cap only bites on a burst of very
# long prompts, and then drops the oldest entries first (the ones closest to expiry anyway).
# ~400 bytes each at worst: the cap bounds the index to ~25 MB.
DEFAULT_SPEC_MAX_ENTRIES = 65536


@dataclass
class _WorkerView:
    epoch: str = ""
    version: int = 0
    keys: set[int] = field(default_factory=set)


class SpecIndex:
    """Speculative entries: block key → {worker id: expiry ms}, with expiry and a hard size cap.

    One TTL for all entries, so insertion order is expiry order (but for shared records, which carry
    the owner's read time and may be a few ms older: such an entry waits behind younger ones, at most
    one TTL, and matching checks every expiry): expiring is a pop from the left of a FIFO, never a
    scan of the whole index. A (key, worker) keeps its latest expiry. `add` expires first, so an
    index that is only ever added to (the live request path) stays bounded by rate × TTL, and by
    ``max_entries`` in any case.
    (The live mirror kept these in a dict it never expired: ~80 MB of growth per 200 s at 100 req/s.)
    """

    __slots__ = ("_by_key", "_fifo", "max_entries", "ttl_ms")

    def __init__(self, ttl_ms: float, max_entries: int = DEFAULT_SPEC_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_ms = ttl_ms
        self.max_entries = max_entries
        self._by_key: dict[int, dict[str, float]] = {}
        # (expiry, key, worker) in insertion order; an entry renewed since is skipped when popped.
        self._fifo: deque[tuple[float, int, str]] = deque()

    def add(self, worker: str, keys: Sequence[int], now_ms: float) -> None:
        self.expire(now_ms)
        exp = now_ms + self.ttl_ms
        by_key = self._by_key
        push = self._fifo.append
        for k in keys:
            d = by_key.get(k)
            if d is None:
                by_key[k] = {worker: exp}
            elif d.get(worker, 0.0) < exp:
                d[worker] = exp
            else:  # a later expiry holds already (a shared record read after our own entry)
                continue
            push((exp, k, worker))
        while len(self._fifo) > self.max_entries:
            self._pop()

    def _pop(self) -> None:
        exp, k, w = self._fifo.popleft()
        d = self._by_key.get(k)
        if d is not None and d.get(w) == exp:  # not renewed since
            del d[w]
            if not d:
                del self._by_key[k]

    def expire(self, now_ms: float) -> None:
        """Drop expired entries (matching ignores them anyway; this bounds memory)."""
        fifo = self._fifo
        while fifo and fifo[0][0] <= now_ms:
            self._pop()

    def get(self, key: int) -> dict[str, float] | None:
        return self._by_key.get(key)

    def entries(self) -> int:
        """Entries held (live or expired but not yet popped): what the cap bounds."""
        return len(self._fifo)

    def __len__(self) -> int:
        """Distinct block keys with at least one entry."""
        return len(self._by_key)


class CacheMirror:
    def __init__(
        self,
        speculative_ttl_ms: float = 2000.0,
        *,
        holders_index: bool = False,
        speculative_max_entries: int = DEFAULT_SPEC_MAX_ENTRIES,
    ) -> None:
        """`holders_index`: also keep block key -> holders (the simulator's `match_fast` starts
        from block 0's holders among 1,000 workers). The gateway leaves it off: a set per key made
        every block key a container the garbage collector walks (200K keys: a 157 ms full
        collection, a stall of the whole event loop), and one set of keys per worker is all
        `match` reads; `match_fast` then finds block 0's holders by one set lookup per worker."""
        self.speculative_ttl_ms = speculative_ttl_ms
        self._index: dict[int, set[str]] | None = {} if holders_index else None
        self._workers: dict[str, _WorkerView] = {}
        self.spec = SpecIndex(speculative_ttl_ms, speculative_max_entries)

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
        """Remember that ``keys`` were just routed to ``worker`` (expires after the TTL)."""
        self.spec.add(worker, keys, now_ms)

    def expire(self, now_ms: float) -> None:
        self.spec.expire(now_ms)

    # ---- queries -------------------------------------------------------------------------
    def holders(self, key: int, now_ms: float) -> set[str]:
        if self._index is not None:
            out = set(self._index.get(key, ()))
        else:
            out = {w for w, v in self._workers.items() if key in v.keys}
        sp = self.spec.get(key)
        if sp:
            out.update(w for w, e in sp.items() if e > now_ms)
        return out

    def match(self, keys: Sequence[int], workers: Iterable[str], now_ms: float) -> dict[str, int]:
        """Leading blocks of `keys` each of `workers` holds (confirmed or speculative), 0 included."""
        return {w: self._run(w, keys, 0, self.spec, now_ms) for w in workers}

    def _run(self, w: str, keys: Sequence[int], n: int, spec: SpecIndex, now_ms: float) -> int:
        """How many leading blocks of ``keys`` worker ``w`` holds, counting on from block ``n``
        (the caller knows the first ``n`` are held): confirmed, or speculative and unexpired."""
        view = self._workers.get(w)
        held = view.keys if view is not None else ()
        spec_get = spec.get
        n_keys = len(keys)
        while n < n_keys:
            k = keys[n]
            if k in held:
                n += 1
                continue
            sp = spec_get(k)
            if sp is not None and sp.get(w, 0.0) > now_ms:
                n += 1
                continue
            break
        return n

    def match_fast(self, keys: Sequence[int], now_ms: float, spec: SpecIndex | None = None) -> dict[str, int]:
        """Leading blocks of ``keys`` each worker holds, confirmed or (unexpired) speculative, for
        the workers that hold at least the first block; the others are absent (= 0 blocks).

        Equal to `match` over every worker restricted to non-zero answers, but visits only block 0's
        holders (from the holders index when kept, else one set lookup per worker): at 1,000
        simulated workers walking every worker was most of the simulator's time. ``spec`` replaces
        the mirror's own speculative index (the simulator's per-replica entries)."""
        if not keys:
            return {}
        spec = self.spec if spec is None else spec
        k0 = keys[0]
        workers = self._workers
        if self._index is not None:
            holders: set[str] = set(self._index.get(k0, ()))
        else:
            holders = {w for w, v in workers.items() if k0 in v.keys}
        sp0 = spec.get(k0)
        if sp0:
            holders.update(w for w, e in sp0.items() if e > now_ms)
        if not holders:
            return {}
        return {w: self._run(w, keys, 1, spec, now_ms) for w in holders}

    def size(self, worker: str) -> int:
        v = self._workers.get(worker)
        return len(v.keys) if v else 0
