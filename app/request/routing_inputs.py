"""The origin's routing inputs and choices (DESIGN §3 steps 2-5): this replica's worker views
(the owners' snapshots with its own overlays, `routing.current_loads`) and the decode and prefill
policies' choices over them. No I/O: the live-vs-simulator test drives these directly."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from app import metrics as M
from app.gateway.errors import ApiError
from app.request.context import RequestContext
from app.request.types import GATEWAY_FLOOR_MS, GenRequest, Progress
from app.scheduling.admission import decide as admission_decide
from app.scheduling.admission import expected_batch_wait_ms
from app.scheduling.formula import BatchItem
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

    def block_size(self) -> int:
        for wid in self.fleet.prefill_ids():
            bs = self.fleet.snapshots.get(wid, {}).get("block_size")
            if bs:
                return int(float(bs))
        return 64

    def choose_decode(self, req: GenRequest, p: Progress) -> None:
        """Pure: the decode worker (DESIGN §3 step 5) is chosen before anything is written, so its
        KV reservation rides in the record's round trip. `max_tokens: 1` never touches decode."""
        if req.max_new_tokens <= 1:
            return
        views = self.views("decode")
        try:
            dq = DecodeQuery(len(req.input_ids), self.out_est.reserve(req.max_new_tokens))
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

    def _admit(self, req: GenRequest, p: Progress, choice: Any, views: list[WorkerView]) -> None:
        """SLO admission on the chosen worker (app/scheduling/admission.py), before anything is
        handed off: a request that cannot meet its deadline there gets 429 `slo_unattainable`
        at once instead of queueing where it would miss anyway and delay the rest."""
        cfg = self.runtime.admission
        if cfg.mode == "off":
            return
        view = next((v for v in views if v.id == choice.worker_id), None)
        if view is None:
            return
        scale = float(self.fleet.snapshots.get(choice.worker_id, {}).get("time_scale", 1.0) or 1.0)
        bc = self.runtime.batcher_config
        own = choice.predicted_ms or self.runtime.formula.predict_batch(
            [BatchItem(len(req.input_ids), choice.hit_tokens)]
        )
        wait = expected_batch_wait_ms(view, bc.wait_ms, bc.mode == "batch" and bc.algorithm == "fixed_window")
        deadline = req.deadline_ms or bc.slo_ttft_ms * scale
        budget = deadline - (time.perf_counter() - p.t0) * 1000
        # + the gateway's own round trips (hand-off, owner read, reply): a deadline shorter than
        # those is unattainable whatever the worker's load, and must be refused, not run late
        v = admission_decide(cfg, view, own, budget - GATEWAY_FLOOR_MS, batch_wait_ms=wait, time_scale=scale)
        if not v.admit:
            M.ADMISSION_REJECTIONS.labels(v.reason).inc()
            raise ApiError(
                "slo_unattainable",
                f"predicted time to first token {v.predicted_ms:.0f} ms on the best worker exceeds "
                f"the deadline ({budget:.0f} ms left); retry later",
                retry_after_s=v.retry_after_s,
            )
