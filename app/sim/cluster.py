"""A discrete-event model of one FlexLB cluster, driving the real scheduling and engine code.

What runs is the production code, on a virtual clock:

- routing: `app.scheduling.routing` strategies (`make_prefill_strategy`, `make_decode_strategy`) over
  `WorkerView` snapshots built the way `app/request/pipeline.py` builds them;
- batching: one `app.scheduling.batcher.Batcher` per prefill worker (the owner's), with the gateway's
  formula (`app.scheduling.formula`) as its predictor;
- engines: `workers.engine.prefill.PrefillEngine` (prefix cache = LRU bounded by the real KV capacity)
  and `workers.engine.decode.DecodeEngine`, with `workers.engine.profiles` timing;
- cache knowledge: the gateway's `CacheMirror` (`app/sim/mirror.py`), fed by cache diffs at each poll.

Information flow modelled after the live gateway (DESIGN §3, §5):

- every ``poll_interval_ms`` the owners poll their workers: KV, queue length, cache diff, and the
  gateway-side load (owed ms of committed batches from the ledger, queued ms of the hand-off queue,
  reserved decode KV) become the worker's published snapshot; cache diffs reach every mirror at once;
- each gateway replica refreshes its copy of the snapshots once per interval, at its own phase, so
  what it routes on is up to two intervals old; on top of it, like the live origin, it overlays the
  queued ms its own hand-offs returned, discounts its own prefills that finished since the snapshot,
  and keeps its own speculative cache entries (``speculative_ttl_ms``) for prefixes it just routed;
- a hand-off reaches the owner's batcher ``handoff_latency_ms`` later, a prefill result reaches the
  origin ``reply_latency_ms`` later; decode reservations are checked atomically at routing time
  against the worker's KV, as the reserve script does.

Determinism: one heap ordered by (time, insertion number), every random draw from a generator seeded
from the run's seed, and no iteration over unordered sets where the order could matter, so the same
inputs give the same records.

Large fleets: above ``full_scan_max`` workers a replica does not hand all views to the strategy.
Prefill candidates are the prefix holders plus a least-loaded shortlist from `top_candidates`
(recomputed at each snapshot refresh and after every ``candidates`` of its own routings), which
gives ``cost``, ``prefix`` and ``least_load`` the same best score as the whole fleet while the
shortlist is fresh; ``round_robin`` gets the next ``candidates`` workers by id after its last choice,
which is exactly what it would pick from the whole fleet; decode strategies get the best few by their
own ranking, which cannot go stale between refreshes because decode views only change then. A
strategy that finds no eligible candidate is retried over the whole fleet.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from app.protocol.blocks import hit_blocks_cap
from app.protocol.codes import FINISH_LENGTH, EngineStatus
from app.report.records import RequestRecord
from app.scheduling.admission import AdmissionConfig, expected_batch_wait_ms
from app.scheduling.admission import decide as admission_decide
from app.scheduling.batcher import Batcher, BatcherConfig, Pending
from app.scheduling.formula import BatchItem
from app.scheduling.reserve import OutputLengthEstimator
from app.scheduling.routing import (
    DecodeQuery,
    NoWorker,
    PrefillQuery,
    WorkerView,
    decode_headroom,
    make_decode_strategy,
    make_prefill_strategy,
    owed_less_finished,
    top_candidates,
)
from app.sim.config import SimConfig
from app.sim.mirror import SimMirror, SpecIndex
from app.sim.peers import PEERS, make_peer
from app.traces.model import Trace
from workers.engine.decode import DecodeEngine, DecodeRequest, _Seq
from workers.engine.effects import BatchDone, BatchStarted, DecodeFinished, Effect, PrefillResult
from workers.engine.prefill import PrefillEngine, PrefillRequest

__all__ = ["ClusterSim", "SimOutcome"]

# Event kinds. At equal times the insertion number orders events, so ties are reproducible.
_ARRIVAL, _HANDOFF, _TIMER, _PENGINE, _DENGINE, _REPLY, _RELEASE, _POLL, _REFRESH = range(9)

_NO_ADMISSION = AdmissionConfig(mode="off")

# A ledger batch the engine has not started yet: it owes its whole prediction (elapsed 0).
_NOT_STARTED = float("inf")

# Engine statuses the origin maps to API codes (app/request/pipeline.py ENGINE_TO_API).
_ENGINE_TO_API = {
    "cancelled": "cancelled",
    "too_long": "invalid_request",
    "invalid_request": "invalid_request",
    "duplicate": "duplicate_request",
}


class _SimDecodeEngine(DecodeEngine):
    """The decode engine core, minus the output token ids (nobody reads them in a simulation): the
    timing, KV and admission logic are the parent's; only the per-chunk id generation is skipped."""

    def _emit(self, s: _Seq, gen: int) -> list[Effect]:
        if gen > s.emitted:
            self.tokens_total += gen - s.emitted
            s.emitted = gen
        return []


