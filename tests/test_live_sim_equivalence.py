"""The live gateway and the simulator decide alike on the same inputs (issue #18, Deliver 2).

The simulator runs a trace; at every decision it makes, the live code is asked the same question
with the same inputs and must give the same answer:

- routing: each simulated replica's decode and prefill choice is also made by a live `Pipeline`
  (`choose_decode`, `views`, `choose_prefill`) of a live `Replica` whose snapshots, hand-off
  overlays, finished prefills, cache mirror and random generator state are the simulated replica's
  at that moment (the snapshot fields written as the owners' poller writes them, the times converted
  from the simulator's ms to the gateway's wall seconds). The views, the choice (worker, hit tokens,
  predicted ms) and the generator state afterwards must all be equal.
- batching: each simulated owner's batcher is shadowed by a live `OwnerDispatcher` for the same
  worker: every hand-off the simulated owner reads is `admit`ted by the live one at the same time,
  every decision (`decide`) and every finished batch (`batch_finished`) is made on both, and the
  decisions (members in order, reason, refused members, wake-up time) must be equal.
- decode holds (`FLEXLB_DECODE_PREFER_HELD`): on requests sharing long prompt prefixes, each
  simulated replica's decode pick is also made by the live `Pipeline` from the request's own block
  keys and the live origin's own hold mirror, which the live code keeps (`note_decode_hold` after
  the reservation, the ending's drop): the `DecodeQuery` (its `held` included) and the worker must
  be equal, with 1 replica and with 2 (each origin sees its own holds).

Nothing of the decision code is replaced: the simulated replica and batcher are subclasses that
call their parents' code and only add the live call next to it. The live objects are never
started (no Redis, no workers): the decisions read only in-process state. The cache mirror is the
simulator's own object (its confirmed keys) with the simulated replica's speculative index as its
`spec`, exactly what a live replica's mirror holds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from app.cache.mirror import CacheMirror
from app.cluster.leases import Lease
from app.config import Settings
from app.dispatch.owner import OwnerDispatcher, QueueItem
from app.gateway.errors import ApiError
from app.gateway.replica import Replica
from app.request.pipeline import GenRequest, Pipeline, Progress
from app.scheduling.batcher import Batcher, BatcherConfig, Decision, Pending
from app.scheduling.policy import PREFILL
from app.scheduling.reserve import DecodeHoldMirror
from app.scheduling.routing import Choice, DecodeQuery, NoWorker, PrefillQuery, WorkerView
from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig, batcher_config
from app.sim.replica import SimReplica
from app.traces import synthetic_trace
from app.traces.model import Trace, TraceRequest

URL = "redis://127.0.0.1:1/0"  # never connected: the decisions read only in-process state


class Tally:
    def __init__(self) -> None:
        self.routed = 0
        self.decisions = 0
        self.batched = 0  # released batches with more than one member
        self.hits = 0  # prefill choices with a cache hit
        self.refusals = 0  # decisions with refused members


class LiveReplica(SimReplica):
    """A simulated replica that asks a live Pipeline every routing question it answers."""

    def __init__(self, idx: int, sim: ClusterSim, policy: str, live: Replica, tally: Tally) -> None:
        super().__init__(idx, sim, policy)
        self.sim = sim
        self.live = live
        self.tally = tally

    def _sync(self) -> Pipeline:
        """The live replica's routing inputs := this simulated replica's, now."""
        sim, r, pipe = self.sim, self.live, self.live.pipeline
        r.views.workers = _registry(sim)
        snaps: dict[str, dict[str, str]] = {}
        for w, s in zip(sim.pids, self.psnap, strict=True):
            snaps[w] = {
                "health": "up",
                "block_size": str(sim.bs),
                "kv_total_tokens": str(s[0]),
                "kv_free_tokens": str(s[1]),
                "kv_evictable_tokens": str(s[2]),
                "queue_len": str(s[3]),
                "queued_ms": repr(s[4]),
                "owed_ms": repr(s[5]),
                "now_ms": repr(s[6]),
            }
        for w, s in zip(sim.dids, self.dsnap, strict=True):
            snaps[w] = {
                "health": "up",
                "kv_total_tokens": str(s[0]),
                "kv_free_tokens": str(s[1]),
                "reserved_tokens": str(s[2]),
                "running": str(s[3]),
            }
        r.views.snapshots = snaps
        r.views.snapshot_time = dict.fromkeys(snaps, self.snap_time / 1000)
        r.views.queued_overlay = {sim.pids[w]: (q, t / 1000) for w, (q, t) in self.overlay.items()}
        pipe.owed_overlay = {sim.pids[w]: (o, t / 1000) for w, (o, t) in self.fresh_owed.items()}
        pipe.finished = {
            sim.pids[w]: [(a, b, c, t / 1000) for a, b, c, t in done] for w, done in self.finished.items()
        }
        sim.mirror.spec = self.spec  # the simulator passes each replica's index; a live mirror owns one
        pipe.mirror = sim.mirror
        pipe.rng.setstate(self.rng.getstate())
        return pipe

    def choose_decode(self, q: DecodeQuery) -> int:
        pipe = self._sync()
        req = GenRequest("r", [1] * q.input_tokens, q.max_new_tokens, 60_000)
        p = Progress()
        try:
            pipe.choose_decode(req, p)
            got = p.decode_worker
        except ApiError as err:
            got = f"NoWorker: {err.message}"
        assert pipe.views("decode") == self.dviews
        try:
            d = super().choose_decode(q)
            want = self.dids[d]
        except NoWorker as exc:
            want = f"NoWorker: {exc.reason}"
            assert got == want
            raise
        assert got == want
        assert pipe.rng.getstate() == self.rng.getstate()
        return d

    def prefill_query(self, size: int, keys: Sequence[int], now: float) -> PrefillQuery:
        self.asked = (size, list(keys), now)  # the live side computes its own hits from the keys
        return super().prefill_query(size, keys, now)

    def choose_prefill(self, q: PrefillQuery) -> Choice:
        size, keys, now = self.asked
        pipe = self._sync()
        views = pipe.views("prefill", now / 1000)
        assert _same_views(views, self.pviews), f"prefill views differ at {now} ms"
        try:
            got: Any = pipe.choose_prefill(size, keys, self.bs, views, now / 1000)
        except NoWorker as exc:
            got = f"NoWorker: {exc.reason}"
        try:
            want = super().choose_prefill(q)
        except NoWorker as exc:
            assert got == f"NoWorker: {exc.reason}"
            raise
        assert isinstance(got, Choice) and replace(got, score=0.0) == replace(want, score=0.0), now
        assert math.isclose(got.score, want.score, abs_tol=1e-9)  # in ms: rounding, as the views
        assert pipe.rng.getstate() == self.rng.getstate()
        self.tally.routed += 1
        self.tally.hits += want.hit_tokens > 0
        return want


class LiveBatcher(Batcher):
    """A simulated owner's batcher whose every input also goes to a live OwnerDispatcher, and
    whose every decision must equal the live owner's."""

    def __init__(
        self, cfg: BatcherConfig, predict: Any, sim: ClusterSim, owner: OwnerDispatcher, tally: Tally
    ) -> None:
        super().__init__(cfg, predict)
        self.sim = sim
        self.owner = owner
        self.tally = tally

    def add(self, p: Pending) -> None:
        super().add(p)
        item = QueueItem(f"{p.id}-0", p.id, "origin", [1] * p.input_tokens, p.predicted_ms, 0.0)
        item.hit_tokens = p.hit_tokens
        item.ttft_deadline_ms, item.drop_late = p.deadline_ms, p.drop_late
        self.owner.admit(item, self.sim.now)

    def decide(self, now_ms: float, worker_busy: bool | None = None) -> Decision:
        want = super().decide(now_ms, worker_busy)
        got = self.owner.decide(now_ms)
        assert _shape(got) == _shape(want), f"batching decision differs at {now_ms} ms"
        self.tally.decisions += 1
        self.tally.batched += len(want.items) > 1
        self.tally.refusals += bool(want.failed)
        return want

    def batch_finished(self, now_ms: float | None = None) -> None:
        super().batch_finished(now_ms)
        self.owner.batch_finished(self.sim.now if now_ms is None else now_ms)


