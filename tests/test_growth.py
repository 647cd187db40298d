"""What made a gateway's RSS grow for an hour in the soak (issue 14 Benchmark, docs/reliability.md):
per-process tables that were bounded, but only by caps far beyond what a steady load needs, so
they filled for tens of minutes. Each test drives the table with the soak's kind of input and
requires its size to stop at the horizon that matters."""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

import app.dispatch.owner as owner_module
from app.cluster.leases import Lease
from app.dispatch.owner import OwnerDispatcher
from app.scheduling.formula import BatchItem, compile_formula
from app.state.keys import Keys
from app.state.store import StateStore


def test_formula_memo_of_unique_batches_stays_small() -> None:
    """Unique prompt lengths make almost every batch a new memo key: 10,000 of them (over an hour
    of one owner's batches at 50 req/s) must leave at most 256 entries and well under 1 MiB (at
    4,096 entries the table filled for ~45 min of soak and held ~3.4 MiB)."""
    f = compile_formula("11 + 3*log(batchSize + 1) + sum(0.021*computeTokens)")
    rng = random.Random(7)
    tracemalloc.start()
    try:
        for _ in range(10_000):
            n = rng.randint(1, 8)
            f.predict_batch([BatchItem(rng.randint(100, 4000), rng.randint(0, 2000)) for _ in range(n)])
            f.predict_one(rng.randint(100, 4000), rng.randint(0, 2000))
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(f._batch_memo) <= 256 and len(f._one_memo) <= 256
    assert used < 2**20 // 2, used


def test_owner_forgets_finished_batch_ids_after_the_audit_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner remembers which batches the worker reported finished only as long as the ledger
    audit can use it (`ttl_ms`): 10 minutes of 10 batches/s must not pile up 6,000 ids."""
    now = [1_000_000.0]
    monkeypatch.setattr(owner_module.time, "time", lambda: now[0])
    lease = Lease("lease", "me", 3000, 500)  # not held: the audit stops after its bookkeeping
    url = "redis://127.0.0.1:1/0"  # never connected to: nothing here reaches Redis
    store = StateStore(aioredis.from_url(url), Keys("t-growth"))
    d = OwnerDispatcher("prefill@x", "me", lease, store, cast(Any, None), url, epoch=lambda: "1")

    async def run() -> None:
        n = 0
        for _ in range(600):  # 600 s of status polls, 10 new finished batches each second
            st = {"finished": [{"batch_id": f"b{n + i}"} for i in range(10)]}
            n += 10
            await d.audit_ledger(st, ttl_ms=60_000)
            now[0] += 1.0

    asyncio.run(run())
    assert 590 <= len(d._finished_seen) <= 610, len(d._finished_seen)
    assert "b5999" in d._finished_seen and "b0" not in d._finished_seen


def test_prefix_cache_diff_log_stops_at_a_few_times_the_cache_not_at_100k_entries() -> None:
    """A full prefix cache evicts a block for every block it adds, and each is a diff-log entry:
    the log must stop at a small multiple of the cache's block capacity (a diff longer than that is
    answered with a full snapshot anyway), not fill towards 100,000 entries for most of an hour.
    Pollers that keep up still get exact diffs; one that fell behind the log gets a snapshot."""
    from workers.engine.prefix_cache import PrefixCache

    cache = PrefixCache(capacity_tokens=40_000, block_size=64)  # 625 blocks: the soak's workers
    seen = cache.version
    for k in range(50_000):  # unique blocks: after 625 each insert evicts one
        cache.insert([k], pin=False, budget_tokens=40_000)
        if k % 100 == 0:  # a poller keeping up
            d = cache.diff_since(seen)
            assert not d.full
            seen = d.version
    assert len(cache) == 625
    assert len(cache._log) <= max(1024, 2 * 625), len(cache._log)
    behind = cache.diff_since(1)  # fell behind the log: the whole key set
    assert behind.full and sorted(behind.added) == sorted(cache.keys())


def test_latency_sample_rings_stay_small_when_full() -> None:
    """The two benchmark sample rings keep their last 20,000 latencies each: full, they must hold
    them packed (a list of float objects took 4x as much and filled for ~20 minutes of soak)."""
    from app.metrics import SampleRing

    ring = SampleRing()
    rng = random.Random(3)
    tracemalloc.start()
    try:
        for _ in range(25_000):
            ring.add(rng.random())
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(ring.values) == 20_000 and list(ring.values)[-1] < 1.0
    assert used < 260_000, used  # 20,000 doubles = 160 KB (+ the array's slack)
    ring.values.clear()  # what POST /admin/stats/reset does
    assert len(ring.values) == 0
