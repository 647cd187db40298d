"""The simulated owners' polls (the live `app/cluster/poller.py`): every ``poll_interval_ms`` each
owner publishes its worker's snapshot (KV, queued batches, the hand-off queue's queued ms and the
ledger's owed ms via `commit.owed_ms`) and cache diff, which reach every replica's mirror at once;
decode workers publish KV, reservations and running sequences. Versioned, so a replica rebuilds
only the views that changed (`SimReplica.refresh`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.scheduling.commit import owed_ms

if TYPE_CHECKING:
    from app.sim.cluster import ClusterSim

__all__ = ["poll_owners"]


def poll_owners(sim: ClusterSim) -> None:
    now = sim.now
    for w, eng in enumerate(sim.peng):
        ledger = sim.ledger[w]
        if not sim.p_dirty[w] and not ledger:
            continue
        sim.p_dirty[w] = False
        kv = eng.kv_view()
        owed = owed_ms(((pred, start) for pred, start, _left in ledger.values()), now)
        queued_batches = sum(1 for b in eng.live_view() if b["phase"] == "queued")
        snap = (
            kv["kv_total_tokens"],
            kv["kv_free_tokens"],
            kv["kv_evictable_tokens"],
            queued_batches,
            round(sim.queued_ms[w], 3),
            round(owed, 3),
            now,
        )
        if snap[:6] != sim.p_pub[w][:6]:
            sim.p_pub[w] = snap
            sim.p_pub_ver[w] += 1
        else:
            sim.p_pub[w] = snap  # same load; only the anchor time moves
        diff = eng.cache_diff(sim.cache_version[w])
        if diff.full or diff.added or diff.removed or sim.cache_version[w] is None:
            sim.mirror.apply_diff(sim.pids[w], "sim", diff.version, diff.added, diff.removed, diff.full)
        sim.cache_version[w] = diff.version
    for d, deng in enumerate(sim.deng):
        if not sim.d_dirty[d]:
            continue
        sim.d_dirty[d] = False
        kv = deng.kv_view()
        running = len(deng.live_view()["running"])
        dsnap = (kv["kv_total_tokens"], kv["kv_free_tokens"], sim.reserved[d], running)
        if dsnap != sim.d_pub[d]:
            sim.d_pub[d] = dsnap
            sim.d_pub_ver[d] += 1