def _same_views(a: list[WorkerView], b: list[WorkerView]) -> bool:
    """Equal, loads up to float rounding: the live side reads times in wall seconds (the simulator's
    ms / 1000 here), so an aged owed ms may differ in its last bits."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if replace(x, queued_ms=0.0, owed_ms=0.0) != replace(y, queued_ms=0.0, owed_ms=0.0):
            return False
        if not (
            math.isclose(x.queued_ms, y.queued_ms, abs_tol=1e-9)
            and math.isclose(x.owed_ms, y.owed_ms, abs_tol=1e-9)
        ):
            return False
    return True


def _shape(d: Decision) -> tuple[Any, ...]:
    return (
        [p.id for p in d.items],
        d.reason if d.items else "",
        [(p.id, code) for p, code in d.failed],
        d.wake_at_ms,
    )


def _registry(sim: ClusterSim) -> dict[str, dict[str, str]]:
    """The registry as a live replica lists it (`Registry.list`) for the simulated workers."""
    return {
        **{w: {"role": "prefill", "state": "active", "address": "127.0.0.1:1"} for w in sim.pids},
        **{w: {"role": "decode", "state": "active", "address": "127.0.0.1:1"} for w in sim.dids},
    }


def _live(policy: str, decode: str) -> Replica:
    return Replica(Settings(prefill_strategy=policy, decode_strategy=decode, replica_id="equiv"), URL)


CASES = [
    # (prefill policy, decode policy, batching, arrival rate /s, TTFT SLO ms): rates that keep the
    # prefill workers busy enough to batch; the last SLO is tight enough that the batcher refuses some
    ("cost", "kv_headroom", "fixed_window", 200.0, 1500.0),
    ("prefix", "least_load", "slo", 300.0, 1500.0),
    ("least_load", "random", "fixed_window", 400.0, 1500.0),
    ("round_robin", "kv_headroom", "direct", 40.0, 1500.0),
    ("random", "least_load", "slo", 600.0, 120.0),
]


@pytest.mark.parametrize(("policy", "decode", "batching", "rate", "slo"), CASES)
async def test_live_and_simulated_decisions_are_identical(
    policy: str, decode: str, batching: str, rate: float, slo: float
) -> None:
    trace = synthetic_trace(
        240, rate, prefix_groups=8, prefix_blocks=6, unique_blocks=2, block_size=64, output_len=6, seed=11
    )
    cfg = SimConfig(prefill=3, decode=3, replicas=2, seed=3, kv_capacity_tokens=6000, decode_strategy=decode)
    bc = batcher_config(batching, slo)
    sim = ClusterSim(trace, cfg, policy, bc)
    tally = Tally()
    lives = [_live(policy, decode) for _ in range(cfg.replicas)]
    owners_of = lives[0]
    owners_of.views.workers = _registry(sim)
    try:
        for live in lives:
            assert live.formula.source == sim.formula.source  # the same predictor, from the same settings
        sim.replicas = [LiveReplica(i, sim, policy, lives[i], tally) for i in range(cfg.replicas)]
        owners = []
        for wid in sim.pids:
            lease = Lease(f"lease:{wid}", "equiv", 10_000, 1_000, held=True, valid_until=float("inf"))
            owner = OwnerDispatcher(
                wid,
                "equiv",
                lease,
                owners_of.store,
                owners_of.client(wid),
                URL,
                epoch=lambda: "e",
                config=lambda: bc,
                formula=lambda: owners_of.formula,
                time_scale=lambda: 1.0,
            )
            owners.append(owner)
        sim.batchers = [LiveBatcher(bc, sim.formula.predict_batch, sim, o, tally) for o in owners]
        out = sim.run()
    finally:
        for live in lives:
            for c in live.clients.values():
                await c.close()
    served = sum(r.error is None for r in out.records)
    assert served >= len(trace.requests) // 2
    assert tally.routed >= served  # every served request's prefill choice was made by both
    assert tally.decisions >= out.batches
    assert tally.hits > 0  # the cache mirror mattered
    if slo < 1000:
        assert tally.refusals > 0, "no refused member: the batcher's refusals were not exercised"
    if batching != "direct":
        assert tally.batched > 0, "no multi-member batch: the batching decisions were not exercised"


class _NoWalk(CacheMirror):
    """The live mirror, refusing the per-worker walk: the origin must take its hits from
    `match_fast` (the full walk is called explicitly, as the reference, through the base class)."""

    def match(self, keys: Sequence[int], workers: Any, now_ms: float) -> dict[str, int]:
        raise AssertionError("the live origin walked every worker (match) instead of match_fast")


async def test_live_prefill_hits_from_match_fast_equal_the_full_walk() -> None:
    """The live origin takes its hits from `match_fast` (block 0's holders only, as the simulator
    does) instead of `match` over every prefill worker: for every built-in prefill policy, random
    confirmed and speculative caches and prompts, `Pipeline.choose_prefill` decides exactly as the
    same policy fed the full walk's hits (zeros included) with the same generator state."""
    rng = random.Random(18)
    workers = [f"prefill@10.0.0.{i}:8000" for i in range(7)]
    chains = [[rng.getrandbits(62) for _ in range(10)] for _ in range(6)]
    for policy in ("cost", "prefix", "least_load", "random", "round_robin"):
        live = _live(policy, "kv_headroom")
        pipe = live.pipeline
        reference = live.policies.build(PREFILL, policy, live.formula)
        live.views.workers = {w: {"role": "prefill", "state": "active"} for w in workers}
        for case in range(60):
            now = 10_000.0 + case * 700.0
            pipe.mirror = _NoWalk(2000.0)
            for w in workers:
                keys = {k for c in rng.sample(chains, 2) for k in c[: rng.randrange(11)]}
                pipe.mirror.load_snapshot(w, "e", 1, keys)
            for _ in range(rng.randrange(4)):
                chain = rng.choice(chains)[: rng.randrange(1, 11)]
                pipe.mirror.add_speculative(rng.choice(workers), chain, now - 500)
            live.views.snapshots = {
                w: {
                    "health": "up",
                    "kv_total_tokens": "100000",
                    "kv_free_tokens": str(rng.randrange(0, 100000)),
                    "queue_len": str(rng.randrange(4)),
                    "queued_ms": str(rng.choice((0.0, 15.0, 80.0))),
                    "owed_ms": str(rng.choice((0.0, 40.0))),
                }
                for w in workers
            }
            views = pipe.views("prefill", now / 1000)
            keys = rng.choice(chains)[: rng.randrange(0, 11)]
            n_in = 64 * len(keys) + rng.randrange(64)
            full = CacheMirror.match(pipe.mirror, keys, workers, now)
            state = pipe.rng.getstate()
            want = reference.choose(PrefillQuery(n_in, full, 64), views, pipe.rng)
            pipe.rng.setstate(state)
            assert pipe.choose_prefill(n_in, keys, 64, views, now / 1000) == want, (policy, case)


