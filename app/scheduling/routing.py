"""Routing: the types every scheduling policy works on, and the hard filters they all share.

Policies (`app.scheduling.policy`, built from the plugins in `app.scheduling.plugins`) are pure
functions of their inputs (DESIGN §7, §11): they read a snapshot of the workers (`WorkerView`, what
this replica knows from the owners' snapshots and its cache mirror) and a query, and return a
`Choice`. No I/O, no wall clock, no asyncio and no global random state: every random
decision draws from the `random.Random` the caller passes in. The gateway calls them per request, and
the discrete-event simulator calls the very same code with its own seeded generator, so a simulated
run is reproducible and studies the router that production runs.

Determinism contract: the same query, the same worker sequence (order included), the same policy
state (only `round_robin` has any) and the same `rng` state give the same `Choice` and leave `rng` in
the same state. Ties are broken over the tied workers sorted by id, so for `cost`, `prefix`,
`least_load` and `kv_headroom` the choice depends on the set of workers, not on the order a snapshot
happened to list them in; `random` draws over the eligible workers in the given order.

Cost: each `choose` is one pass over the workers plus work proportional to the eligible and tied
ones, with no sorting of the whole fleet, because the simulator routes over 1,000 workers per request.
`top_candidates` shrinks the field further for it (see there).

This module imports no policy or plugin (they import it), so there is no import cycle.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.protocol.blocks import hit_blocks_cap

__all__ = [
    "DECODE",
    "PREFILL",
    "Choice",
    "DecodeQuery",
    "NoWorker",
    "PrefillQuery",
    "WorkerView",
    "check_hotspot_queue_len",
    "current_loads",
    "decode_headroom",
    "eligible_decode",
    "eligible_prefill",
    "overlay_less_prefilled",
    "owed_less_finished",
    "pick_tied",
    "prefill_load",
    "top_candidates",
]

PREFILL = "prefill"
DECODE = "decode"

# Stands in for "no hotspot bound", so the hot loop compares an int instead of testing for None.
_NO_LIMIT = sys.maxsize


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What a replica knows about one worker, taken from the owner's latest snapshot.

    Frozen so a policy can never change the snapshot it was handed; slotted because the simulator
    holds thousands of them and rebuilds them as loads change.
    """

    id: str
    role: str
    up: bool = True
    kv_total_tokens: int = 0
    kv_free_tokens: int = 0
    kv_evictable_tokens: int = 0
    # prefill: batches queued on the engine + items waiting in the hand-off queue
    queue_len: int = 0
    # prefill: predicted ms of what waits (overlaid with the hand-off script's answer)
    queued_ms: float = 0.0
    # prefill: predicted ms left of committed batches
    owed_ms: float = 0.0
    # decode: KV reserved by routed-but-unfinished requests
    reserved_tokens: int = 0
    # decode: running sequences
    running: int = 0
    draining: bool = False


@dataclass(frozen=True, slots=True)
class PrefillQuery:
    """One prompt to place: its length and, per worker id, how many of its leading full blocks that
    worker holds according to this replica's cache mirror (absent means none). ``keys``: the
    prompt's full-block keys, for pickers that track prefixes themselves (the peer imitations'
    approximate trees); the gateway's own policies read only ``hit_blocks``."""

    input_tokens: int
    hit_blocks: Mapping[str, int]
    block_size: int
    keys: Sequence[int] = ()

    def __post_init__(self) -> None:
        # Checked once here so plugins can do block arithmetic without guards on the hot path.
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.input_tokens < 0:
            raise ValueError(f"input_tokens must be >= 0, got {self.input_tokens}")


