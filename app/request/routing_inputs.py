"""The origin's routing inputs and choices (DESIGN §3 steps 2-5): this replica's worker views
(the owners' snapshots with its own overlays, `routing.current_loads`) and the decode and prefill
policies' choices over them. No I/O: the live-vs-simulator test drives these directly."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from app import metrics as M
from app.gateway.errors import ApiError
from app.protocol.blocks import block_keys
from app.request.context import RequestContext
from app.request.types import GATEWAY_FLOOR_MS, GenRequest, Progress
from app.scheduling.admission import Verdict, expected_batch_wait_ms
from app.scheduling.admission import decide as admission_decide
from app.scheduling.formula import BatchItem
from app.scheduling.plugins.registry import Candidates
from app.scheduling.policy import Policy
from app.scheduling.reserve import share_chunks
from app.scheduling.routing import (
    Choice,
    DecodeQuery,
    NoWorker,
    PrefillQuery,
    WorkerView,
    current_loads,
)


def _parse_view(wid: str, role: str, snap: dict[str, str], state: str | None) -> WorkerView:
    """The snapshot's fields as a view; queued and owed time are overlaid per request."""

    def num(key: str) -> float:
        return float(snap.get(key, 0) or 0)

    return WorkerView(
        id=wid,
        role=role,
        up=snap.get("health") == "up",
        kv_total_tokens=int(num("kv_total_tokens")),
        kv_free_tokens=int(num("kv_free_tokens")),
        kv_evictable_tokens=int(num("kv_evictable_tokens")),
        queue_len=int(num("queue_len")),
        queued_ms=num("queued_ms"),
        owed_ms=0.0,
        reserved_tokens=int(num("reserved_tokens")),
        running=int(num("running")),
        draining=state == "draining",
    )


@dataclass(frozen=True, slots=True)
class FreshPair:
    """The policy's pick and its runner-up, for the hand-off script that chooses between them on
    live load (`HANDOFF_PICK`, FLEXLB_FRESH_PICK; `Policy.second_look` is the simulator's twin).
    ``terms[i]`` = (u0, per queued ms, per owed ms, hinge weight, hinge offset): candidate i's
    utility in its live load q + o, u0 + cq·q + co·o + hw·max(0, hc + q + o) — a line, plus the
    one hinge a budget scorer (`predicted_late_ms`) adds; ``winner`` (0 | 1) is whom the picker's
    tie-breakers (then its draw) give a near-tie."""

    first: Choice
    alt: Choice
    terms: tuple[tuple[float, float, float, float, float], tuple[float, float, float, float, float]]
    sign: float
    tie_pct: float
    tie_abs: float
    winner: int

    def choice(self, i: int) -> Choice:
        return self.first if i == 0 else self.alt

    def decide(self, loads: tuple[tuple[float, float], tuple[float, float]]) -> int:
        """The script's decision (0 | 1) in Python, given each one's live (queued, owed) ms: the
        tests hold the Lua to it."""
        u = [
            t[0] + t[1] * q + t[2] * o + t[3] * max(0.0, t[4] + q + o)
            for t, (q, o) in zip(self.terms, loads, strict=True)
        ]
        best = max(u)
        slack = max(self.sign * best * self.tie_pct, self.tie_abs)
        if all(x >= best - slack for x in u):
            return self.winner
        return 0 if u[0] >= u[1] else 1


# d score / d queued ms (= d score / d owed ms) of the prefill scorers whose score is a line in a
# worker's live load: `predicted_finish_ms` and `prefill_load_ms` add both, the others read
# neither (their formulas: app/scheduling/plugins/scorers/README.md; tests/test_fresh_pick.py
# holds each scorer to its slope). `predicted_late_ms` is a hinge in the same load,
# max(0, its finish − budget): at most one such scorer per policy rides as the terms' hinge. A
# policy with any other scorer gets no fresh pick.
LOAD_SLOPE = {
    "predicted_finish_ms": 1.0,
    "prefill_load_ms": 1.0,
    "prefill_saved_ms": 0.0,
    "cache_hit_tokens": 0.0,
}
HINGE_SCORERS = ("predicted_late_ms",)


