"""The simulator's SLO admission (app/scheduling/admission.py), exactly as the live origin and its
hand-off script decide: `decide` on the snapshot view before the hand-off, then the allowance
(`max_backlog_ms`) checked on the shared state's exact load in the step that queues the request
(`fits_on_live`, `pick_within` for the fresh pick's two candidates)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from app.scheduling.admission import (
    AdmissionConfig,
    Verdict,
    expected_batch_wait_ms,
    fits_on_live,
    max_backlog_ms,
    pick_within,
)
from app.scheduling.admission import decide as admission_decide
from app.scheduling.formula import BatchItem
from app.scheduling.routing import Choice

if TYPE_CHECKING:
    from app.sim.cluster import ClusterSim
    from app.sim.replica import SimReplica

#: Peer router imitations admit everything: the routers they imitate have no SLO admission.
NO_ADMISSION = AdmissionConfig(mode="off")


def admit_on_live(
    sim: ClusterSim, rep: SimReplica, i: int, first: Choice, alt: Choice | None, won: Choice
) -> tuple[Verdict, Choice]:
    """SLO admission as the live origin does it: on the policy's pick's view before the
    hand-off (peer imitations run without it: the routers they imitate have none), then the
    hand-off script's check of each candidate's allowance on the live state (here the exact
    one) in the step that queues the request: the ranking's winner ``won`` when its backlog
    leaves room, else the other of the pair when it does (`admission.pick_within`), else
    refused with nothing written. Returns the verdict and the worker the request goes to."""
    tr = sim.trace.requests[i]
    size = tr.input_len
    w0 = sim.pindex[first.worker_id]
    own_ms = first.predicted_ms or sim.formula.predict_batch([BatchItem(size, first.hit_tokens)])
    view = rep.pviews[w0]
    adm = sim.cfg.admission if not rep.peer else NO_ADMISSION
    window = sim.bcfg.wait_ms if sim._window_batching else 0.0
    verdict = admission_decide(
        adm,
        view,
        own_ms,
        sim.cfg.slo_ttft_ms - (sim.now - tr.arrival_ms) - sim.cfg.handoff_latency_ms,
        batch_wait_ms=expected_batch_wait_ms(view, sim.bcfg.wait_ms, sim._window_batching),
        explicit=False,  # trace rows carry no deadline of their own: the cluster SLO
        window_ms=window,
    )
    if not verdict.admit or verdict.max_backlog_ms is None:
        return verdict, won
    pair = [first] if alt is None else [first, alt]
    loads = [sim._fresh_loads(c.worker_id) for c in pair]
    limits: list[float | None] = [verdict.max_backlog_ms]
    if alt is not None:
        limits.append(max_backlog_ms(adm, alt.predicted_ms, verdict.budget_ms, window_ms=window))
    k = 0 if won.worker_id == first.worker_id else 1
    if alt is None:
        got: int | None = 0 if fits_on_live(adm, verdict, *loads[0]).admit else None
    else:
        full = tuple(sim.queue_items[sim.pindex[c.worker_id]] >= sim.cfg.max_queue_len for c in pair)
        sums = (loads[0][0] + loads[0][1], loads[1][0] + loads[1][1])
        got = pick_within(k, sums, (limits[0], limits[1]), (full[0], full[1]))
    if got is not None:
        return verdict, pair[got]
    # refused, nothing written: the script's answer carries the ranking winner's live load
    queued, owed = loads[k]
    wk = sim.pindex[pair[k].worker_id]
    rep.overlay[wk] = (queued, sim.now)
    rep.overlay_of[wk] = -1
    rep.note_fresh_owed(wk, owed, sim.now)
    rep.pviews[wk] = rep.pview(wk, sim.now)
    return fits_on_live(adm, replace(verdict, max_backlog_ms=limits[k]), queued, owed), won