@dataclass(frozen=True, slots=True)
class DecodeQuery:
    """One request to place on a decode worker: input + max_new tokens of KV reserved for it.

    `max_new_tokens` is what the origin reserves (`reserve_output_tokens`: the request's own
    maximum, or a learned mean / percentile below it). `limit_tokens` is the most KV the request
    may ever hold (input + its own max_new_tokens; 0: the reservation): a worker whose whole KV is
    smaller refuses the sequence outright (the engine's TOO_LONG, after a wasted prefill), so it
    is never eligible, however little is reserved. `shareable_tokens` are the prompt's full-block
    tokens a worker whose holds already name those blocks does not reserve again
    (`FLEXLB_DECODE_SHARED_PREFIX`): the fit filter cannot see which worker holds which blocks, so
    it lets through a worker whose headroom covers the rest, and the RESERVE script, which can,
    decides (a refusal there is retried on the next workers).

    `held` (`FLEXLB_DECODE_PREFER_HELD`): per worker id, the tokens of those blocks the origin
    knows a hold there names (`reserve.DecodeHoldMirror`; absent: none). The request would not
    reserve them again there, so `eligible_decode` reports that worker's headroom plus them: the
    headroom left after this request's real reservation, which is what the decode scorers rank."""

    input_tokens: int
    max_new_tokens: int
    limit_tokens: int = 0
    shareable_tokens: int = 0
    held: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if (
            self.input_tokens < 0
            or self.max_new_tokens < 0
            or self.limit_tokens < 0
            or self.shareable_tokens < 0
        ):
            raise ValueError(
                f"token counts must be >= 0, got input {self.input_tokens}, max_new {self.max_new_tokens}, "
                f"limit {self.limit_tokens}"
            )

    @property
    def need_tokens(self) -> int:
        """KV the request may grow to; a decode worker must be able to hold all of it."""
        return self.input_tokens + self.max_new_tokens


@dataclass(frozen=True, slots=True)
class Choice:
    """A routing decision plus what the caller needs next without recomputing it.

    ``hit_tokens`` is the cached prefix the chosen prefill worker is expected to reuse (metrics, and
    the batcher's prediction); ``predicted_ms`` is the prefill alone, which the hand-off script adds
    to the worker's queued time (0 when the policy has no formula); ``score`` is what the policy
    ranked by (cost in ms, load in ms, headroom in tokens, ...); ``reason`` is a short fixed label
    (never free text with numbers) so it can be a metric label.
    """

    worker_id: str
    hit_tokens: int = 0
    predicted_ms: float = 0.0
    score: float = 0.0
    reason: str = ""


class NoWorker(Exception):
    """No worker may take the request. ``reason`` says which hard filter emptied the field, because
    "none live" and "none big enough" call for different operator action (the gateway maps both to a
    typed 503 ``no_worker``)."""

    reason: str

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


# --------------------------------------------------------------------------------------------------
# Shared pieces. One implementation of the hard filters, so every policy (and the simulator's
# pre-filter) agrees on which workers may take a request; policies only differ in how they rank.


def check_hotspot_queue_len(value: int | None) -> int | None:
    """Validate the hotspot knob once at construction: a negative bound would silently make every
    worker a hotspot and every request a NoWorker."""
    if value is not None and value < 0:
        raise ValueError(f"hotspot_queue_len must be >= 0 or None, got {value}")
    return value


def prefill_load(w: WorkerView) -> float:
    """Predicted ms before a new prefill on ``w`` could start: committed work left plus what waits."""
    return w.owed_ms + w.queued_ms


