"""The engine's prefix cache against a plain reference model of its rules.

`PrefixCache.insert` and `shrink_to` keep their state in locals and trim the diff log once per
call (a finished 8 x 8K batch inserts and evicts ~1,000 blocks on the engine thread, on the path
of its results; #20). The reference below applies the documented rules one block at a time; after
every operation of a random workload (pins held across batches, budgets that leave every block
pinned, a log limit small enough to trim) both must hold the same blocks in the same LRU order,
the same pin counts, version, diff log and log floor, and answer every diff alike.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import pytest

from workers.engine.prefix_cache import DIFF_LOG_LIMIT, DIFF_LOG_MIN, DIFF_LOG_PER_BLOCK, PrefixCache


class Reference:
    """One block at a time: evict the oldest unpinned block while over budget, log every change."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.lru: OrderedDict[int, int] = OrderedDict()
        self.version = 0
        self.log: deque[tuple[int, bool, int]] = deque()
        self.floor = 0
        blocks = capacity_tokens // block_size
        self.limit = min(DIFF_LOG_LIMIT, max(DIFF_LOG_MIN, DIFF_LOG_PER_BLOCK * blocks))

    def record(self, added: bool, key: int) -> None:
        self.version += 1
        self.log.append((self.version, added, key))
        while len(self.log) > self.limit:
            self.floor = self.log.popleft()[0]

    def evict_one(self) -> bool:
        for k, c in self.lru.items():
            if c == 0:
                del self.lru[k]
                self.record(False, k)
                return True
        return False

    def insert(self, keys: list[int], pin: bool, budget_tokens: int) -> list[int]:
        present = []
        budget = max(0, budget_tokens // self.block_size)
        for k in keys:
            if k in self.lru:
                self.lru.move_to_end(k)
                if pin:
                    self.lru[k] += 1
                present.append(k)
                continue
            if len(self.lru) >= budget and (not self.evict_one() or len(self.lru) >= budget):
                break
            self.lru[k] = 1 if pin else 0
            self.record(True, k)
            present.append(k)
        return present

    def shrink_to(self, budget_tokens: int) -> None:
        budget = max(0, budget_tokens // self.block_size)
        while len(self.lru) > budget and self.evict_one():
            pass

    def pin(self, keys: list[int]) -> None:
        for k in keys:
            if k in self.lru:
                self.lru[k] += 1
                self.lru.move_to_end(k)

    def unpin(self, keys: list[int]) -> None:
        for k in keys:
            if self.lru.get(k):
                self.lru[k] -= 1


def _same(cache: PrefixCache, ref: Reference) -> None:
    assert list(cache._lru.items()) == list(ref.lru.items())
    assert cache._pinned_blocks == sum(1 for c in ref.lru.values() if c > 0)
    assert cache.version == ref.version
    assert list(cache._log) == list(ref.log)
    assert cache._log_floor == ref.floor


@pytest.mark.parametrize("capacity_blocks", [8, 40, 700])
def test_insert_and_shrink_match_the_one_block_at_a_time_rules(capacity_blocks: int) -> None:
    rng = random.Random(capacity_blocks)
    bs = 4
    cap = capacity_blocks * bs
    cache, ref = PrefixCache(cap, bs), Reference(cap, bs)
    held: list[list[int]] = []
    recent: list[int] = []
    for step in range(400):
        keys = [rng.randrange(10**12) for _ in range(rng.randint(1, 3 * capacity_blocks // 2))]
        if recent and rng.random() < 0.5:  # a shared prefix: hits, pins, LRU touches
            keys[: len(recent) // 2] = recent[: len(recent) // 2]
        recent = keys
        hit = cache.match_prefix(keys)
        cache.pin(keys[:hit])
        ref.pin(keys[:hit])
        # Budgets from "everything fits" down to "nothing does" (all left pinned: insert stops).
        budget = rng.choice([cap, cap // 2, cap - len(keys) * bs, bs, 0])
        if rng.random() < 0.5:
            cache.shrink_to(budget)
            ref.shrink_to(budget)
            _same(cache, ref)
        pin = rng.random() < 0.7
        assert cache.insert(keys, pin=pin, budget_tokens=budget) == ref.insert(keys, pin, budget)
        cache.unpin(keys[:hit])
        ref.unpin(keys[:hit])
        if pin:
            held.append(keys)
        while held and (len(held) > 3 or rng.random() < 0.3):  # handles released later
            done = held.pop(0)
            cache.unpin(done)
            ref.unpin(done)
        _same(cache, ref)
        since = rng.randint(0, cache.version + 1)
        d = cache.diff_since(since)
        if since < ref.floor or since > ref.version:
            assert d.full and d.added == list(ref.lru)
        else:
            net: dict[int, bool] = {}
            for v, added, k in reversed(ref.log):
                if v <= since:
                    break
                net.setdefault(k, added)
            assert not d.full
            assert sorted(d.added) == sorted(k for k, a in net.items() if a)
            assert sorted(d.removed) == sorted(k for k, a in net.items() if not a)
        assert step < 5 or cache.version > 0


def test_a_new_capacity_bounds_the_diff_log_at_once_and_keeps_its_newest_entries() -> None:
    """The log is a bounded deque (its floor is `version - len(log)`): a capacity change (the
    `configure` of kv_capacity_tokens) re-bounds it, the newest entries kept, so a diff from a
    version still in it stays incremental and one from before it is a full snapshot."""
    bs = 4
    cache = PrefixCache(10_000 * bs, bs)  # limit 20,000 entries
    for i in range(3):
        cache.insert(list(range(i * 1000, (i + 1) * 1000)), pin=False, budget_tokens=10_000 * bs)
    assert cache.version == 3000 and len(cache._log) == 3000 and cache._log_floor == 0
    cache.capacity_tokens = 100 * bs  # limit max(DIFF_LOG_MIN, 200) = 1,024 entries
    assert len(cache._log) == DIFF_LOG_MIN
    assert cache._log_floor == 3000 - DIFF_LOG_MIN
    assert list(cache._log)[-1] == (3000, True, 2999)
    d = cache.diff_since(3000 - DIFF_LOG_MIN)
    assert not d.full and sorted(d.added) == list(range(3000 - DIFF_LOG_MIN, 3000))
    assert cache.diff_since(3000 - DIFF_LOG_MIN - 1).full
    cache.insert([10**9], pin=False, budget_tokens=10_000 * bs)  # still bounded after growing
    assert len(cache._log) == DIFF_LOG_MIN and cache._log_floor == 3001 - DIFF_LOG_MIN
    cache.capacity_tokens = 10_000 * bs  # a larger limit keeps everything there is
    assert len(cache._log) == DIFF_LOG_MIN and cache._log_floor == 3001 - DIFF_LOG_MIN
