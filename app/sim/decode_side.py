"""The simulated cluster's decode side: the decode engines, the origin's pick and the reservation
the `RESERVE` script makes (DESIGN §3 step 5), the decode request and its effects, and the release
at the request's end. A mixin of `ClusterSim` (app/sim/cluster.py): the same state, one concern
per module.

"Redis" here is the simulator's per-worker state: ``reserved`` (what every replica promised),
``dheld`` (`SharedBlockHolds`: how many holds name each prompt chunk, counted once, as
`reservation_blocks(w)`), checked atomically at routing time as the script does. Each replica's
`DecodeHoldMirror` (`SimReplica.dholds`) is what its pick sees of where holds name a prompt
(`FLEXLB_DECODE_PREFER_HELD`): its own holds, as a live origin's, unless
`SimConfig.decode_held_view` is ``all`` (an evaluation: every replica shares one mirror, the
upper bound of a view that also saw the other replicas' holds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.protocol.codes import FINISH_LENGTH
from app.scheduling.reserve import (
    DecodeHoldMirror,
    OutputLengthEstimator,
    SharedBlockHolds,
    share_chunk_size,
    share_chunks,
)
from app.scheduling.routing import DecodeQuery, NoWorker, PrefillQuery
from app.sim.config import SimConfig
from app.sim.outcome import ReqState
from app.traces.model import Trace, TraceRequest
from workers.engine.decode import DecodeEngine, DecodeRequest, _Seq
from workers.engine.effects import DecodeFinished, Effect

if TYPE_CHECKING:
    from app.sim.replica import SimReplica

__all__ = ["DecodeSide"]


class _SimDecodeEngine(DecodeEngine):
    """The decode engine core, minus the output token ids (nobody reads them in a simulation): the
    timing, KV and admission logic are the parent's; only the per-chunk id generation is skipped."""

    def _emit(self, s: _Seq, gen: int) -> list[Effect]:
        if gen > s.emitted:
            self.tokens_total += gen - s.emitted
            s.emitted = gen
        return []


class DecodeSide:
    """Mixin of `ClusterSim`: the decode engines, the origin's decode reservation and its release."""

    cfg: SimConfig
    trace: Trace
    bs: int
    dids: list[str]
    d_dirty: list[bool]
    replicas: list[SimReplica]
    reqs: list[ReqState]
    rejections: Counter[str]

    if TYPE_CHECKING:

        def _fail(self, i: int, code: str) -> None: ...

        def _complete(self, i: int) -> None: ...

    def _init_decode_side(self) -> None:
        cfg = self.cfg
        nd = cfg.decode
        self.deng = [
            _SimDecodeEngine(
                cfg.decode_profile(),
                seed=cfg.seed * 100_003 + i,
                max_running=cfg.decode_max_running,
                admission=cfg.decode_admission,
            )
            for i in range(nd)
        ]
        self.reserved = [0] * nd
        # Decode-side prefix sharing (`SimConfig.decode_shared_prefix`): per decode worker, how
        # many reservations name each full prompt block; a block is reserved once.
        self.dheld = [SharedBlockHolds(share_chunk_size(self.bs)) for _ in range(nd)]
        # `SimConfig.decode_tpot_slo_ms` (an evaluation): per decode worker, the holds and the sum
        # of their prompt + reserved output, the context each decode step reads at its longest.
        self.dholds_n = [0] * nd
        self.dctx = [0] * nd
        self.dstep = cfg.decode_profile().decode_step_ms
        self.out_est = OutputLengthEstimator(cfg.reserve_output_tokens)  # one model: one estimator
        # `SimConfig.decode_held_view == "all"`: the one mirror every replica's pick reads.
        self.shared_dholds: DecodeHoldMirror | None = (
            DecodeHoldMirror() if cfg.decode_held_view == "all" else None
        )

    def _reserve_decode(self, rep: SimReplica, i: int, st: ReqState, keys: list[int]) -> bool:
        """Pick the decode worker of request ``i`` and reserve its KV there, retrying on up to two
        more workers when the reservation is refused, as the gateway does; False: refused (the
        request has failed)."""
        tr = self.trace.requests[i]
        rid = f"r{i}"
        size = tr.input_len
        max_new = max(1, tr.output_len)
        cbs, dkeys = share_chunks(self.bs, keys) if self.cfg.decode_shared_prefix else (0, [])
        held = rep.dholds.held(cbs, dkeys) if self.cfg.decode_prefer_held and dkeys else None
        dq = DecodeQuery(size, self.out_est.reserve(max_new), size + max_new, cbs * len(dkeys), held)
        try:
            d = rep.choose_decode(dq)
        except NoWorker:
            self.rejections["decode_no_kv_headroom"] += 1
            self._fail(i, "no_worker")
            return False
        need = size + dq.max_new_tokens
        refused: list[str] = []
        while self.reserved[d] + need - self.dheld[d].held_tokens(dkeys) > self.deng[d].capacity or (
            self.cfg.decode_tpot_slo_ms > 0
            and self.dstep(self.dholds_n[d] + 1, self.dctx[d] + need) > self.cfg.decode_tpot_slo_ms
        ):
            # As the gateway does (`Pipeline._reserve_elsewhere`): up to two more workers.
            refused.append(self.dids[d])
            others = [v for v in rep.dviews if v.id not in refused]
            if len(refused) > 2 or not others:
                self.rejections["decode_reserve_refused"] += 1
                self._fail(i, "overloaded")
                return False
            try:
                d = int(rep.dstrat.choose(dq, others, rep.rng).worker_id.rsplit("-", 1)[1])
            except NoWorker:
                self.rejections["decode_reserve_refused"] += 1
                self._fail(i, "overloaded")
                return False
        self.reserved[d] += need - self.dheld[d].held_tokens(dkeys)
        self.dheld[d].hold(rid, dkeys)
        rep.dholds.hold(rid, self.dids[d], cbs, dkeys)
        self.dholds_n[d] += 1
        self.dctx[d] += need
        self.d_dirty[d] = True
        st.decode = d
        st.reserved = need
        return True

    def _decode_request(self, rid: str, tr: TraceRequest) -> DecodeRequest:
        """What the origin sends the decode worker after the prefill (its first token came from
        there), naming the chunks its hold named (`decode_shared_prefix`)."""
        keys: tuple[int, ...] = ()
        cbs = 0
        if self.cfg.decode_shared_prefix:
            cbs, ks = share_chunks(self.bs, self.trace.full_block_keys(tr))
            keys = tuple(ks)
        return DecodeRequest(rid, tr.input_len, max(1, tr.output_len) - 1, 1, tr.input_len, keys, cbs)

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

    def _release_reservation(self, st: ReqState, i: int) -> None:
        rep = self.replicas[st.origin]
        if rep.peer and st.decode >= 0:  # off the peer router's own in-flight counts
            rep.pstrat.finished(
                self.dids[st.decode], PrefillQuery(self.trace.requests[i].input_len, {}, self.bs)
            )
        if st.reserved and st.decode >= 0:
            self.reserved[st.decode] -= st.reserved - self.dheld[st.decode].drop(f"r{i}")
            rep.dholds.drop(f"r{i}")
            self.dholds_n[st.decode] -= 1
            self.dctx[st.decode] -= st.reserved
            self.d_dirty[st.decode] = True
            st.reserved = 0
