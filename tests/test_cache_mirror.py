"""The cache mirror's speculative entries stay bounded on the live request path (app/cache/mirror.py).

The live gateway only ever calls `add_speculative` and `match` (app/request/pipeline.py): it never
called `expire`, and the entries grew by ~80 MB per 200 s at 100 req/s. Pure: modelled timestamps.
"""

from __future__ import annotations

import pytest

from app.cache.mirror import CacheMirror, SpecIndex


def test_the_live_mirror_expires_speculative_entries_without_an_expire_call() -> None:
    mirror = CacheMirror(2000.0)  # as the gateway's Replica builds it: no holders index
    mirror.load_snapshot("w0", "e", 1, [])
    blocks, rate, ttl = 50, 100, 2000.0
    peak = 0
    for i in range(200 * rate):  # 200 s at 100 req/s, a fresh 50-block prefix each
        now = i * 1000.0 / rate
        keys = list(range(i * blocks, (i + 1) * blocks))
        mirror.add_speculative("w0", keys, now)
        peak = max(peak, mirror.spec.entries())
    # Only the last TTL's worth is held: 2 s x 100 req/s x 50 blocks (+ the request just added).
    assert peak <= ttl / 1000 * rate * blocks + blocks
    assert mirror.spec.entries() <= ttl / 1000 * rate * blocks + blocks
    now = (200 * rate - 1) * 1000.0 / rate
    assert mirror.match(list(range(blocks)), ["w0"], now) == {"w0": 0}  # the first prefix expired
    last = list(range((200 * rate - 1) * blocks, 200 * rate * blocks))
    assert mirror.match(last, ["w0"], now) == {"w0": blocks}
    assert mirror.match_fast(last, now) == {"w0": blocks}


def test_a_burst_beyond_the_cap_drops_the_oldest_entries_first() -> None:
    mirror = CacheMirror(60_000.0, speculative_max_entries=1000)
    for i in range(100):
        mirror.add_speculative(f"w{i % 4}", list(range(i * 100, (i + 1) * 100)), float(i))
    assert mirror.spec.entries() == 1000
    assert mirror.holders(0, 100.0) == set()  # the oldest prefix went first
    assert mirror.holders(9999, 100.0) == {"w3"}  # the newest is kept
    assert mirror.match(list(range(9900, 10000)), ["w3"], 100.0) == {"w3": 100}


def test_a_renewed_entry_outlives_its_first_expiry() -> None:
    spec = SpecIndex(1000.0)
    spec.add("w", [7], 0.0)
    spec.add("w", [7], 800.0)  # routed again: lives until 1800
    spec.expire(1500.0)
    assert spec.get(7) == {"w": 1800.0}
    spec.expire(1800.0)
    assert spec.get(7) is None and spec.entries() == 0
    with pytest.raises(ValueError):
        SpecIndex(1000.0, max_entries=0)
