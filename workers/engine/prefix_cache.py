"""The engine's own prefix cache: an LRU of block keys bounded by KV capacity, with pins.

A pinned block (referenced by a running batch or by a prefilled request whose KV the decode side
has not fetched yet) cannot be evicted. Every change bumps a 64-bit version and is appended to a
bounded diff log, so pollers receive only what changed since the version they hold.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, islice, repeat
from operator import not_

DIFF_LOG_LIMIT = 100_000
# The log keeps at most this many entries per block the cache can hold (and at least
# DIFF_LOG_MIN): a diff longer than that carries more keys than a full snapshot would, so a poller
# that far behind is answered with the snapshot anyway. A cap of DIFF_LOG_LIMIT alone kept a
# steadily evicting cache's log filling for most of an hour (issue 14 soak: worker RSS growth).
DIFF_LOG_PER_BLOCK = 2
DIFF_LOG_MIN = 1024


@dataclass(frozen=True)
class CacheDiff:
    """Keys added/removed since `since_version`; `full` means `added` is the whole key set."""

    version: int
    full: bool
    added: list[int]
    removed: list[int]


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens  # sets the diff log's limit too
        self._lru: OrderedDict[int, int] = OrderedDict()  # key -> pin count; oldest first
        self._pinned_blocks = 0
        self.version = 0
        # (version, added?, key), bounded: the oldest entries fall off as new ones are appended.
        # Versions are consecutive, so the log holds exactly (version - len(log), version].
        self._log: deque[tuple[int, bool, int]] = deque(maxlen=self._log_limit)

    @property
    def capacity_tokens(self) -> int:
        return self._capacity_tokens

    @capacity_tokens.setter
    def capacity_tokens(self, tokens: int) -> None:
        self._capacity_tokens = tokens
        self._log_limit = min(
            DIFF_LOG_LIMIT, max(DIFF_LOG_MIN, DIFF_LOG_PER_BLOCK * (tokens // max(1, self.block_size)))
        )
        log = getattr(self, "_log", None)
        if log is not None and log.maxlen != self._log_limit:
            self._log = deque(log, maxlen=self._log_limit)  # keeps the newest entries

    @property
    def _log_floor(self) -> int:
        """Versions <= this are no longer in the diff log."""
        return self.version - len(self._log)

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: int) -> bool:
        return key in self._lru

    @property
    def used_tokens(self) -> int:
        return len(self._lru) * self.block_size

    @property
    def pinned_tokens(self) -> int:
        return self._pinned_blocks * self.block_size

    @property
    def evictable_tokens(self) -> int:
        return (len(self._lru) - self._pinned_blocks) * self.block_size

    def match_prefix(self, keys: Sequence[int]) -> int:
        """Number of leading keys present (a prefix hit stops at the first miss)."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def keys(self) -> list[int]:
        return list(self._lru)

    # ---- pins ----------------------------------------------------------------------------
    def pin(self, keys: Iterable[int]) -> None:
        lru = self._lru
        newly = 0
        for k in keys:
            c = lru.get(k)
            if c is None:
                continue
            if c == 0:
                newly += 1
            lru[k] = c + 1
            lru.move_to_end(k)
        self._pinned_blocks += newly

    def unpin(self, keys: Iterable[int]) -> None:
        """Hot like `insert`: a released or expired 8K-token handle unpins 128 blocks."""
        lru = self._lru
        freed = 0
        for k in keys:
            c = lru.get(k)
            if not c:  # absent or not pinned
                continue
            lru[k] = c - 1
            if c == 1:
                freed += 1
        self._pinned_blocks -= freed

    # ---- mutation ------------------------------------------------------------------------
    def insert(self, keys: Sequence[int], *, pin: bool, budget_tokens: int) -> list[int]:
        """Insert (or touch) `keys`, optionally pinning them, evicting unpinned LRU blocks so the
        cache stays within `budget_tokens` (capacity minus KV held outside the cache). Returns the
        keys actually present afterwards (a block that cannot fit is not cached).

        Hot: a finished 8 x 8K batch inserts 1,024 blocks on the engine thread before its results
        leave. The usual shape is a cached prefix, then new blocks that fit (the batch's start made
        room for its compute, `shrink_to`): the prefix is touched key by key, the new tail goes in
        with C-level bulk operations (~10x faster than the loop); anything else (a tail that needs
        evictions, repeats a key or meets a cached one) takes the per-key loop, with the same
        result either way (order, pins, versions, diff log)."""
        present: list[int] = []
        lru = self._lru
        budget_blocks = max(0, budget_tokens // self.block_size)
        h = 0
        for k in keys:  # the cached prefix (a prefix hit stops at the first miss)
            if k not in lru:
                break
            h += 1
        rest = keys[h:] if h else keys
        if h:
            self._insert_each(keys[:h], pin, budget_blocks, present)
        fresh = dict.fromkeys(rest, 1 if pin else 0)
        n = len(rest)
        if n and len(fresh) == n and len(lru) + n <= budget_blocks and lru.keys().isdisjoint(fresh):
            lru.update(fresh)
            if pin:
                self._pinned_blocks += n
            v = self.version
            self._log.extend(zip(range(v + 1, v + n + 1), repeat(True), rest))
            self.version = v + n
            present.extend(rest)
        elif n:
            self._insert_each(rest, pin, budget_blocks, present)
        return present

    def _insert_each(self, keys: Sequence[int], pin: bool, budget_blocks: int, present: list[int]) -> None:
        """`insert`'s per-key loop: touches cached keys, evicts for new ones (state in locals)."""
        lru = self._lru
        log = self._log.append
        v = self.version
        try:
            for k in keys:
                c = lru.get(k)
                if c is not None:
                    lru.move_to_end(k)
                    if pin:
                        if c == 0:
                            self._pinned_blocks += 1
                        lru[k] = c + 1
                    present.append(k)
                    continue
                if len(lru) >= budget_blocks:
                    old = self._oldest_unpinned()
                    if old is None:
                        break  # everything left is pinned: this block is computed but not cached
                    del lru[old]
                    v += 1
                    log((v, False, old))
                    if len(lru) >= budget_blocks:
                        break
                lru[k] = 1 if pin else 0
                if pin:
                    self._pinned_blocks += 1
                v += 1
                log((v, True, k))
                present.append(k)
        finally:
            self.version = v

    def shrink_to(self, budget_tokens: int) -> None:
        """Evict unpinned blocks, least recently used first, until the cache fits `budget_tokens`
        (or only pinned ones are left). One C-level pass picks them: a full cache evicts 1,024
        blocks here for every 8 x 8K batch it starts."""
        lru = self._lru
        excess = len(lru) - max(0, budget_tokens // self.block_size)
        if excess <= 0:
            return
        victims = list(islice(compress(lru.keys(), map(not_, lru.values())), excess))
        for k in victims:
            del lru[k]
        v = self.version
        self._log.extend(zip(range(v + 1, v + len(victims) + 1), repeat(False), victims))
        self.version = v + len(victims)

    def clear(self) -> None:
        for k in list(self._lru):
            self._record(False, k)
        self._lru.clear()
        self._pinned_blocks = 0

    def _oldest_unpinned(self) -> int | None:
        """The LRU-most block nobody pins, or None when every block is pinned."""
        if self._pinned_blocks >= len(self._lru):
            return None
        for k, c in self._lru.items():
            if c == 0:
                return k
        return None

    def _record(self, added: bool, key: int) -> None:
        self.version += 1
        self._log.append((self.version, added, key))

    # ---- diffs ---------------------------------------------------------------------------
    def diff_since(self, since_version: int | None) -> CacheDiff:
        """Changes after `since_version`; a full snapshot when it is unknown, too old or ahead
        (a poller holding a version from another incarnation must start over)."""
        if since_version is None or since_version < self._log_floor or since_version > self.version:
            return CacheDiff(self.version, True, list(self._lru), [])
        if since_version == self.version:
            return CacheDiff(self.version, False, [], [])
        # Net effect per key since the version: the last event for a key wins.
        net: dict[int, bool] = {}
        for v, added, k in reversed(self._log):
            if v <= since_version:
                break
            net.setdefault(k, added)
        added_keys = [k for k, a in net.items() if a]
        removed_keys = [k for k, a in net.items() if not a]
        return CacheDiff(self.version, False, added_keys, removed_keys)