class _HeldSim(ClusterSim):
    """The simulator, noting which request its origin is routing: the live twin builds that
    request's prompt (its block keys) for its own decode pick."""

    routing = -1

    def _arrival(self, i: int) -> None:
        self.routing = i
        super()._arrival(i)


class _TwinHolds(DecodeHoldMirror):
    """A simulated replica's hold mirror whose every hold and drop the live origin's own mirror
    takes too, through the live code: `note_decode_hold` once the reservation is made (on the
    worker it was finally made on), the ending's `dholds.drop`."""

    def __init__(self, rep: HeldLiveReplica) -> None:
        super().__init__()
        self.rep = rep

    def hold(self, request_id: str, worker_id: str, chunk: int, keys: Sequence[int]) -> None:
        super().hold(request_id, worker_id, chunk, keys)
        req, p = self.rep.routed
        assert req.request_id == request_id
        p.decode_worker = worker_id
        self.rep.live.pipeline.note_decode_hold(req, p)

    def drop(self, request_id: str) -> None:
        super().drop(request_id)
        self.rep.live.pipeline.dholds.drop(request_id)


class HeldLiveReplica(LiveReplica):
    """`LiveReplica` for the decode pick with holds: the live pipeline routes the simulated
    request itself (its prompt's block keys, its max_tokens) from its own hold mirror, kept by
    the live code (`_TwinHolds`), and must build the same `DecodeQuery` (its `held` included) and
    pick the same worker."""

    def __init__(self, idx: int, sim: _HeldSim, policy: str, live: Replica, tally: Tally) -> None:
        super().__init__(idx, sim, policy, live, tally)
        self.hsim = sim
        self.dholds = _TwinHolds(self)
        self.held_picks = 0  # picks with a non-empty `held`
        self.held_moved = 0  # picks `held` changed (the same pick without it differs)

    def choose_decode(self, q: DecodeQuery) -> int:
        sim = self.hsim
        i = sim.routing
        tr = sim.trace.requests[i]
        req = GenRequest(f"r{i}", [1] * tr.input_len, max(1, tr.output_len), 60_000)
        p = Progress()
        p.block_size, p.keys = sim.bs, list(sim.trace.full_block_keys(tr))  # as `prompt_keys` hashed them
        self.routed = (req, p)
        pipe = self._sync()
        pipe.out_est = sim.out_est  # the learned output lengths, as the mirror: the simulator's object
        assert pipe.decode_query(req, p, tr.input_len + q.max_new_tokens) == q, f"r{i}"
        pipe.choose_decode(req, p)
        assert pipe.views("decode") == self.dviews
        alone = random.Random()
        alone.setstate(self.rng.getstate())
        d = SimReplica.choose_decode(self, q)
        assert p.decode_worker == self.dids[d], f"r{i}"
        assert pipe.rng.getstate() == self.rng.getstate()
        if q.held:
            self.held_picks += 1
            self.held_moved += (
                self.dstrat.choose(replace(q, held=None), self.dviews, alone).worker_id != (self.dids[d])
            )
        return d


