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
from collections.abc import AsyncIterator

from app.cluster.registry import parse_worker
from app.config import Settings
from app.gateway.replica import Replica
from app.request.types import GenRequest
from app.scheduling.in_flight import HandoffsInFlight
from app.scheduling.routing import current_loads, overlay_less_prefilled

from .conftest import running_on


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
        await _owned_and_up(rep, pw, f"decode@{daddr}")
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


def test_a_finished_prefill_comes_off_only_its_own_answer() -> None:
    own = (600.0, 5.0)
    assert overlay_less_prefilled(own, "a", "a", 600.0) == (0.0, 5.0)
    # a later answer (b's) may have been read after the owner took a into a batch: kept
    assert overlay_less_prefilled(own, "b", "a", 600.0) == own
    assert overlay_less_prefilled(None, "a", "a", 600.0) is None


async def test_a_prefill_that_finishes_after_a_later_answer_is_not_taken_off_it(
    clients, worker_pool, shared_embedded_redis, cluster
) -> None:  # type: ignore[no-untyped-def]
    """A runs on the engine (the owner took it out of the queue); B is handed off then, so B's
    answer reads a queue of B alone. When A finishes, the view must still count B: taking A off
    B's answer as well left 0 ms queued while B waited (the old rule, a backlog short by B)."""
    paddr = worker_pool["prefill"][0].address
    daddr = worker_pool["decode"][0].address
    await clients["prefill"][0].configure(formula="600", time_scale=1.0)
    pw = f"prefill@{paddr}"
    # polls far apart, so no snapshot supersedes B's answer while A runs (the overlay is read)
    settings = Settings(
        cluster=cluster, replica_id=f"finish-{cluster}", prefill_time_formula="600", poll_interval_ms=10_000
    )
    rep = Replica(settings, shared_embedded_redis, [parse_worker(pw), parse_worker(f"decode@{daddr}")])
    await rep.start()
    try:
        await _owned_and_up(rep, pw, f"decode@{daddr}")
        pipe = rep.pipeline
        b_answered = asyncio.Event()
        a_events = pipe.run(GenRequest(f"fa-{cluster}", [5] * 64, 2, 30_000))
        a_first = asyncio.ensure_future(anext(a_events))
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(running_on, paddr, f"fa-{cluster}"):
            assert time.monotonic() < deadline and not a_first.done(), "A never ran"
            await asyncio.sleep(0.02)
        b_req = GenRequest(f"fb-{cluster}", [6] * 64, 1, 30_000, on_admitted=b_answered.set)
        b_task = asyncio.ensure_future(_drain(pipe.run(b_req)))
        await asyncio.wait_for(b_answered.wait(), 10)
        ov = rep.views.queued_overlay[pw]
        assert ov[0] == 600.0 and rep.views.overlay_answer_of[pw] == f"fb-{cluster}", ov
        kind, _ = await asyncio.wait_for(a_first, 10)  # A's prefill finished and was taken in
        assert kind == "first"
        view = next(x for x in pipe.views("prefill") if x.id == pw)
        snap_t = rep.views.snapshot_time.get(pw, 0.0)
        assert snap_t <= ov[1], "a snapshot superseded B's answer: the case did not happen"
        assert view.queued_ms == 600.0, view  # B, still queued or just taken: not counted out
        assert [e async for e in a_events][-1][0] == "end"
        assert (await b_task)[-1][0] == "end"
    finally:
        await rep.stop(drain=False)


async def _owned_and_up(rep: Replica, pw: str, dw: str) -> None:
    deadline = time.monotonic() + 60
    while not (rep.worker_up(pw) and rep.worker_up(dw) and pw in rep.leases.owned()):
        assert time.monotonic() < deadline, "the replica never owned an up prefill worker"
        await asyncio.sleep(0.05)


async def _drain(events: AsyncIterator[tuple[str, object]]) -> list[tuple[str, object]]:
    return [e async for e in events]
