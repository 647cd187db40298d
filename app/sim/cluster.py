"""A discrete-event model of one FlexLB cluster, driving the real scheduling and engine code.

What runs is the production code, on a virtual clock:

- routing: `app.scheduling.policy` policies (`PolicyBook.build`, the gateway's plugins) over
  `WorkerView` snapshots built the way `app/request/pipeline.py` builds them;
- batching: one `app.scheduling.batcher.Batcher` per prefill worker (the owner's), with the gateway's
  formula (`app.scheduling.formula`) as its predictor;
- engines: `workers.engine.prefill.PrefillEngine` (prefix cache = LRU bounded by the real KV capacity)
  and `workers.engine.decode.DecodeEngine`, with `workers.engine.profiles` timing;
- cache knowledge: the gateway's `CacheMirror` (`app/cache/mirror.py`), fed by cache diffs at each poll,
  with one `SpecIndex` of speculative entries per replica.

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
  against the worker's KV, as the reserve script does. A peer router imitation (`Policy.peer`)
  reserves nothing: its own picker chooses the decode worker and the decode engines admit on use
  and preempt (`admission="expected"`), as behind the routers imitated.

Determinism: one heap ordered by (time, insertion number), every random draw from a generator seeded
from the run's seed, and no iteration over unordered sets where the order could matter, so the same
inputs give the same records.

Large fleets: above ``full_scan_max`` workers a replica does not hand all views to the policy.
Prefill candidates are the prefix holders plus a least-loaded shortlist from `top_candidates`
(recomputed at each snapshot refresh and after every ``candidates`` of its own routings), which
gives ``cost``, ``prefix`` and ``least_load`` the same best score as the whole fleet while the
shortlist is fresh; ``round_robin`` gets the next ``candidates`` workers by id after its last choice,
which is exactly what it would pick from the whole fleet; decode policies get the best few by their
own ranking, which cannot go stale between refreshes because decode views only change then. A
policy that finds no eligible candidate is retried over the whole fleet.

Modules: this one holds the event loop, the owners and the prefill workers; `app/sim/decode_side.py`
the decode workers and the origin's decode reservations; `app/sim/replica.py` a replica's views,
policies and shortlists; `app/sim/polls.py` the owners' polls; `app/sim/outcome.py` the
per-request state and records.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from app.cache.mirror import CacheMirror
from app.protocol.blocks import hit_blocks_cap
from app.protocol.codes import EngineStatus
from app.scheduling.batcher import Batcher, BatcherConfig, Pending
from app.scheduling.commit import commit_step, committed_ms, owed_ms
from app.scheduling.routing import Choice, NoWorker, PrefillQuery, overlay_less_prefilled
from app.sim.admit import admit_on_live
from app.sim.config import SimConfig
from app.sim.decode_side import DecodeSide
from app.sim.outcome import ReqState, SimOutcome, build_records, mean_cold_prefill_ms
from app.sim.polls import poll_owners
from app.sim.replica import SimReplica
from app.traces.model import Trace
from workers.engine.effects import BatchDone, BatchStarted, Effect, PrefillResult
from workers.engine.prefill import PrefillEngine, PrefillRequest

__all__ = ["ClusterSim", "SimOutcome", "mean_cold_prefill_ms"]

# Event kinds. At equal times the insertion number orders events, so ties are reproducible.
_ARRIVAL, _HANDOFF, _TIMER, _PENGINE, _DENGINE, _REPLY, _RELEASE, _POLL, _REFRESH = range(9)

# A ledger batch the engine has not started yet: it owes its whole prediction (elapsed 0).
_NOT_STARTED = float("inf")

# Engine statuses the origin maps to API codes (app/request/pipeline.py ENGINE_TO_API).
_ENGINE_TO_API = {
    "cancelled": "cancelled",
    "too_long": "invalid_request",
    "invalid_request": "invalid_request",
    "duplicate": "duplicate_request",
}


class ClusterSim(DecodeSide):
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
        self.book = cfg.policy_book()
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
        predict = self.formula.predict_batch
        self.batchers = [Batcher(batcher, predict) for _ in range(np_)]
        self._window_batching = batcher.holds_window
        # "Redis": gateway-side shared state.
        self.queued_ms = [0.0] * np_  # hand-off queue's predicted ms per prefill worker
        self.queue_items = [0] * np_
        self.ledger: list[dict[str, list[float]]] = [{} for _ in range(np_)]  # bid → [pred, start, left]
        self._init_decode_side()  # engines, reservations, holds, output lengths (app/sim/decode_side.py)
        self.mirror = CacheMirror(cfg.speculative_ttl_ms, holders_index=True)
        self.cache_version: list[int | None] = [None] * np_
        # Published snapshots (the owners' last poll) and their versions.
        self.p_pub: list[tuple[Any, ...]] = [(0, 0, 0, 0, 0.0, 0.0, 0.0)] * np_
        self.d_pub: list[tuple[Any, ...]] = [(0, 0, 0, 0)] * nd
        self.p_pub_ver = [0] * np_
        self.d_pub_ver = [0] * nd
        self.p_dirty = [True] * np_
        self.d_dirty = [True] * nd
        self.replicas = [SimReplica(r, self, policy) for r in range(cfg.replicas)]
        if self.replicas[0].peer:
            # The engines behind the peer routers (vLLM, SGLang) admit on the KV a sequence uses
            # and preempt (recompute) when the batch's growth overflows it; nothing is reserved
            # for them upstream (`_arrival`), so `reserve` here would only queue what they run.
            for e in self.deng:
                e.set_admission("expected")
        self.reqs = [ReqState() for _ in trace.requests]
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
        poll_owners(self)
        for rep in self.replicas:
            rep.refresh(self.now, self.p_pub, self.p_pub_ver, self.d_pub, self.d_pub_ver)
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
                b.arrival_ms = t  # the owner stamps its read, as the live one does (`admit`)
                if cfg.shared_speculative:
                    self._publish_speculative(a, b)
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
                poll_owners(self)
                self._push(t + cfg.poll_interval_ms, _POLL)
            elif kind == _REFRESH:
                rep = self.replicas[a]
                rep.refresh(self.now, self.p_pub, self.p_pub_ver, self.d_pub, self.d_pub_ver)
                self._push(t + cfg.poll_interval_ms, _REFRESH, a)
        return SimOutcome(
            records=build_records(self.trace, self.reqs, self.pids, self.dids),
            flush_reasons=dict(sorted(self.flushes.items())),
            rejections=dict(sorted(self.rejections.items())),
            batches=self.n_batches,
            events=self.events,
            end_ms=self.now,
            # Decode preemptions (admission="expected": a sequence evicted and recomputed when the
            # running batch's growth overflowed the KV): the churn an under-reservation costs.
            extra={"decode_preemptions": sum(e.preemptions for e in self.deng)},
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
        keys = self.trace.full_block_keys(tr)
        if max_new > 1 and rep.peer:
            # A peer router reserves nothing: it picks the decode worker by its own policy and the
            # decode engine admits on use (`admission="expected"`, set in __init__).
            st.decode = rep.peer_decode(PrefillQuery(size, {}, self.bs, keys))
        elif max_new > 1 and not self._reserve_decode(rep, i, st, keys):  # decode first (§3 step 5)
            return
        rep.age(self.now)  # the live origin ages owed ms read by its hand-offs per request
        q = rep.prefill_query(size, keys, self.now)
        try:
            if rep.peer:
                # The imitations read queue lengths as the peer routers scrape them from the
                # engines (fresh), not from the owners' snapshot.
                views = [replace(v, queue_len=n) for v, n in zip(rep.pviews, self.queue_items, strict=True)]
                choice = rep.pstrat.choose(q, views, rep.rng)
            else:
                choice = rep.choose_prefill(q)
        except NoWorker:
            self.rejections["prefill_no_worker"] += 1
            self._fail(i, "no_worker")
            return
        alt: Choice | None = None
        first = choice
        if self.cfg.fresh_pick and not rep.peer:
            alt, choice = rep.fresh_pick(q, choice, self._fresh_loads)
        w = self.pindex[choice.worker_id]
        if self.queue_items[w] >= self.cfg.max_queue_len:
            self.rejections["prefill_queue_full"] += 1
            self._fail(i, "overloaded")
            return
        verdict, choice = admit_on_live(self, rep, i, first, alt, choice)
        if not verdict.admit:
            self.rejections[verdict.reason] += 1
            self._fail(i, verdict.reason)
            return
        w = self.pindex[choice.worker_id]
        st.prefill = w
        st.predicted_ms = choice.predicted_ms
        # The hand-off script: append, add the predicted ms, answer the new queued time.
        self.queued_ms[w] += choice.predicted_ms
        self.queue_items[w] += 1
        self.p_dirty[w] = True
        rep.overlay[w] = (self.queued_ms[w], self.now)
        rep.overlay_of[w] = i  # this answer holds request i (`overlay_less_prefilled`)
        rep.note_fresh_owed(w, self._live_load(w) - self.queued_ms[w], self.now)  # the script's read
        cap = hit_blocks_cap(size, self.bs)
        if keys:
            rep.spec.add(choice.worker_id, keys[: max(cap, 0) + 1], self.now)
        rep.pviews[w] = rep.pview(w, self.now)
        rep.routed_since_pool += 1
        # Trace requests name no deadline of their own: held to the cluster SLO (it caps batches),
        # ended late by the owner only when told to, as the live origin does.
        adm = self.cfg.admission
        slo = adm.mode == "slo" and not rep.peer
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

    def _publish_speculative(self, w: int, p: Pending) -> None:
        """`SimConfig.shared_speculative` (live: app/cache/shared_spec.py): the owner of worker ``w``
        publishes the just-read hand-off's prefix to every other replica's speculative entries (the
        origin's has it), not to a peer imitation's (the routers they imitate have no such channel)."""
        tr = self.trace.requests[p.payload]
        keys = self.trace.full_block_keys(tr)
        if not keys:
            return
        cap = hit_blocks_cap(tr.input_len, self.bs)
        origin = self.reqs[p.payload].origin
        for rep in self.replicas:
            if rep.idx != origin and not rep.peer:
                rep.spec.add(self.pids[w], keys[: max(cap, 0) + 1], self.now)

    def _fresh_loads(self, wid: str) -> tuple[float, float]:
        """(queued ms, owed ms) of a prefill worker as a round trip to the shared state reads them
        now, every replica's hand-offs included (`Policy.second_look`'s ``fresh``)."""
        w = self.pindex[wid]
        ledger = self.ledger[w].values()
        return self.queued_ms[w], owed_ms(((pred, start) for pred, start, _left in ledger), self.now)

    def _live_load(self, w: int) -> float:
        """What the hand-off script reads in its round trip: the ledger's owed ms now plus the
        queued ms, including every replica's hand-offs since the last snapshot."""
        ledger = self.ledger[w].values()
        return owed_ms(((pred, start) for pred, start, _left in ledger), self.now) + self.queued_ms[w]

    # ---- owner: batcher decisions and dispatch ---------------------------------------------
    def _decide(self, w: int) -> None:
        b = self.batchers[w]
        if not b.pending:
            return
        while True:
            d = commit_step(b, self.now)
            for p, code in d.failed:
                if code == "deadline_exceeded":
                    self.rejections["deadline_passed_in_queue"] += 1
                self.queued_ms[w] = max(0.0, self.queued_ms[w] - p.predicted_ms)
                self.queue_items[w] -= 1
                api = _ENGINE_TO_API.get(code, code)
                self._push(self.now + self.cfg.reply_latency_ms, _REPLY, p.payload, (api, None))
            if d.items:
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
        taken = committed_ms(items)
        for p in items:
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
        if st.prefill >= 0:
            q = PrefillQuery(self.trace.requests[i].input_len, {}, self.bs)
            self.replicas[st.origin].pstrat.finished(self.pids[st.prefill], q)
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
        ov = overlay_less_prefilled(rep.overlay.get(w), rep.overlay_of.get(w), i, st.predicted_ms)
        if ov is not None:
            rep.overlay[w] = ov
            rep.overlay_of[w] = -1
        rep.pviews[w] = rep.pview(w, self.now)
        tr = self.trace.requests[i]
        max_new = max(1, tr.output_len)
        if max_new == 1:
            st.t_end = self.now
            self._complete(i)
            # No decode will fetch this KV: the live origin unpins it at once (`Pipeline.run`,
            # max_new_tokens == 1). Left to the handle's 30 s expiry, prefill-only traffic pinned
            # the prefill workers' KV full and stalled their engines behind predictions that
            # could not see it (late TTFTs on trace_30min, half of it prefill-only).
            self._push(self.now + self.cfg.reply_latency_ms, _RELEASE, w, r.request_id)
            return
        d = st.decode
        eng = self.deng[d]
        self._decode_effects(d, eng.submit(self._decode_request(r.request_id, tr), self.now))
        self._resched_d(d)
        self.d_dirty[d] = True
        # The decode worker releases the prefill KV once it has fetched it.
        fetch = eng.transfer_ms(tr.input_len) + eng.faults.extra_latency_ms
        self._push(self.now + fetch, _RELEASE, w, r.request_id)

    def _complete(self, i: int) -> None:
        st = self.reqs[i]
        if st.done:
            return
        st.done = True
        self._release_reservation(st, i)
        self.done += 1

    def _fail(self, i: int, code: str) -> None:
        st = self.reqs[i]
        if st.done:
            return
        st.error = code
        st.done = True
        self._release_reservation(st, i)
        self.done += 1
