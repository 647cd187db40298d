"""The engine's own prefix cache: an LRU of block keys bounded by KV capacity, with pins.

A pinned block (referenced by a running batch or by a prefilled request whose KV the decode side
has not fetched yet) cannot be evicted. Every change bumps a 64-bit version and is appended to a
bounded diff log, so pollers receive only what changed since the version they hold.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
        self.capacity_tokens = capacity_tokens
        self.block_size = block_size
        self._lru: OrderedDict[int, int] = OrderedDict()  # key -> pin count; oldest first
        self._pinned_blocks = 0
        self.version = 0
        self._log: deque[tuple[int, bool, int]] = deque()  # (version, added?, key)
        self._log_floor = 0  # versions <= floor are no longer in the log

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
        for k in keys:
            c = self._lru.get(k)
            if c is None:
                continue
            if c == 0:
                self._pinned_blocks += 1
            self._lru[k] = c + 1
            self._lru.move_to_end(k)

    def unpin(self, keys: Iterable[int]) -> None:
        for k in keys:
            c = self._lru.get(k)
            if c is None or c == 0:
                continue
            self._lru[k] = c - 1
            if c == 1:
                self._pinned_blocks -= 1

    # ---- mutation ------------------------------------------------------------------------
    def insert(self, keys: Sequence[int], *, pin: bool, budget_tokens: int) -> list[int]:
        """Insert (or touch) `keys`, optionally pinning them, evicting unpinned LRU blocks so the
        cache stays within `budget_tokens` (capacity minus KV held outside the cache). Returns the
        keys actually present afterwards (a block that cannot fit is not cached)."""
        present: list[int] = []
        budget_blocks = max(0, budget_tokens // self.block_size)
        for k in keys:
            c = self._lru.get(k)
            if c is not None:
                self._lru.move_to_end(k)
                if pin:
                    if c == 0:
                        self._pinned_blocks += 1
                    self._lru[k] = c + 1
                present.append(k)
                continue
            if len(self._lru) >= budget_blocks and not self._evict_one():
                break  # everything left is pinned: this block is computed but not cached
            if len(self._lru) >= budget_blocks:
                break
            self._lru[k] = 1 if pin else 0
            if pin:
                self._pinned_blocks += 1
            self._record(True, k)
            present.append(k)
        return present

    def shrink_to(self, budget_tokens: int) -> None:
        """Evict unpinned blocks until the cache fits `budget_tokens`."""
        budget_blocks = max(0, budget_tokens // self.block_size)
        while len(self._lru) > budget_blocks and self._evict_one():
            pass

    def clear(self) -> None:
        for k in list(self._lru):
            self._record(False, k)
        self._lru.clear()
        self._pinned_blocks = 0

    def _evict_one(self) -> bool:
        for k, c in self._lru.items():
            if c == 0:
                del self._lru[k]
                self._record(False, k)
                return True
        return False

    def _record(self, added: bool, key: int) -> None:
        self.version += 1
        self._log.append((self.version, added, key))
        limit = min(
            DIFF_LOG_LIMIT,
            max(DIFF_LOG_MIN, DIFF_LOG_PER_BLOCK * (self.capacity_tokens // max(1, self.block_size))),
        )
        while len(self._log) > limit:
            v, _, _ = self._log.popleft()
            self._log_floor = v

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