@dataclass
class SimOutcome:
    records: list[RequestRecord]
    flush_reasons: dict[str, int]
    rejections: dict[str, int]
    batches: int
    events: int
    end_ms: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Req:
    origin: int = 0
    prefill: int = -1
    decode: int = -1
    predicted_ms: float = 0.0
    reserved: int = 0
    t_first: float | None = None
    t_end: float | None = None
    cached: int = 0
    batch_size: int | None = None
    error: str | None = None
    done: bool = False


class _Replica:
    """One gateway replica's routing state: its copy of the snapshots, overlays and strategies."""

    def __init__(self, idx: int, sim: ClusterSim, policy: str) -> None:
        cfg = sim.cfg
        self.idx = idx
        self.rng = random.Random(f"{cfg.seed}:replica:{idx}")
        self.peer = make_peer(policy, sim.formula) if policy in PEERS else None
        self.pstrat = make_prefill_strategy("cost" if self.peer else policy, formula=sim.formula)
        self.dstrat = make_decode_strategy(cfg.decode_strategy)
        self.psnap: list[tuple[Any, ...]] = list(sim.p_pub)
        self.dsnap: list[tuple[Any, ...]] = list(sim.d_pub)
        self.p_seen = [-1] * cfg.prefill
        self.d_seen = [-1] * cfg.decode
        self.snap_time = -1.0
        self.overlay: dict[int, tuple[float, float]] = {}
        self.fresh_owed: dict[int, tuple[float, float]] = {}  # ledger owed as our hand-off read it
        self.finished: dict[int, list[tuple[float, float, float, float]]] = {}
        self.spec = SpecIndex(cfg.speculative_ttl_ms)
        self.pviews: list[WorkerView] = []
        self.dviews: list[WorkerView] = []
        self.pool: list[int] | None = None
        self.routed_since_pool = 0
        self.dpool: list[int] | None = None
        self.dband: list[int] | None = None
        self.band_rng = random.Random(f"{cfg.seed}:band:{idx}")


