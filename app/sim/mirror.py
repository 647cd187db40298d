"""The simulated replicas' view of the cluster's KV caches: the gateway's real `CacheMirror` for the
confirmed keys, plus each replica's own speculative entries, with a prefix match that visits only the
workers holding the prompt's first block.

The live `CacheMirror.match` walks every worker for every request; at 1,000 simulated workers that is
most of the simulator's time, so this answers the same question from the holders of the first block
(a worker that lacks block 0 matches 0 blocks anyway). `tests/test_simulate.py` checks that both give
the same answer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from app.cache.mirror import CacheMirror

__all__ = ["SimMirror", "SpecIndex"]


class SpecIndex:
    """One replica's speculative entries: block key → {worker id: expiry ms}.

    In the live gateway these stay in the origin's own mirror (they are not published), so each
    simulated replica has its own. Same TTL semantics as `CacheMirror.add_speculative`.
    """

    __slots__ = ("_by_key", "_fifo", "ttl_ms")

    def __init__(self, ttl_ms: float) -> None:
        self.ttl_ms = ttl_ms
        self._by_key: dict[int, dict[str, float]] = {}
        # One TTL for all entries, so insertion order is expiry order: expiring is a pop from the
        # left, never a scan of the whole index.
        self._fifo: deque[tuple[float, int, str]] = deque()

    def add(self, worker: str, keys: Sequence[int], now_ms: float) -> None:
        exp = now_ms + self.ttl_ms
        by_key = self._by_key
        push = self._fifo.append
        for k in keys:
            d = by_key.get(k)
            if d is None:
                by_key[k] = {worker: exp}
            else:
                d[worker] = exp
            push((exp, k, worker))

    def expire(self, now_ms: float) -> None:
        """Drop expired entries (matching ignores them anyway; this only bounds memory)."""
        fifo = self._fifo
        by_key = self._by_key
        while fifo and fifo[0][0] <= now_ms:
            exp, k, w = fifo.popleft()
            d = by_key.get(k)
            if d is not None and d.get(w) == exp:  # not renewed since
                del d[w]
                if not d:
                    del by_key[k]

    def get(self, key: int) -> dict[str, float] | None:
        return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)


class SimMirror(CacheMirror):
    """`CacheMirror` fed by the simulated owners' polls, with a holder-driven `match_fast`."""

    def __init__(self, speculative_ttl_ms: float = 2000.0) -> None:
        super().__init__(speculative_ttl_ms, holders_index=True)

    def match_fast(self, keys: Sequence[int], spec: SpecIndex, now_ms: float) -> dict[str, int]:
        """Leading blocks of ``keys`` each worker holds, confirmed or (unexpired) speculative, for
        the workers that hold at least the first block; the others are absent (= 0 blocks). Equal
        to ``CacheMirror.match`` restricted to non-zero answers, with the speculative entries
        taken from ``spec`` instead of the mirror's own."""
        if not keys:
            return {}
        k0 = keys[0]
        assert self._index is not None
        holders: set[str] = set(self._index.get(k0, ()))
        sp0 = spec.get(k0)
        if sp0:
            holders.update(w for w, e in sp0.items() if e > now_ms)
        if not holders:
            return {}
        out: dict[str, int] = {}
        n_keys = len(keys)
        workers = self._workers
        spec_get = spec.get
        for w in holders:
            view = workers.get(w)
            held = view.keys if view is not None else ()
            n = 1
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
            out[w] = n
        return out