def _utilities(policy: Policy, q: PrefillQuery, c: Candidates) -> list[float]:
    """``policy``'s weighted scorers summed over candidates ``c`` (its utilities, higher better)."""
    out = [0.0] * len(c.workers)
    for scorer, weight, sign in policy.scorers:
        out = [u + sign * weight * v for u, v in zip(out, scorer.score(q, c), strict=True)]
    return out


def fresh_pair(
    policy: Policy, q: PrefillQuery, views: list[WorkerView], first: Choice, rng: random.Random
) -> FreshPair | None:
    """The pair for `HANDOFF_PICK`, or None where the policy cannot be ranked in Redis: no scorers
    or a picker other than ``best`` (load-blind: nothing to gain), a scorer not in `LOAD_SLOPE`,
    one worker, no runner-up, or a filter that drops one of the two (filters run
    once, at the snapshot's loads). Pure; draws the runner-up's and the tie's randomness from
    ``rng`` as `Policy.second_look` does."""
    picker = policy.picker
    if not policy.scorers or picker.name != "best":
        return None
    if any(s.name not in LOAD_SLOPE and s.name not in HINGE_SCORERS for s, _, _ in policy.scorers):
        return None
    hinges = [(s, weight, sign) for s, weight, sign in policy.scorers if s.name in HINGE_SCORERS]
    if len(hinges) > 1:
        return None
    a = next((v for v in views if v.id == first.worker_id), None)
    rest = [v for v in views if v.id != first.worker_id]
    if a is None or not rest:
        return None
    try:
        alt = policy.choose(q, rest, rng)
    except NoWorker:
        return None
    b = next(v for v in rest if v.id == alt.worker_id)
    c = policy.fit.apply(q, Candidates([a, b]))
    for f in policy.filters:
        c = f.apply(q, c)
    if len(c.workers) != 2:
        return None
    now = _utilities(policy, q, c)
    slope = sum(
        sign * weight * LOAD_SLOPE[s.name] for s, weight, sign in policy.scorers if s.name in LOAD_SLOPE
    )
    hw, hc = 0.0, [0.0, 0.0]
    if hinges:
        scorer, weight, sign = hinges[0]
        hw = sign * weight
        predict, budget = scorer.formula.predict_one, scorer.budget_ms  # type: ignore[attr-defined]
        hc = [predict(q.input_tokens, hit) - budget for hit in c.hits]
    terms = [
        (
            now[i] - slope * (load := v.queued_ms + v.owed_ms) - hw * max(0.0, hc[i] + load),
            slope,
            slope,
            hw,
            hc[i],
        )
        for i, v in enumerate((a, b))
    ]
    winner, _ = picker.pick(q, c, [0.0, 0.0], policy.sign, rng)  # both tied: its tie-breakers decide
    return FreshPair(
        first,
        alt,
        (terms[0], terms[1]),
        policy.sign,
        float(getattr(picker, "tie_pct", 0.0)),
        float(getattr(picker, "tie_abs", 0.0)),
        winner,
    )