class ClusterSim:
    """One run of one policy over one trace; `run()` returns the per-request records."""

    def __init__(self, trace: Trace, cfg: SimConfig, policy: str, batcher: BatcherConfig) -> None:
        cfg.validate()
        batcher.validate()
        self.trace = trace
        self.cfg = cfg
        self.policy = policy
        self.bcfg = batcher
        self.profile = cfg.engine_profile()
        self.formula = cfg.gateway_formula()
        self.bs = trace.block_size
        np_, nd = cfg.prefill, cfg.decode
        width = max(4, len(str(max(np_, nd) - 1)))
        # Zero-padded ids: sorted by id = sorted by index, which the round-robin window relies on.
        self.pids = [f"prefill-{i:0{width}d}" for i in range(np_)]
        self.dids = [f"decode-{i:0{width}d}" for i in range(nd)]
        self.pindex = {w: i for i, w in enumerate(self.pids)}
        self.peng = [
            PrefillEngine(
                self.profile,
                block_size=self.bs,
                seed=cfg.seed * 100_003 + i,
                kv_handle_ttl_ms=cfg.kv_handle_ttl_ms,
            )
            for i in range(np_)
        ]
        self.deng = [
            _SimDecodeEngine(
                cfg.decode_profile(),
                seed=cfg.seed * 100_003 + i,
                max_running=cfg.decode_max_running,
                admission=cfg.decode_admission,
            )
            for i in range(nd)
        ]
        predict = self.formula.predict_batch
        self.batchers = [Batcher(batcher, predict) for _ in range(np_)]
        self._window_batching = batcher.mode == "batch" and batcher.algorithm == "fixed_window"
        # "Redis": gateway-side shared state.
        self.queued_ms = [0.0] * np_  # hand-off queue's predicted ms per prefill worker
        self.queue_items = [0] * np_
        self.ledger: list[dict[str, list[float]]] = [{} for _ in range(np_)]  # bid → [pred, start, left]
        self.reserved = [0] * nd
        self.out_est = OutputLengthEstimator(cfg.reserve_output_tokens)  # one model: one estimator
        self.mirror = SimMirror(cfg.speculative_ttl_ms)
        self.cache_version: list[int | None] = [None] * np_
        # Published snapshots (the owners' last poll) and their versions.
        self.p_pub: list[tuple[Any, ...]] = [(0, 0, 0, 0, 0.0, 0.0, 0.0)] * np_
        self.d_pub: list[tuple[Any, ...]] = [(0, 0, 0, 0)] * nd
        self.p_pub_ver = [0] * np_
        self.d_pub_ver = [0] * nd
        self.p_dirty = [True] * np_
        self.d_dirty = [True] * nd
        self.replicas = [_Replica(r, self, policy) for r in range(cfg.replicas)]
        self.reqs = [_Req() for _ in trace.requests]
        self.heap: list[tuple[float, int, int, Any, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.p_sched: list[float | None] = [None] * np_
        self.d_sched: list[float | None] = [None] * nd
        self.timers: list[set[float]] = [set() for _ in range(np_)]
        self.batch_members: dict[str, int] = {}
        self.n_batches = 0
        self.flushes: Counter[str] = Counter()
        # Why the origin refused requests before any engine saw them: the API code alone
        # ("no_worker", "overloaded") does not say whether decode or prefill ran out.
        self.rejections: Counter[str] = Counter()
        self.done = 0
        self.events = 0
        self.dispatched_predicted = 0.0

    # ---- event plumbing ------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _resched_p(self, w: int) -> None:
        nt = self.peng[w].next_event_time()
        if nt != self.p_sched[w]:
            self.p_sched[w] = nt
            if nt is not None:
                self._push(max(nt, self.now), _PENGINE, w)

    def _resched_d(self, d: int) -> None:
        nt = self.deng[d].next_event_time()
        if nt != self.d_sched[d]:
            self.d_sched[d] = nt
            if nt is not None:
                self._push(max(nt, self.now), _DENGINE, d)

    # ---- the run -------------------------------------------------------------------------
    def run(self) -> SimOutcome:
        cfg = self.cfg
        n = len(self.trace.requests)
        for r in self.trace.requests:
            self._push(r.arrival_ms, _ARRIVAL, r.index)
        # The stack is up and polled before the first request, as after `flexlb up`.
        self._poll()
        for rep in self.replicas:
            self._refresh(rep)
        self._push(cfg.poll_interval_ms, _POLL)
        for rep in self.replicas:
            self._push(cfg.poll_interval_ms * (1.0 + (rep.idx + 0.5) / cfg.replicas), _REFRESH, rep.idx)
        heap = self.heap
        pop = heapq.heappop
        while heap and self.done < n:
            t, _, kind, a, b = pop(heap)
            self.now = t
            self.events += 1
            if kind == _ARRIVAL:
                self._arrival(a)
            elif kind == _PENGINE:
                if self.p_sched[a] != t:
                    continue  # superseded
                self.p_sched[a] = None
                self._prefill_effects(a, self.peng[a].advance_to(t))
                self._resched_p(a)
                self._decide(a)
            elif kind == _DENGINE:
                if self.d_sched[a] != t:
                    continue
                self.d_sched[a] = None
                self._decode_effects(a, self.deng[a].advance_to(t))
                self._resched_d(a)
            elif kind == _HANDOFF:
                b.arrival_ms = t  # the owner stamps its read, as the live one does
                self.batchers[a].add(b)
                self._decide(a)
            elif kind == _TIMER:
                self.timers[a].discard(t)
                self._decide(a)
            elif kind == _REPLY:
                self._reply(a, b)
            elif kind == _RELEASE:
                self._prefill_effects(a, self.peng[a].release(b, t)[1])
                self._resched_p(a)
                self._decide(a)
            elif kind == _POLL:
                self._poll()
                self._push(t + cfg.poll_interval_ms, _POLL)
            elif kind == _REFRESH:
                rep = self.replicas[a]
                self._refresh(rep)
                self._push(t + cfg.poll_interval_ms, _REFRESH, a)
        return SimOutcome(
            records=self._records(),
            flush_reasons=dict(sorted(self.flushes.items())),
            rejections=dict(sorted(self.rejections.items())),
            batches=self.n_batches,
            events=self.events,
            end_ms=self.now,
        )

    # ---- origin: route, reserve, hand off --------------------------------------------------
    def _arrival(self, i: int) -> None:
        tr = self.trace.requests[i]
        st = self.reqs[i]
        rep = self.replicas[i % self.cfg.replicas]  # an HTTP load balancer spreading requests evenly
        st.origin = rep.idx
        size = tr.input_len
        max_new = max(1, tr.output_len)
        rid = f"r{i}"
        # Decode first: reserve KV on the chosen worker (DESIGN §3 step 5).
        if max_new > 1:
            dq = DecodeQuery(size, self.out_est.reserve(max_new))
            try:
                d = self._choose_decode(rep, dq)
            except NoWorker:
                self.rejections["decode_no_kv_headroom"] += 1
                self._fail(i, "no_worker")
                return
            need = size + dq.max_new_tokens
            refused: list[str] = []
            while self.reserved[d] + need > self.deng[d].capacity:
                # As the gateway does (`Pipeline._reserve_elsewhere`): up to two more workers.
                refused.append(self.dids[d])
                others = [v for v in rep.dviews if v.id not in refused]
                if len(refused) > 2 or not others:
                    self.rejections["decode_reserve_refused"] += 1
                    self._fail(i, "overloaded")
                    return
                try:
                    d = int(rep.dstrat.choose(dq, others, rep.rng).worker_id.rsplit("-", 1)[1])
                except NoWorker:
                    self.rejections["decode_reserve_refused"] += 1
                    self._fail(i, "overloaded")
                    return
            self.reserved[d] += need
            self.d_dirty[d] = True
            st.decode = d
            st.reserved = need
        keys = self.trace.full_block_keys(tr)
        hits = self.mirror.match_fast(keys, rep.spec, self.now) if keys else {}
        q = PrefillQuery(size, hits, self.bs)
        try:
            if rep.peer is not None:
                waiting = {self.pids[j]: n for j, n in enumerate(self.queue_items)}
                choice = rep.peer.choose(keys, q, rep.pviews, rep.rng, waiting)
            else:
                choice = self._choose_prefill(rep, q, hits)
        except NoWorker:
            self.rejections["prefill_no_worker"] += 1
            self._fail(i, "no_worker")
            return
        if self.cfg.fresh_pick and rep.peer is None and rep.pstrat.name == "cost":
            choice = self._fresh_pick(rep, q, choice)
        w = self.pindex[choice.worker_id]
        if self.queue_items[w] >= self.cfg.max_queue_len:
            self.rejections["prefill_queue_full"] += 1
            self._fail(i, "overloaded")
            return
        # SLO admission on the chosen worker, as the live origin does before its hand-off. Peer
        # imitations run without it: the routers they imitate have none.
        own_ms = choice.predicted_ms or self.formula.predict_batch([BatchItem(size, choice.hit_tokens)])
        view = rep.pviews[w]
        verdict = admission_decide(
            self.cfg.admission if rep.peer is None else _NO_ADMISSION,
            view,
            own_ms,
            self.cfg.slo_ttft_ms - (self.now - tr.arrival_ms) - self.cfg.handoff_latency_ms,
            batch_wait_ms=expected_batch_wait_ms(view, self.bcfg.wait_ms, self._window_batching),
        )
        if not verdict.admit:
            self.rejections[verdict.reason] += 1
            self._fail(i, "slo_unattainable")
            return
        st.prefill = w
        st.predicted_ms = choice.predicted_ms
        # The hand-off script: append, add the predicted ms, answer the new queued time.
        self.queued_ms[w] += choice.predicted_ms
        self.queue_items[w] += 1
        self.p_dirty[w] = True
        rep.overlay[w] = (self.queued_ms[w], self.now)
        rep.fresh_owed[w] = (self._live_load(w) - self.queued_ms[w], self.now)  # the script's read
        cap = hit_blocks_cap(size, self.bs)
        if keys:
            rep.spec.add(choice.worker_id, keys[: max(cap, 0) + 1], self.now)
        rep.pviews[w] = self._pview(rep, w)
        rep.routed_since_pool += 1
        # Trace requests name no deadline of their own: held to the cluster SLO (it caps batches),
        # ended late by the owner only when told to, as the live origin does.
        adm = self.cfg.admission
        slo = adm.mode == "slo" and rep.peer is None
        pend = Pending(
            rid,
            size,
            choice.hit_tokens,
            0.0,
            choice.predicted_ms,
            i,
            deadline_ms=tr.arrival_ms + self.cfg.slo_ttft_ms if slo else 0.0,
            drop_late=slo and adm.drop_late == "always",
        )
        self._push(self.now + self.cfg.handoff_latency_ms, _HANDOFF, w, pend)

    def _choose_prefill(self, rep: _Replica, q: PrefillQuery, hits: dict[str, int]) -> Any:
        cfg = self.cfg
        views = rep.pviews
        n = len(views)
        if n <= cfg.full_scan_max or rep.pstrat.name == "random":
            return rep.pstrat.choose(q, views, rep.rng)
        if rep.pstrat.name == "round_robin":
            last = getattr(rep.pstrat, "last", None)
            start = self.pindex[last] + 1 if last is not None else 0
            cands = [views[(start + j) % n] for j in range(min(cfg.candidates, n))]
        else:
            if rep.pool is None or rep.routed_since_pool >= cfg.candidates:
                self._refresh_pool(rep)
            idx = set(rep.pool or ())
            pindex = self.pindex
            idx.update(pindex[w] for w in hits)
            cands = [views[j] for j in sorted(idx)]
        try:
            return rep.pstrat.choose(q, cands, rep.rng)
        except NoWorker:
            return rep.pstrat.choose(q, views, rep.rng)

    def _live_load(self, w: int) -> float:
        """What the hand-off script reads in its round trip: the ledger's owed ms now plus the
        queued ms, including every replica's hand-offs since the last snapshot."""
        owed = 0.0
        now = self.now
        for pred, start, _left in self.ledger[w].values():
            elapsed = now - start if now > start else 0.0
            if pred > elapsed:
                owed += pred - elapsed
        return owed + self.queued_ms[w]

    def _fresh_pick(self, rep: _Replica, q: PrefillQuery, choice: Any) -> Any:
        """Power of two choices on fresh load: the strategy's pick and its runner-up (by this
        replica's possibly stale view) are compared on the shared state as the hand-off round
        trip reads it, and the request goes where it is predicted to finish first. Other
        replicas' decisions since the last snapshot are in that state, so replicas stop herding
        onto the worker that looked idlest to all of them."""
        views = [v for v in rep.pviews if v.id != choice.worker_id]
        try:
            alt = rep.pstrat.choose(q, views, rep.rng)
        except NoWorker:
            return choice
        a, b = self.pindex[choice.worker_id], self.pindex[alt.worker_id]
        ca = choice.predicted_ms + self._live_load(a)
        cb = alt.predicted_ms + self._live_load(b)
        tie = max(0.1 * ca, 20.0)  # the strategy's own tie band: keep its (cache-affine) pick
        return alt if cb < ca - tie else choice

    def _refresh_pool(self, rep: _Replica) -> None:
        rep.routed_since_pool = 0
        probe = PrefillQuery(1, {}, self.bs)
        try:
            kept = top_candidates(probe, rep.pviews, self.cfg.candidates)
        except NoWorker:
            kept = []
        rep.pool = [self.pindex[v.id] for v in kept]

    def _choose_decode(self, rep: _Replica, q: DecodeQuery) -> int:
        cfg = self.cfg
        views = rep.dviews
        n = len(views)
        strat = rep.dstrat
        if n <= cfg.full_scan_max or strat.name == "random":
            c = strat.choose(q, views, rep.rng)
            return int(c.worker_id.rsplit("-", 1)[1])
        if strat.name == "round_robin":
            last = getattr(strat, "last", None)
            start = int(last.rsplit("-", 1)[1]) + 1 if last is not None else 0
            cands = [views[(start + j) % n] for j in range(min(cfg.candidates, n))]
        else:
            if rep.dpool is None:
                self._decode_pool(rep)
            top, band = rep.dpool or [], rep.dband or []
            k = cfg.candidates
            if len(band) > 2 * k:
                # The strategy draws among near-tied workers at random; a fixed shortlist would
                # herd a whole refresh interval's requests onto it. A fresh sample of the tie band
                # per request spreads them as the full-fleet draw does.
                idx = set(top)
                idx.update(rep.band_rng.sample(band, 2 * k))
                cands = [views[j] for j in sorted(idx)]
            else:
                cands = [views[j] for j in sorted(set(top) | set(band))]
        try:
            c = strat.choose(q, cands, rep.rng)
        except NoWorker:
            c = strat.choose(q, views, rep.rng)
        return int(c.worker_id.rsplit("-", 1)[1])

    def _decode_pool(self, rep: _Replica) -> None:
        """The best ``candidates`` decode workers by the strategy's own ranking, and the workers tied
        with the best (kv_headroom: within its tie_pct; least_load: equal key). Decode views only
        change at a refresh, so this holds until the next one."""
        views = rep.dviews
        n = len(views)
        if rep.dstrat.name == "least_load":
            keys = [(v.reserved_tokens, v.running) for v in views]
            order = sorted(range(n), key=lambda j: (keys[j], j))
            best = keys[order[0]]
            band = [j for j in range(n) if keys[j] == best]
        else:  # kv_headroom: most unreserved KV first
            heads = [decode_headroom(v) for v in views]
            order = sorted(range(n), key=lambda j: (-heads[j], j))
            best_h = heads[order[0]]
            floor = best_h - best_h * float(getattr(rep.dstrat, "tie_pct", 0.0))
            band = [j for j in range(n) if heads[j] >= floor]
        rep.dpool = sorted(order[: self.cfg.candidates])
        rep.dband = band

    # ---- owner: batcher decisions and dispatch ---------------------------------------------
    def _decide(self, w: int) -> None:
        b = self.batchers[w]
        if not b.pending:
            return
        while True:
            d = b.decide(self.now)
            for p, code in d.failed:
                if code == "deadline_exceeded":
                    self.rejections["deadline_passed_in_queue"] += 1
                self.queued_ms[w] = max(0.0, self.queued_ms[w] - p.predicted_ms)
                self.queue_items[w] -= 1
                api = _ENGINE_TO_API.get(code, code)
                self._push(self.now + self.cfg.reply_latency_ms, _REPLY, p.payload, (api, None))
            if d.items:
                b.batch_started(d.items, self.now)
                self.flushes[d.reason] += 1
                self._dispatch(w, d.items)
                continue
            if d.wake_at_ms is not None and d.wake_at_ms not in self.timers[w]:
                self.timers[w].add(d.wake_at_ms)
                self._push(max(d.wake_at_ms, self.now), _TIMER, w)
            break

    def _dispatch(self, w: int, items: list[Pending]) -> None:
        self.n_batches += 1
        bid = f"b{self.n_batches}"
        taken = 0.0
        for p in items:
            taken += p.predicted_ms
            self.queue_items[w] -= 1
            self.reqs[p.payload].batch_size = len(items)
        # commit_batch: the ledger owes the batch's own prediction, not yet started (it owes all
        # of it until the engine's BatchStarted anchors it); handoff.take removes the members'
        # hand-off predictions from the queued time.
        predicted = self.formula.predict_batch([p.item for p in items])
        self.ledger[w][bid] = [predicted, _NOT_STARTED, float(len(items))]
        self.queued_ms[w] = max(0.0, self.queued_ms[w] - taken)
        self.dispatched_predicted += predicted
        self.p_dirty[w] = True
        tr = self.trace
        reqs = [
            PrefillRequest(p.id, p.input_tokens, tr.full_block_keys(tr.requests[p.payload])) for p in items
        ]
        out = self.peng[w].submit(bid, reqs, self.now)
        self._prefill_effects(w, out.effects)
        self._resched_p(w)

    def _prefill_effects(self, w: int, effects: Sequence[Effect]) -> None:
        for e in effects:
            if isinstance(e, PrefillResult):
                i = int(e.request_id[1:])
                self._settle(w, e.batch_id)
                if e.status == EngineStatus.OK:
                    res: tuple[str | None, PrefillResult | None] = (None, e)
                else:
                    res = (_ENGINE_TO_API.get(e.status, "worker_error"), e)
                self._push(self.now + self.cfg.reply_latency_ms, _REPLY, i, res)
            elif isinstance(e, BatchStarted):
                entry = self.ledger[w].get(e.batch_id)
                if entry is not None:  # owed time runs from the engine's real start
                    entry[1] = e.t_ms
            elif isinstance(e, BatchDone):
                self.batchers[w].batch_finished(self.now)
        self.p_dirty[w] = True

    def _settle(self, w: int, bid: str) -> None:
        entry = self.ledger[w].get(bid)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self.ledger[w][bid]

    # ---- origin: results, decode -----------------------------------------------------------
    def _reply(self, i: int, res: tuple[str | None, PrefillResult | None]) -> None:
        code, r = res
        st = self.reqs[i]
        peer = self.replicas[st.origin].peer
        if peer is not None and st.prefill >= 0:
            peer.finished(self.pids[st.prefill], -(-self.trace.requests[i].input_len // self.bs))
        if code is not None:
            self._fail(i, code)
            return
        assert r is not None
        rep = self.replicas[st.origin]
        w = st.prefill
        st.t_first = self.now
        st.cached = r.cached_tokens
        # What the live origin does with a reply: remember the finished prefill (owed correction)
        # and take it off its queued overlay.
        rep.finished.setdefault(w, []).append((st.predicted_ms, r.start_ms, r.end_ms, self.now))
        ov = rep.overlay.get(w)
        if ov is not None:
            rep.overlay[w] = (max(0.0, ov[0] - st.predicted_ms), ov[1])
        rep.pviews[w] = self._pview(rep, w)
        tr = self.trace.requests[i]
        max_new = max(1, tr.output_len)
        if max_new == 1:
            st.t_end = self.now
            self._complete(i)
            return
        d = st.decode
        eng = self.deng[d]
        self._decode_effects(
            d, eng.submit(DecodeRequest(r.request_id, tr.input_len, max_new - 1, 1, tr.input_len), self.now)
        )
        self._resched_d(d)
        self.d_dirty[d] = True
        # The decode worker releases the prefill KV once it has fetched it.
        fetch = eng.transfer_ms(tr.input_len) + eng.faults.extra_latency_ms
        self._push(self.now + fetch, _RELEASE, w, r.request_id)

    def _decode_effects(self, d: int, effects: Sequence[Effect]) -> None:
        for e in effects:
            if isinstance(e, DecodeFinished):
                i = int(e.request_id[1:])
                if e.reason == FINISH_LENGTH:
                    self.reqs[i].t_end = e.t_ms
                    self.out_est.observe(e.generated + 1)  # + the first token, from prefill
                    self._complete(i)
                else:
                    self._fail(i, "worker_error")
        self.d_dirty[d] = True

    def _release_reservation(self, st: _Req) -> None:
        if st.reserved and st.decode >= 0:
            self.reserved[st.decode] -= st.reserved
            self.d_dirty[st.decode] = True
            st.reserved = 0

    def _complete(self, i: int) -> None:
        st = self.reqs[i]
        if st.done:
            return
        st.done = True
        self._release_reservation(st)
        self.done += 1

    def _fail(self, i: int, code: str) -> None:
        st = self.reqs[i]
        if st.done:
            return
        st.error = code
        st.done = True
        self._release_reservation(st)
        self.done += 1

    # ---- owners' polls and replicas' refreshes ----------------------------------------------
    def _poll(self) -> None:
        now = self.now
        for w, eng in enumerate(self.peng):
            ledger = self.ledger[w]
            if not self.p_dirty[w] and not ledger:
                continue
            self.p_dirty[w] = False
            kv = eng.kv_view()
            owed = 0.0
            for pred, start, _left in ledger.values():
                elapsed = now - start if now > start else 0.0
                if pred > elapsed:
                    owed += pred - elapsed
            queued_batches = sum(1 for b in eng.live_view() if b["phase"] == "queued")
            snap = (
                kv["kv_total_tokens"],
                kv["kv_free_tokens"],
                kv["kv_evictable_tokens"],
                queued_batches,
                round(self.queued_ms[w], 3),
                round(owed, 3),
                now,
            )
            if snap[:6] != self.p_pub[w][:6]:
                self.p_pub[w] = snap
                self.p_pub_ver[w] += 1
            else:
                self.p_pub[w] = snap  # same load; only the anchor time moves
            diff = eng.cache_diff(self.cache_version[w])
            if diff.full or diff.added or diff.removed or self.cache_version[w] is None:
                self.mirror.apply_diff(self.pids[w], "sim", diff.version, diff.added, diff.removed, diff.full)
            self.cache_version[w] = diff.version
        for d, deng in enumerate(self.deng):
            if not self.d_dirty[d]:
                continue
            self.d_dirty[d] = False
            kv = deng.kv_view()
            running = len(deng.live_view()["running"])
            dsnap = (kv["kv_total_tokens"], kv["kv_free_tokens"], self.reserved[d], running)
            if dsnap != self.d_pub[d]:
                self.d_pub[d] = dsnap
                self.d_pub_ver[d] += 1

    def _refresh(self, rep: _Replica) -> None:
        rep.snap_time = self.now
        first = not rep.pviews
        if first:
            rep.pviews = [self._pview(rep, w) for w in range(len(self.pids))]
            rep.dviews = [self._dview(rep, d) for d in range(len(self.dids))]
        changed = set(rep.overlay)  # the refresh makes every overlay older than the snapshot
        rep.overlay.clear()
        rep.fresh_owed.clear()
        for w, ver in enumerate(self.p_pub_ver):
            if ver != rep.p_seen[w]:
                rep.p_seen[w] = ver
                rep.psnap[w] = self.p_pub[w]
                changed.add(w)
            elif rep.finished.get(w):
                rep.psnap[w] = self.p_pub[w]
                changed.add(w)
        for w in sorted(changed):
            rep.pviews[w] = self._pview(rep, w)
        dchanged = False
        for d, ver in enumerate(self.d_pub_ver):
            if ver != rep.d_seen[d]:
                rep.d_seen[d] = ver
                rep.dsnap[d] = self.d_pub[d]
                rep.dviews[d] = self._dview(rep, d)
                dchanged = True
        if dchanged or first:
            rep.dpool = None
        rep.pool = None
        rep.spec.expire(self.now)

    def _pview(self, rep: _Replica, w: int) -> WorkerView:
        """`Pipeline.views("prefill")` for one worker, from this replica's copy of the snapshot."""
        s = rep.psnap[w]
        queued = s[4]
        ov = rep.overlay.get(w)
        if ov is not None and ov[1] >= rep.snap_time:
            queued = ov[0]
        owed = s[5]
        done = rep.finished.get(w)
        if done:  # as Pipeline._owed: our prefills that finished since the snapshot
            owed = owed_less_finished(owed, s[6], done, self.now - 5000.0)
        fresh = rep.fresh_owed.get(w)
        if fresh is not None and fresh[1] >= rep.snap_time:  # as Pipeline.views: aged since read
            owed = max(0.0, fresh[0] - (self.now - fresh[1]))
        return WorkerView(
            id=self.pids[w],
            role="prefill",
            up=True,
            kv_total_tokens=s[0],
            kv_free_tokens=s[1],
            kv_evictable_tokens=s[2],
            queue_len=s[3],
            queued_ms=queued,
            owed_ms=owed,
        )

    def _dview(self, rep: _Replica, d: int) -> WorkerView:
        s = rep.dsnap[d]
        return WorkerView(
            id=self.dids[d],
            role="decode",
            up=True,
            kv_total_tokens=s[0],
            kv_free_tokens=s[1],
            reserved_tokens=s[2],
            running=s[3],
        )

    # ---- results ----------------------------------------------------------------------------
    def _records(self) -> list[RequestRecord]:
        out: list[RequestRecord] = []
        for tr, st in zip(self.trace.requests, self.reqs, strict=True):
            max_new = max(1, tr.output_len)
            ttft = e2e = tpot = None
            if st.error is None and st.t_first is not None and st.t_end is not None:
                ttft = st.t_first - tr.arrival_ms
                e2e = st.t_end - tr.arrival_ms
                if max_new > 1:
                    tpot = (st.t_end - st.t_first) / (max_new - 1)
            elif st.error is None:
                st.error = "unfinished"
            out.append(
                RequestRecord(
                    request_id=f"r{tr.index}",
                    arrival_ms=tr.arrival_ms,
                    input_tokens=tr.input_len,
                    output_tokens=max_new,
                    ttft_ms=ttft,
                    tpot_ms=tpot,
                    e2e_ms=e2e,
                    error=st.error,
                    cached_tokens=st.cached if st.error is None else 0,
                    prefill_worker=self.pids[st.prefill] if st.prefill >= 0 else None,
                    decode_worker=self.dids[st.decode] if st.decode >= 0 else None,
                    batch_size=st.batch_size,
                )
            )
        return out


def mean_cold_prefill_ms(trace: Trace, cfg: SimConfig) -> float:
    """Mean modelled time of each request's prefill alone, with no cache hit: the denominator of the
    capacity estimate behind ``--load``."""
    prof = cfg.engine_profile()
    limit = min(prof.kv_capacity_tokens, prof.max_context_tokens)
    vals = [
        prof.prefill_batch_ms([BatchItem(r.input_len, 0)]) for r in trace.requests if 0 < r.input_len <= limit
    ]
    return sum(vals) / len(vals) if vals else 0.0