def eligible_prefill(
    q: PrefillQuery, workers: Sequence[WorkerView], hotspot_queue_len: int | None = None
) -> tuple[list[WorkerView], list[int]]:
    """The prefill workers that may take ``q``, and the hit tokens each would reuse.

    Hard filters, in order: role prefill, up and not draining; KV can hold the prompt (its total is at
    least L, and free + evictable cover the L − h tokens it must compute); not a hotspot (queue_len
    above ``hotspot_queue_len``, when set). A hit counts full blocks only and at most
    ``hit_blocks_cap`` of them, so a fully cached prompt still computes its last block and never looks
    free. Raises NoWorker naming the filter that removed the last candidate.
    """
    size = q.input_tokens
    block = q.block_size
    cap = hit_blocks_cap(size, block)
    hits = q.hit_blocks
    get = hits.get if hits else None
    hot = _NO_LIMIT if hotspot_queue_len is None else hotspot_queue_len
    role = PREFILL
    out: list[WorkerView] = []
    out_hits: list[int] = []
    keep = out.append
    keep_hit = out_hits.append
    # The hot loop: one pass, locals only, no per-worker allocation beyond the two appends.
    for w in workers:
        if not w.up or w.draining or w.role != role:
            continue
        blocks = get(w.id, 0) if get is not None else 0
        hit = (blocks if blocks < cap else cap) * block if blocks > 0 else 0
        if w.kv_total_tokens < size or w.kv_free_tokens + w.kv_evictable_tokens < size - hit:
            continue
        if w.queue_len > hot:
            continue
        keep(w)
        keep_hit(hit)
    if not out:
        # Rare path: find out which filter emptied the field, so the error says why.
        live = [w for w in workers if w.up and not w.draining and w.role == role]
        if not live:
            raise NoWorker("no live prefill worker")
        for w in live:
            blocks = get(w.id, 0) if get is not None else 0
            hit = (blocks if blocks < cap else cap) * block if blocks > 0 else 0
            if w.kv_total_tokens >= size and w.kv_free_tokens + w.kv_evictable_tokens >= size - hit:
                raise NoWorker(
                    f"every prefill worker that fits is a hotspot (queue_len > {hotspot_queue_len})"
                )
        raise NoWorker(f"no worker can hold {size} tokens")
    return out, out_hits


def owed_less_finished(
    owed_ms: float,
    snap_now_ms: float,
    finished: list[tuple[float, float, float, float]],
    stale_before: float,
) -> float:
    """A prefill worker's owed time from its snapshot, less what the snapshot still counts of our
    own prefills that have finished since. A snapshot taken while one of them ran (worker clock
    `snap_now_ms` within its modelled start..end) counts its remaining predicted time; until the
    next poll that would make the worker holding a chat's cache look busy with the very request
    whose cache the next turn wants, and the turn would be routed away from its prefix.

    `finished` holds (predicted ms, modelled start, modelled end, when we learnt it) and is pruned
    in place of entries the snapshot already reflects or older than `stale_before` (same unit as
    the fourth field). Used by the gateway (`Pipeline.views`) and the simulator alike."""
    finished[:] = [d for d in finished if snap_now_ms < d[2] and d[3] > stale_before]
    for predicted, start, _end, _learnt in finished:
        if start <= snap_now_ms:
            owed_ms -= max(0.0, predicted - (snap_now_ms - start))
    return max(0.0, owed_ms)


def overlay_less_prefilled(
    overlay: tuple[float, float] | None, answer_of: object, request: object, predicted_ms: float
) -> tuple[float, float] | None:
    """This origin's queued overlay on a worker (queued ms, when) once ``request``'s prefill there
    finished. The overlay is what one hand-off's answer read (``answer_of``: whose). It holds
    ``request`` for certain only when it is ``request``'s own answer: that script had just appended
    it, and the owner takes an entry only after. Any later answer may have been read after the
    owner took ``request`` into a batch, which moved its time to the ledger's owed ms that the view
    ages by itself; taking it off the queued time as well counted it out twice, and a request
    routed then was admitted against a backlog short by it. Kept, the overlay over-counts it (when
    that answer still held it) until this origin's next answer there or a newer snapshot.

    The one rule for the live origin (`HandoffStage`) and the simulator (`ClusterSim._reply`)."""
    if overlay is None or answer_of != request:
        return overlay
    return (max(0.0, overlay[0] - predicted_ms), overlay[1])


