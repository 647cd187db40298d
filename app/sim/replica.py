"""One simulated gateway replica: its copy of the owners' snapshots, its overlays and speculative
cache entries, its policies, and the candidate shortlists it routes large fleets over.

Views are built as the live gateway builds them (`routing.current_loads`, as `Pipeline.views`); the
shortlists are the simulator's own speed-up and are described in `app/sim/cluster.py`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from app.cache.mirror import SpecIndex
from app.scheduling.plugins.registry import Candidates
from app.scheduling.policy import DECODE, PREFILL
from app.scheduling.reserve import DecodeHoldMirror
from app.scheduling.routing import (
    Choice,
    DecodeQuery,
    NoWorker,
    PrefillQuery,
    WorkerView,
    current_loads,
    top_candidates,
)

if TYPE_CHECKING:
    from app.sim.cluster import ClusterSim

__all__ = ["SimReplica"]


class SimReplica:
    """One gateway replica's routing state: its copy of the snapshots, overlays and policies."""

    def __init__(self, idx: int, sim: ClusterSim, policy: str) -> None:
        cfg = sim.cfg
        self.cfg = cfg
        self.bs = sim.bs
        self.pids = sim.pids
        self.dids = sim.dids
        self.pindex = sim.pindex
        self.dindex = {w: i for i, w in enumerate(sim.dids)}
        self.mirror = sim.mirror
        self.idx = idx
        self.rng = random.Random(f"{cfg.seed}:replica:{idx}")
        self.pstrat = sim.book.build(PREFILL, policy, sim.formula)
        # A peer router imitation (a registry picker) runs without FlexLB's admission.
        self.peer = self.pstrat.peer
        self.dstrat = sim.book.build(DECODE, cfg.decode_strategy)
        # Where this replica's own decode holds name their chunks (with `decode_held_view="all"`:
        # every replica's, one mirror shared by all, an evaluation of the upper bound).
        shared = sim.shared_dholds
        self.dholds = shared if shared is not None else DecodeHoldMirror()
        self.psnap: list[tuple[Any, ...]] = list(sim.p_pub)
        self.dsnap: list[tuple[Any, ...]] = list(sim.d_pub)
        self.p_seen = [-1] * cfg.prefill
        self.d_seen = [-1] * cfg.decode
        self.snap_time = -1.0
        self.overlay: dict[int, tuple[float, float]] = {}
        self.overlay_of: dict[int, int] = {}  # worker → the request whose own answer the overlay is
        self.fresh_owed: dict[int, tuple[float, float]] = {}  # ledger owed as our hand-off read it
        self.aging: dict[int, float] = {}  # worker → when its fresh owed ms reaches 0
        self.finished: dict[int, list[tuple[float, float, float, float]]] = {}
        self.spec = SpecIndex(cfg.speculative_ttl_ms, cfg.speculative_max_entries)
        self.pviews: list[WorkerView] = []
        self.dviews: list[WorkerView] = []
        self.pool: list[int] | None = None
        self.routed_since_pool = 0
        self.dpool: list[int] | None = None
        self.dband: list[int] | None = None
        self.band_rng = random.Random(f"{cfg.seed}:band:{idx}")

    def prefill_query(self, size: int, keys: Sequence[int], now: float) -> PrefillQuery:
        """The prompt as the prefill policy sees it, as `Pipeline.choose_prefill` builds it: hits
        from the mirror's `match_fast` with this replica's speculative entries."""
        hits = self.mirror.match_fast(keys, now, self.spec) if keys else {}
        return PrefillQuery(size, hits, self.bs, keys)

    def choose_prefill(self, q: PrefillQuery) -> Choice:
        """The prefill policy's choice, over a shortlist on a large fleet (see app/sim/cluster.py)."""
        hits = q.hit_blocks
        cfg = self.cfg
        views = self.pviews
        n = len(views)
        picker = self.pstrat.picker
        if n <= cfg.full_scan_max or picker.name == "random":
            return self.pstrat.choose(q, views, self.rng)
        if picker.name == "round_robin":
            last = getattr(picker, "last", None)
            start = self.pindex[last] + 1 if last is not None else 0
            cands = [views[(start + j) % n] for j in range(min(cfg.candidates, n))]
        else:
            if self.pool is None or self.routed_since_pool >= cfg.candidates:
                self._refresh_pool()
            idx = set(self.pool or ())
            pindex = self.pindex
            idx.update(pindex[w] for w in hits)
            cands = [views[j] for j in sorted(idx)]
        try:
            return self.pstrat.choose(q, cands, self.rng)
        except NoWorker:
            return self.pstrat.choose(q, views, self.rng)

    def fresh_pick(
        self, q: PrefillQuery, choice: Choice, fresh: Callable[[str], tuple[float, float]]
    ) -> tuple[Choice | None, Choice]:
        """`Policy.second_look_pair` (`SimConfig.fresh_pick`) over the candidates the choice was
        made from, with ``fresh`` the shared state as a hand-off script would read it now: (the
        runner-up or None, the ranking's winner)."""
        return self.pstrat.second_look_pair(q, self.pviews, choice, fresh, self.rng)

    def _refresh_pool(self) -> None:
        self.routed_since_pool = 0
        probe = PrefillQuery(1, {}, self.bs)
        try:
            kept = top_candidates(probe, self.pviews, self.cfg.candidates)
        except NoWorker:
            kept = []
        self.pool = [self.pindex[v.id] for v in kept]

    def peer_decode(self, q: PrefillQuery) -> int:
        """A peer router imitation's decode worker: its own picker over every decode worker (the
        routers imitated run their policy on the decode pool too; a decode engine's prefix cache
        is not modelled, so no decode worker reports a hit). The picker counts it in flight until
        `ClusterSim` reports the request's end (`Policy.finished`)."""
        views = self.dviews
        i, _ = self.pstrat.picker.pick(q, Candidates(list(views), [0] * len(views)), None, 1.0, self.rng)
        return i

    def choose_decode(self, q: DecodeQuery) -> int:
        """Index of the decode policy's choice, over a shortlist on a large fleet."""
        cfg = self.cfg
        views = self.dviews
        n = len(views)
        strat = self.dstrat
        picker = strat.picker
        if n <= cfg.full_scan_max or picker.name == "random":
            c = strat.choose(q, views, self.rng)
            return int(c.worker_id.rsplit("-", 1)[1])
        if picker.name == "round_robin":
            last = getattr(picker, "last", None)
            start = int(last.rsplit("-", 1)[1]) + 1 if last is not None else 0
            cands = [views[(start + j) % n] for j in range(min(cfg.candidates, n))]
        else:
            if self.dpool is None:
                self._decode_pool()
            top, band = self.dpool or [], self.dband or []
            k = cfg.candidates
            if len(band) > 2 * k:
                # The strategy draws among near-tied workers at random; a fixed shortlist would
                # herd a whole refresh interval's requests onto it. A fresh sample of the tie band
                # per request spreads them as the full-fleet draw does.
                idx = set(top)
                idx.update(self.band_rng.sample(band, 2 * k))
                cands = [views[j] for j in sorted(idx)]
            else:
                cands = [views[j] for j in sorted(set(top) | set(band))]
            if q.held:  # the workers holding the prompt rank on their headroom plus it
                have = {v.id for v in cands}
                cands += [views[self.dindex[w]] for w in q.held if w not in have]
        try:
            c = strat.choose(q, cands, self.rng)
        except NoWorker:
            c = strat.choose(q, views, self.rng)
        return int(c.worker_id.rsplit("-", 1)[1])

    def _decode_pool(self) -> None:
        """The best ``candidates`` decode workers by the policy's own ranking, and the workers tied
        with the best (`Policy.rank_decode`: kv_headroom within its tie_pct, least_load equal on
        reserved and running). Decode views only change at a refresh, so this holds until the next."""
        order, band = self.dstrat.rank_decode(self.dviews)
        self.dpool = sorted(order[: self.cfg.candidates])
        self.dband = band

    def refresh(
        self,
        now: float,
        p_pub: list[tuple[Any, ...]],
        p_pub_ver: list[int],
        d_pub: list[tuple[Any, ...]],
        d_pub_ver: list[int],
    ) -> None:
        """Take the owners' latest published snapshots (``*_pub``, versioned by ``*_pub_ver``), as
        the live replica's refresh loop does, drop overlays the snapshot supersedes, rebuild the
        views that changed and invalidate the shortlists."""
        self.snap_time = now
        first = not self.pviews
        if first:
            self.pviews = [self.pview(w, now) for w in range(len(self.pids))]
            self.dviews = [self.dview(d) for d in range(len(self.dids))]
        changed = set(self.overlay)  # the refresh makes every overlay older than the snapshot
        self.overlay.clear()
        self.overlay_of.clear()
        self.fresh_owed.clear()
        self.aging.clear()
        for w, ver in enumerate(p_pub_ver):
            if ver != self.p_seen[w]:
                self.p_seen[w] = ver
                self.psnap[w] = p_pub[w]
                changed.add(w)
            elif self.finished.get(w):
                self.psnap[w] = p_pub[w]
                changed.add(w)
        for w in sorted(changed):
            self.pviews[w] = self.pview(w, now)
        dchanged = False
        for d, ver in enumerate(d_pub_ver):
            if ver != self.d_seen[d]:
                self.d_seen[d] = ver
                self.dsnap[d] = d_pub[d]
                self.dviews[d] = self.dview(d)
                dchanged = True
        if dchanged or first:
            self.dpool = None
        self.pool = None
        self.spec.expire(now)

    def note_fresh_owed(self, w: int, owed_ms: float, now: float) -> None:
        """The ledger's owed ms as our hand-off's round trip read it (the live `owed_overlay`)."""
        self.fresh_owed[w] = (owed_ms, now)
        if owed_ms > 0:
            self.aging[w] = now + owed_ms

    def age(self, now: float) -> None:
        """Rebuild the views whose fresh owed ms are still running down: the live origin ages them
        per request (`current_loads`), where this replica otherwise rebuilds a view only when its
        inputs change."""
        for w, until in list(self.aging.items()):
            self.pviews[w] = self.pview(w, now)
            if until <= now:
                del self.aging[w]

    def pview(self, w: int, now: float) -> WorkerView:
        """`Pipeline.views("prefill")` for one worker, from this replica's copy of the snapshot."""
        s = self.psnap[w]
        queued, owed = current_loads(
            s[4],
            s[5],
            s[6],
            self.overlay.get(w),
            self.snap_time,
            self.finished.get(w),
            now - 5000.0,
            self.fresh_owed.get(w),
            now,
        )
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

    def dview(self, d: int) -> WorkerView:
        s = self.dsnap[d]
        return WorkerView(
            id=self.dids[d],
            role="decode",
            up=True,
            kv_total_tokens=s[0],
            kv_free_tokens=s[1],
            reserved_tokens=s[2],
            running=s[3],
        )
