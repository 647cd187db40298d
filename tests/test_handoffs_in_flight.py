"""An origin's hand-offs stay in its view of a worker's queue until their own answer is read
(app/scheduling/in_flight.py). Before, the answer to an earlier hand-off replaced the queued
time with what that script read, which cannot include hand-offs sent after it: until their own
answers came back they vanished, and a request routed then was admitted against a backlog
missing them (test_overload_live's burst admitted 7 where 6 fit, in two CI runs on a loaded box).

The live test drives a real in-process replica (real Redis, a real prefill worker from the pool
it owns by lease) with two requests at once, and reads the replica's own view of the worker at
the moment the first one's answer is taken in (its `on_admitted` hook): the second one must be
in it. Without the fix the view held the first one alone."""

from __future__ import annotations

import asyncio
import time

from app.cluster.registry import parse_worker
from app.config import Settings
from app.gateway.replica import Replica
from app.request.types import GenRequest
from app.scheduling.in_flight import HandoffsInFlight
from app.scheduling.routing import current_loads


def test_a_token_counts_until_answered_and_answering_is_idempotent() -> None:
    f = HandoffsInFlight()
    a = f.sent("w", 600.0)
    b = f.sent("w", 250.0)
    f.sent("v", 100.0)
    assert (f.ms("w"), f.count("w"), f.ms("v")) == (850.0, 2, 100.0)
    f.answered("w", a)
    f.answered("w", a)
    assert (f.ms("w"), f.count("w")) == (250.0, 1)
    f.answered("w", b)
    assert (f.ms("w"), f.count("w"), f.ms("nobody")) == (0.0, 0, 0.0)


def test_in_flight_adds_to_the_overlay_or_to_the_snapshot_whichever_is_newer() -> None:
    # overlay (600 at t=2) newer than the snapshot (t=1): 600 + 400 in flight
    assert current_loads(0.0, 0.0, 0.0, (600.0, 2.0), 1.0, None, 0.0, in_flight_ms=400.0)[0] == 1000.0
    # snapshot newer: its 300 + 400 in flight
    assert current_loads(300.0, 0.0, 0.0, (600.0, 0.5), 1.0, None, 0.0, in_flight_ms=400.0)[0] == 700.0


async def test_the_answer_to_an_earlier_hand_off_does_not_erase_a_later_one(
    clients, worker_pool, shared_embedded_redis, cluster
) -> None:  # type: ignore[no-untyped-def]
    paddr = worker_pool["prefill"][0].address
    daddr = worker_pool["decode"][0].address
    await clients["prefill"][0].configure(formula="300", time_scale=1.0)
    pw = f"prefill@{paddr}"
    predicted = 300.0  # the gateway's prediction for each prompt (the worker's formula alike)
    settings = Settings(cluster=cluster, replica_id=f"inflight-{cluster}", prefill_time_formula="300")
    rep = Replica(settings, shared_embedded_redis, [parse_worker(pw), parse_worker(f"decode@{daddr}")])
    await rep.start()
    try:
        deadline = time.monotonic() + 60
        while not (rep.worker_up(pw) and rep.worker_up(f"decode@{daddr}") and pw in rep.leases.owned()):
            assert time.monotonic() < deadline, "the replica never owned an up prefill worker"
            await asyncio.sleep(0.05)
        pipe = rep.pipeline
        seen: list[tuple[float, int]] = []

        def first_admitted() -> None:
            # the first request's answer is in the overlay; the second's round trip is still out
            v = next(x for x in pipe.views("prefill") if x.id == pw)
            seen.append((v.queued_ms, rep.views.in_flight.count(pw)))

        async def run(i: int, hook: object) -> list[tuple[str, object]]:
            req = GenRequest(f"if-{i}-{cluster}", [7 + i] * 64, 1, 30_000, on_admitted=hook)  # type: ignore[arg-type]
            return [ev async for ev in pipe.run(req)]

        a, b = await asyncio.gather(run(0, first_admitted), run(1, None))
        assert a[-1][0] == "end" and b[-1][0] == "end", (a, b)
        ((queued, in_flight),) = seen
        assert in_flight == 1  # the second hand-off was out when the first's answer was read
        # both hand-offs are in the view: the first's answer (itself) and the second, in flight
        assert queued >= 2 * predicted - 1, queued
        assert rep.views.in_flight.count(pw) == 0  # nothing left once both answered
    finally:
        await rep.stop(drain=False)