def current_loads(
    queued_ms: float,
    owed_ms: float,
    snap_now_ms: float,
    overlay: tuple[float, float] | None,
    snapshot_time: float,
    finished: list[tuple[float, float, float, float]] | None,
    stale_before: float,
    fresh_owed: tuple[float, float] | None = None,
    now: float = 0.0,
    ms_per_unit: float = 1.0,
    in_flight_ms: float = 0.0,
) -> tuple[float, float]:
    """A prefill worker's (queued ms, owed ms) as this origin should rank it: the snapshot's values,
    with the queued time replaced by this origin's own latest hand-off answer (``overlay``: queued
    ms, when) if that is not older than the snapshot (``snapshot_time``, same clock), and the owed
    time less this origin's prefills that finished since (`owed_less_finished`; ``finished`` is
    pruned in place, ``stale_before`` in its fourth field's unit).

    The one computation behind `Pipeline.views` (wall clock in s) and the simulator's views (modelled
    ms), so a simulated replica ranks workers exactly as a live one does.

    ``fresh_owed`` (owed ms, when): the ledger's owed time as this origin's latest hand-off read it
    in its round trip; when not older than the snapshot it replaces the snapshot's owed time, aged
    since (``now`` − when, × ``ms_per_unit`` modelled ms per unit of that clock).

    ``in_flight_ms``: this origin's hand-offs to the worker whose round trip has not answered yet
    (app/scheduling/in_flight.py), in neither the snapshot nor the overlay; 0 in the simulator,
    whose hand-off script answers at once."""
    if overlay is not None and overlay[1] >= snapshot_time:
        queued_ms = overlay[0]
    queued_ms += in_flight_ms
    if finished:
        owed_ms = owed_less_finished(owed_ms, snap_now_ms, finished, stale_before)
    if fresh_owed is not None and fresh_owed[1] >= snapshot_time:
        owed_ms = max(0.0, fresh_owed[0] - (now - fresh_owed[1]) * ms_per_unit)
    return queued_ms, owed_ms


def decode_headroom(w: WorkerView) -> int:
    """See `eligible_decode`. A snapshot without a total (an old worker) falls back to free − reserved."""
    if w.kv_total_tokens <= 0:
        return w.kv_free_tokens - w.reserved_tokens
    return min(w.kv_free_tokens, w.kv_total_tokens - w.reserved_tokens)


def eligible_decode(q: DecodeQuery, workers: Sequence[WorkerView]) -> tuple[list[WorkerView], list[int]]:
    """The decode workers that may take ``q``, and each one's headroom for it: its headroom plus the
    tokens of ``q``'s blocks a hold there already names (`DecodeQuery.held`, at most the shareable
    part), i.e. what the worker has left after this request's real reservation. Ranking on that
    sends an application's or a session's requests where their prompt is held, for as long as
    that leaves the worker more room than any other: the preference is bounded by the tokens
    saved, so it never piles requests onto a fuller worker, and within `kv_headroom`'s band the
    draw stays (breaking those ties for the holder raised TPOT p99 by 6-8 ms on chat_agents).

    Headroom = min(kv_free, kv_total − reserved). A running sequence is in both the worker's used
    KV and the reservations (which last until its stream ends), so `kv_free − reserved` counted it
    twice and refused ~12% of a real trace's requests on workers with room (found by the
    simulator). Reservations are what every replica has promised, used KV is what the worker has
    allocated; the binding one of the two is the headroom, and `kv_total − reserved` is exactly
    what the RESERVE script admits against.

    Every decode policy fits the request first: a decode worker that runs out of KV mid-stream must
    preempt or fail, which costs far more than any balancing gain. Raises NoWorker.
    """
    need = q.input_tokens + q.max_new_tokens
    limit = max(need, q.limit_tokens)
    out: list[WorkerView] = []
    heads: list[int] = []
    live = 0
    held = q.held
    share = q.shareable_tokens
    for w in workers:
        if not w.up or w.draining or w.role != DECODE:
            continue
        live += 1
        if 0 < w.kv_total_tokens < limit:
            continue  # could never hold the request at its own maximum, however little is reserved
        head = decode_headroom(w)
        if head >= need - share:
            out.append(w)
            if held:
                h = held.get(w.id, 0)
                head += h if h < share else share
            heads.append(head)
    if not out:
        if live == 0:
            raise NoWorker("no live decode worker")
        raise NoWorker(f"no decode worker has KV headroom for {need} tokens")
    return out, heads