class RoutingInputs(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica."""

    def views(self, role: str, now_s: float | None = None) -> list[WorkerView]:
        """The workers of ``role`` as this origin ranks them: the owners' snapshots with this
        origin's own overlays (`routing.current_loads`); ``now_s`` is the wall clock (tests and
        the live-vs-simulator equivalence test pass it)."""
        now = time.time() if now_s is None else now_s
        out = []
        ids = self.fleet.prefill_ids() if role == "prefill" else self.fleet.decode_ids()
        for wid in ids:
            snap = self.fleet.snapshots.get(wid, {})
            state = self.fleet.workers.get(wid, {}).get("state")
            cached = self._view_cache.get(wid)
            if cached is not None and cached[0] is snap and cached[1] == state and cached[2].role == role:
                view = cached[2]
            else:
                view = _parse_view(wid, role, snap, state)
                self._view_cache[wid] = (snap, state, view)
            prefill = role == "prefill"
            queued, owed = current_loads(
                view.queued_ms,
                float(snap.get("owed_ms", 0.0) or 0.0) if prefill else 0.0,
                float(snap.get("now_ms", 0.0) or 0.0),
                self.fleet.queued_overlay.get(wid),
                self.fleet.snapshot_time.get(wid, 0.0),
                self.finished.get(wid) if prefill else None,
                now - 5.0,  # older entries are long since reflected, or from an older epoch
                # the ledger's owed ms as our last hand-off there read it (HANDOFF script)
                self.owed_overlay.get(wid) if prefill else None,
                now,
                1000.0 / float(snap.get("time_scale", 1.0) or 1.0),
                self.fleet.in_flight.ms(wid) if prefill else 0.0,
            )
            if queued != view.queued_ms or owed != view.owed_ms:
                view = replace(view, queued_ms=queued, owed_ms=owed)
            out.append(view)
        return out

    def choose_prefill(
        self, n_in: int, keys: list[int], bs: int, views: list[WorkerView], now_s: float
    ) -> Choice:
        """Pure: the prefill policy's choice among ``views`` for a prompt of ``n_in`` tokens whose
        full blocks hash to ``keys``. Hits come from `CacheMirror.match_fast` (block 0's holders
        only, as the simulator matches), not a walk over every worker; a worker it omits holds
        nothing, which the policies read as 0 blocks. Raises NoWorker."""
        hits = self.mirror.match_fast(keys, now_s * 1000)
        return self.runtime.prefill_strategy.choose(PrefillQuery(n_in, hits, bs), views, self.rng)

    def choose_prefill_pair(
        self, n_in: int, keys: list[int], bs: int, views: list[WorkerView], now_s: float
    ) -> tuple[Choice, FreshPair | None]:
        """`choose_prefill`, and with FLEXLB_FRESH_PICK the runner-up for the hand-off script to
        weigh against it on live load (`fresh_pair`). Pure. Raises NoWorker."""
        hits = self.mirror.match_fast(keys, now_s * 1000)
        q = PrefillQuery(n_in, hits, bs)
        policy = self.runtime.prefill_strategy
        first = policy.choose(q, views, self.rng)
        if not self.settings.fresh_pick:
            return first, None
        return first, fresh_pair(policy, q, views, first, self.rng)

    def block_size(self) -> int:
        for wid in self.fleet.prefill_ids():
            bs = self.fleet.snapshots.get(wid, {}).get("block_size")
            if bs:
                return int(float(bs))
        return 64

    def prompt_keys(self, req: GenRequest, p: Progress) -> tuple[int, list[int]]:
        """(block size, the prompt's full-block keys), hashed once per request: prefix routing
        ranks prefill workers on them and the decode hold names them (`decode_hold_blocks`)."""
        if not p.block_size:
            bs = self.block_size()
            arr = np.asarray(req.input_ids, dtype="<i4")
            p.packed = arr.tobytes()
            p.keys = block_keys(arr, bs, model=self.settings.model, tokenizer=self.tokenizer.name)
            p.block_size = bs
        return p.block_size, p.keys

    def decode_hold_blocks(self, req: GenRequest, p: Progress) -> tuple[int, list[int]]:
        """What the decode hold names for `FLEXLB_DECODE_SHARED_PREFIX` (`Store.reserve_cmd`):
        a block another hold on the worker names is counted once, as the engine holds it."""
        if not self.settings.decode_shared_prefix:
            return 0, []
        return share_chunks(*self.prompt_keys(req, p))

    def decode_query(self, req: GenRequest, p: Progress, need: int) -> DecodeQuery:
        """The decode placement of a hold of `need` tokens (prompt + reserved output)."""
        n = len(req.input_ids)
        bs, keys = self.decode_hold_blocks(req, p)
        held = self.dholds.held(bs, keys) if keys and self.settings.decode_prefer_held else None
        return DecodeQuery(n, need - n, n + req.max_new_tokens, bs * len(keys), held)

    def note_decode_hold(self, req: GenRequest, p: Progress) -> None:
        """The RESERVE script took this request's hold on ``p.decode_worker``: later requests'
        decode picks see which of their chunks it names there (`DecodeHoldMirror`)."""
        if self.settings.decode_prefer_held:
            self.dholds.hold(req.request_id, p.decode_worker, *self.decode_hold_blocks(req, p))

    def choose_decode(self, req: GenRequest, p: Progress) -> None:
        """Pure: the decode worker (DESIGN §3 step 5) is chosen before anything is written, so its
        KV reservation rides in the record's round trip. `max_tokens: 1` never touches decode."""
        if req.max_new_tokens <= 1:
            return
        views = self.views("decode")
        try:
            dq = self.decode_query(req, p, len(req.input_ids) + self.out_est.reserve(req.max_new_tokens))
            p.decode_worker = self.runtime.decode_strategy.choose(dq, views, self.rng).worker_id
        except NoWorker as exc:
            need = len(req.input_ids) + req.max_new_tokens
            # KV that is full *now* on a worker big enough is load: 429 overloaded, come back
            # later. Only when no live worker could ever hold it is it 503 no_worker.
            fits = any(v.up and not v.draining and v.kv_total_tokens >= need for v in views)
            raise ApiError("overloaded" if fits else "no_worker", str(exc), retry_after_s=1) from None

    def _scale(self, wid: str) -> float:
        """The worker's time scale (wall ms per modelled ms) from its snapshot."""
        return float(self.fleet.snapshots.get(wid, {}).get("time_scale", 1.0) or 1.0)

    def _admit(self, req: GenRequest, p: Progress, choice: Any, views: list[WorkerView]) -> Verdict | None:
        """SLO admission on the chosen worker (app/scheduling/admission.py), before anything is
        handed off: a request that cannot meet its deadline there gets 429 `slo_unattainable`
        at once instead of queueing where it would miss anyway and delay the rest. Returns the
        verdict (None when admission is off): its `max_backlog_ms` travels to the hand-off, which
        checks it on the live state."""
        cfg = self.runtime.admission
        if cfg.mode == "off":
            return None
        view = next((v for v in views if v.id == choice.worker_id), None)
        if view is None:
            return None
        scale = float(self.fleet.snapshots.get(choice.worker_id, {}).get("time_scale", 1.0) or 1.0)
        bc = self.runtime.batcher_config
        own = choice.predicted_ms or self.runtime.formula.predict_batch(
            [BatchItem(len(req.input_ids), choice.hit_tokens)]
        )
        window = bc.holds_window
        wait = expected_batch_wait_ms(view, bc.wait_ms, window)
        deadline = req.deadline_ms or bc.slo_ttft_ms * scale
        budget = deadline - (time.perf_counter() - p.t0) * 1000
        # + the gateway's own round trips (hand-off, owner read, reply): a deadline shorter than
        # those is unattainable whatever the worker's load, and must be refused, not run late
        v = admission_decide(
            cfg,
            view,
            own,
            budget - GATEWAY_FLOOR_MS,
            batch_wait_ms=wait,
            time_scale=scale,
            explicit=bool(req.deadline_ms),
            window_ms=bc.wait_ms if window else 0.0,
        )
        if not v.admit:
            M.ADMISSION_REJECTIONS.labels(v.reason).inc()
            if v.reason == "deadline_too_short":
                raise ApiError(
                    "deadline_too_short",
                    f"the request's deadline ({budget:.0f} ms left) is shorter than its own predicted "
                    f"prefill ({own * scale:.0f} ms) even on an idle worker; raise deadline_ms / "
                    "x-flexlb-slo-ms or shorten the prompt",
                )
            raise ApiError(
                "slo_unattainable",
                f"predicted time to first token {v.predicted_ms:.0f} ms on the best worker exceeds "
                f"the deadline ({budget:.0f} ms left); retry later",
                retry_after_s=v.retry_after_s,
            )
        return v
