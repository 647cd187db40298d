"""A replica dates a worker snapshot's loads by when the owner read them (`loads_ms`), not by
when the replica read the snapshot (app/gateway/views.py `content_time`), so an origin's own
hand-off made in between keeps counting on its overlay (`current_loads`). Dated by the replica's
read, that hand-off vanished from the view until the next snapshot: under load a burst was
admitted against a backlog missing its latest requests (test_overload_live's burst admitted 7
where 6 fit, in a CI run at load average 9). Real Redis; the snapshot is written by the product's
own `write_snapshot`, with the fields the owner's poller writes."""

from __future__ import annotations

import time

from app.cache.mirror import CacheMirror
from app.cluster.registry import Registry, parse_worker
from app.gateway.views import WorkerViews, content_time
from app.scheduling.routing import current_loads

WID = "prefill@127.0.0.1:1"


async def test_a_hand_off_after_the_owners_read_outlives_a_snapshot_read_later(store) -> None:  # type: ignore[no-untyped-def]
    views = WorkerViews(store.redis, store.keys, Registry(store.redis, store.keys), CacheMirror())
    await Registry(store.redis, store.keys).add([parse_worker(WID)])
    await views.load_registry()
    t_owner = time.time() - 0.5  # the owner's poller read queued and owed ms
    t_handoff = t_owner + 0.2  # then this origin handed off 1,200 ms more (its overlay)
    fields = {"queued_ms": 0.0, "owed_ms": 0.0, "loads_ms": round(t_owner * 1000, 1), "time_scale": 1.0}
    assert await store.write_snapshot(WID, "e1", 1, fields)
    overlay = (1200.0, t_handoff)
    await views.load_snapshots()  # read now, after the hand-off
    snap_t = views.snapshot_time[WID]
    assert abs(snap_t - t_owner) < 0.01, (snap_t, t_owner)
    queued, _ = current_loads(0.0, 0.0, 0.0, overlay, snap_t, None, 0.0)
    assert queued == 1200.0  # the hand-off still counts: the snapshot predates it
    # a hand-off before the owner's read is in the snapshot itself: the snapshot wins
    queued, _ = current_loads(0.0, 0.0, 0.0, (1200.0, t_owner - 0.1), snap_t, None, 0.0)
    assert queued == 0.0


def test_content_time_falls_back_to_the_read_without_a_usable_owner_stamp() -> None:
    now = 1_000.0
    assert content_time({}, now) == now  # an owner before `loads_ms`
    assert content_time({"loads_ms": "999500.0"}, now) == 999.5
    assert content_time({"loads_ms": "1000500.0"}, now) == now  # owner clock ahead of ours