def pick_tied(tied: list[int], ws: Sequence[WorkerView], rng: random.Random) -> int:
    """Index of one of the tied workers ``ws[i] for i in tied``, drawn with ``rng``.

    Sorting the (usually tiny) tie set by id makes the draw independent of snapshot order; a single
    candidate consumes no randomness, so adding workers that never tie does not shift a seeded run.
    """
    if len(tied) == 1:
        return tied[0]
    tied.sort(key=lambda i: ws[i].id)
    return tied[rng.randrange(len(tied))]


def top_candidates(
    q: PrefillQuery, workers: Sequence[WorkerView], k: int, hotspot_queue_len: int | None = None
) -> list[WorkerView]:
    """Shrink a large fleet to the workers a load/cache-aware prefill policy could pick.

    Keeps every eligible worker that would reuse at least one cached block, plus the ``k`` eligible
    workers without a hit that carry the least load (ties by id), in their original order.

    For the simulator with 1,000 workers. One call is O(n), about as costly as one ``choose`` over
    the whole fleet (~0.4 ms at 1,000 workers on this project's machines), while ``choose`` over the
    ~k + holders kept costs ~15 us; so the saving comes from reuse: compute the least-loaded pool once
    per load change or simulated tick with a query that has no hits (``hit_blocks={}``), then per
    request call ``choose`` on that pool plus the workers named in the request's ``hit_blocks``.
    ``choose`` re-applies every hard filter, so a stale pool may pick a worse worker, never an
    ineligible one; on NoWorker from the pool, retry over the whole fleet.

    Why it is safe: a worker without a hit costs ``predict_ms(L, 0) + load``, the same prefill for
    all of them, so the cheapest non-holder is the least loaded one and, for any ``k >= 1``, ``cost``,
    ``prefix`` and ``least_load`` find the same best score on the result as on the whole fleet (given
    the same ``hotspot_queue_len``). What it loses is breadth: near-ties among non-holders are cut to
    ``k``, and ``round_robin``/``random`` see only the kept workers. Raises NoWorker as
    ``eligible_prefill`` does.
    """
    if k < 1:
        # With no least-loaded worker kept, a prompt nobody caches would have no candidate at all.
        raise ValueError(f"k must be >= 1, got {k}")
    ws, hits = eligible_prefill(q, workers, hotspot_queue_len)
    holders = [i for i, h in enumerate(hits) if h > 0]
    if len(ws) - len(holders) <= k:
        return ws
    # Holders are kept anyway: give them an infinite load so they never take one of the k places.
    inf = math.inf
    loads = [w.owed_ms + w.queued_ms if h <= 0 else inf for w, h in zip(ws, hits, strict=True)]
    # The k-th smallest load by a C-level sort of floats, rather than a heap with a Python key per
    # worker (finite: more than k non-holders remain); ties at the threshold are settled by id so the
    # result does not depend on list order.
    threshold = sorted(loads)[k - 1]
    kept = [i for i, load in enumerate(loads) if load <= threshold]
    if len(kept) > k:
        below = [i for i in kept if loads[i] < threshold]
        at = sorted((i for i in kept if loads[i] == threshold), key=lambda i: ws[i].id)
        kept = below + at[: k - len(below)]
    chosen = holders + kept
    chosen.sort()
    return [ws[i] for i in chosen]
