"""Pure cluster pieces: health hysteresis and the cache-index mirror."""

from __future__ import annotations

from app.cache.mirror import CacheMirror
from app.cluster.health import Health, Miss, WorkerHealth


def test_health_down_at_once_on_a_failed_poll_up_after_poll() -> None:
    """A refused or broken poll says the worker is not there: down at once, up after a good poll."""
    h = WorkerHealth(down_after=1, slow_down_after=5)
    assert h.poll_ok("e1") is not None and h.state == Health.UP
    ch = h.failure(Miss.FAILED)
    assert ch is not None and ch.after == Health.DOWN and ch.misses == 1 and not h.routable
    assert h.failure() is None  # stays down, no flapping events
    ch = h.poll_ok("e1")
    assert ch is not None and ch.after == Health.UP and not ch.epoch_changed


def test_health_slow_polls_need_consecutive_misses() -> None:
    """A late answer may be load, not death: four in a row keep the worker in routing, a good poll
    clears the count, the fifth in a row takes it out; a failed poll within a slow run counts in
    the run and still takes it out at once."""
    h = WorkerHealth(down_after=1, slow_down_after=5)
    h.poll_ok("e1")
    for _ in range(4):
        assert h.failure(Miss.SLOW) is None and h.routable
    assert h.poll_ok("e1") is None  # back to 0
    for _ in range(4):
        assert h.failure(Miss.SLOW) is None and h.routable
    ch = h.failure(Miss.SLOW)
    assert ch is not None and ch.after == Health.DOWN and ch.misses == 5
    h.poll_ok("e1")
    h.failure(Miss.SLOW)
    ch = h.failure(Miss.FAILED)
    assert ch is not None and ch.after == Health.DOWN and ch.misses == 2


def test_health_epoch_change_reported() -> None:
    h = WorkerHealth()
    h.poll_ok("e1")
    ch = h.poll_ok("e2")
    assert ch is not None and ch.epoch_changed and ch.old_epoch == "e1"


def test_mirror_snapshot_diff_and_prefix_match() -> None:
    m = CacheMirror()
    m.load_snapshot("w1", "e", 10, [1, 2, 3])
    m.load_snapshot("w2", "e", 5, [1])
    assert m.match([1, 2, 3, 4], ["w1", "w2", "w3"], 0) == {"w1": 3, "w2": 1, "w3": 0}
    assert m.apply_diff("w2", "e", 6, [2, 3, 4], [])
    assert not m.apply_diff("w2", "e", 6, [9], [])  # not newer
    assert not m.apply_diff("w2", "other", 7, [9], [])  # other epoch: needs a snapshot
    assert m.match([1, 2, 3, 4], ["w2"], 0) == {"w2": 4}
    assert m.apply_diff("w1", "e", 11, [], [2])
    assert m.match([1, 2, 3], ["w1"], 0) == {"w1": 1}
    assert m.holders(1, 0) == {"w1", "w2"}
    m.drop_worker("w2")
    assert m.holders(4, 0) == set()


def test_mirror_keys_are_not_containers_the_collector_walks() -> None:
    """The gateway's mirror holds block keys in one set per worker: 100K keys add a handful of
    GC-tracked objects, not one per key (a set per key made full collections of a loaded replica
    take ~150 ms, stalling its event loop). The simulator's holders index keeps one per key."""
    import gc
    import random

    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(100_000)]
    for indexed, bound in ((False, 50), (True, 100_000)):
        gc.collect()
        before = len(gc.get_objects())
        m = CacheMirror(holders_index=indexed)
        m.load_snapshot("w1", "e", 1, keys[:60_000])
        assert m.apply_diff("w1", "e", 2, keys[60_000:], keys[:10_000])
        tracked = len(gc.get_objects()) - before
        assert (tracked < bound) if not indexed else (tracked >= bound * 0.9)
        assert m.size("w1") == 90_000 and m.holders(keys[-1], 0) == {"w1"}
        assert m.match(keys[10_000:10_003], ["w1"], 0) == {"w1": 3}


def test_mirror_speculative_entries_expire() -> None:
    m = CacheMirror(speculative_ttl_ms=2000)
    m.add_speculative("w1", [7, 8], now_ms=1000)
    assert m.match([7, 8, 9], ["w1"], 2000) == {"w1": 2}
    assert m.match([7, 8], ["w1"], 3000) == {"w1": 0}
    m.expire(3000)
    assert m.holders(7, 0) == set()
