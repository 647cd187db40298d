"""The KV handles of one prefill engine: each prefilled request's KV, pinned in the prefix cache
(and its uncached tail held outside it) until the decode side fetches it or the handle lapses.

Split out of `workers.engine.prefill` (modules < 500 lines), which owns the engine's `held` tally
and turns each unpin into a `KvReleased` effect. Pure like the engine: times are the modelled
clock the engine passes in.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from .prefill_state import Pinned
from .prefix_cache import PrefixCache


class KvHandles:
    """Pinned handles by request id, with their next expiry and the tokens they hold outside the
    cache in O(1): the simulator asks for both after every event."""

    def __init__(self, cache: PrefixCache, history_limit: int) -> None:
        self.cache = cache
        self.history_limit = history_limit
        self.pinned: dict[str, Pinned] = {}
        # (expiry, request id) of every pin, popped lazily once its pin is gone or was replaced,
        # so the next expiry costs O(1) instead of a pass over every pinned request.
        self._heap: list[tuple[float, str]] = []
        self.outside_tokens = 0  # pinned tokens held outside the cache
        self._expired: OrderedDict[str, float] = OrderedDict()  # request id -> when (bounded)

    def __contains__(self, rid: str) -> bool:
        return rid in self.pinned

    def get(self, rid: str) -> Pinned | None:
        return self.pinned.get(rid)

    def pin(self, rid: str, p: Pinned) -> None:
        """Hold a prefilled request's KV (its cache blocks already pinned by the caller)."""
        self.pinned[rid] = p
        self.outside_tokens += p.outside_tokens
        heapq.heappush(self._heap, (p.expiry_ms, rid))

    def next_expiry(self) -> float | None:
        heap = self._heap
        pinned = self.pinned
        while heap:
            exp, rid = heap[0]
            p = pinned.get(rid)
            if p is not None and p.expiry_ms == exp:
                return exp
            heapq.heappop(heap)
        return None

    def pop_due(self, now: float) -> str | None:
        """The request id of the next handle that has lapsed by `now`, or None; the caller unpins it."""
        exp = self.next_expiry()
        if exp is None or exp > now:
            return None
        return heapq.heappop(self._heap)[1]

    def unpin(self, rid: str, reason: str, now: float) -> Pinned:
        """Drop a handle and unpin its cache blocks; the caller frees its `outside_tokens`. An
        expired one is remembered (bounded) so a late fetch answers kv_expired, not unknown."""
        p = self.pinned.pop(rid)
        self.outside_tokens -= p.outside_tokens
        self.cache.unpin(p.keys)
        if reason == "expired":
            self._expired[rid] = now
            while len(self._expired) > self.history_limit * 4:
                self._expired.popitem(last=False)
        return p

    def expired(self, rid: str) -> bool:
        return rid in self._expired

    def clear(self) -> None:
        """Forget lapsed handles and the expiry queue (after every pin was unpinned: `reset`)."""
        self._heap.clear()
        self._expired.clear()