def _apps_trace(n: int = 72, apps: int = 6, prefix_blocks: int = 64, seed: int = 15) -> Trace:
    """Applications' requests in random order 150 ms apart: each prompt its application's
    ``prefix_blocks`` blocks of 512 tokens (32,768: shared chunks decode holds name, worth more
    than `kv_headroom`'s 5 % band of a 450,000-token worker) and one block of its own, decoding
    60 tokens, so several holds of an application overlap on the decode side."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        app = rng.randrange(apps)
        keys = (*(1_000 * (app + 1) + b for b in range(prefix_blocks)), 900_000 + i)
        reqs.append(TraceRequest(i, 150.0 * i, 512 * len(keys), 60, keys))
    return Trace("apps", "mooncake", 512, reqs)


@pytest.mark.parametrize("replicas", [1, 2])
async def test_live_and_simulated_decode_picks_agree_on_held_prompts(replicas: int) -> None:
    """`FLEXLB_DECODE_PREFER_HELD` through both: requests sharing long prompt prefixes, placed on
    decode workers that hold them; every decode pick's `held` (each origin's own holds: with 2
    replicas a lower bound) and choice must be the same live and simulated."""
    trace = _apps_trace()
    cfg = SimConfig(
        prefill=3,
        decode=3,
        replicas=replicas,
        seed=5,
        slo_ttft_ms=600_000.0,
        decode_shared_prefix=True,
        decode_prefer_held=True,
    )
    sim = _HeldSim(trace, cfg, "cost", batcher_config("window", cfg.slo_ttft_ms))
    settings = Settings(
        prefill_strategy="cost",
        decode_strategy=cfg.decode_strategy,
        replica_id="equiv",
        decode_shared_prefix=True,
        decode_prefer_held=True,
    )
    lives = [Replica(settings, URL) for _ in range(replicas)]
    tally = Tally()
    try:
        reps = [HeldLiveReplica(i, sim, "cost", lives[i], tally) for i in range(replicas)]
        sim.replicas = list(reps)
        out = sim.run()
    finally:
        for live in lives:
            for c in live.clients.values():
                await c.close()
    assert all(r.error is None for r in out.records), out.rejections
    # 1 replica: 47 of the 72 picks with held tokens, 21 of them moved by them; 2 replicas (each
    # origin its own holds): 30, 4
    assert sum(r.held_picks for r in reps) >= len(trace.requests) // 3, [r.held_picks for r in reps]
    assert sum(r.held_moved for r in reps) > 0, "held never changed a pick: the preference was not exercised"
    for r in reps:  # every hold ended, on both sides
        assert len(r.dholds) == 0 and len(r.live.pipeline.dholds) == 0
