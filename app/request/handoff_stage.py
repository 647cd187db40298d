"""The hand-off of the prompt to the prefill worker's owner and the wait for its reply (DESIGN §3
step 6): the entry's fields, this origin's queue overlay around it, and what the reply says. The
round trip itself: app/request/handoff_round_trip.py for a fresh id, `Handoff.append` for an id
already recorded (a client's, or a second hand-off)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from app import metrics as M
from app.gateway.errors import ApiError
from app.protocol.blocks import hit_blocks_cap, namespace_seed
from app.request.context import RequestContext
from app.request.handoff_round_trip import PairArgs
from app.request.routing_inputs import FreshPair
from app.request.types import ENGINE_TO_API, GenRequest, NotStarted, Progress
from app.scheduling.admission import Verdict, fits_on_live, max_backlog_ms
from app.state.handoff import OVER_BACKLOG, pack_keys, pack_tokens


class HandoffStage(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica."""

    def _meta(
        self, req: GenRequest, p: Progress, wid: str, predicted: float, hit_tokens: int, attempt: int
    ) -> dict[str, Any]:
        """The hand-off entry's fields for ``wid`` (the owner's batcher and reply read them)."""
        deadline = time.time() * 1000 + req.timeout_ms
        meta: dict[str, Any] = {
            "rid": req.request_id,
            "origin": self.replica_id,
            "pred": round(predicted, 3),
            "deadline": round(deadline),
            "trace": req.trace_id,
            "t": round(time.time(), 6),
            "hit": hit_tokens,
            "att": attempt,
        }
        if self.runtime.admission.mode != "off":
            # the owner's batcher caps batches by it, and ends the request typed if it passes
            # while queued when the client set it (or FLEXLB_ADMISSION_DROP_LATE=always)
            slo = req.deadline_ms or self.runtime.batcher_config.slo_ttft_ms * self._scale(wid)
            meta["ttft_dl"] = round(time.time() * 1000 + slo - (time.perf_counter() - p.t0) * 1000)
            if req.deadline_ms or self.runtime.admission.drop_late == "always":
                meta["drop"] = 1
        meta.update({"pr": req.priority} if req.priority != 1 else {})  # the owner's batch order
        if req.sampling:
            meta["smp"] = req.sampling
        return meta

    async def _prefill(
        self,
        req: GenRequest,
        p: Progress,
        wid: str,
        predicted: float,
        keys: list[int],
        bs: int,
        hit_tokens: int = 0,
        pair: FreshPair | None = None,
        admitted: Verdict | None = None,
    ) -> dict[str, str]:
        """Hand the prompt to ``wid``'s owner and wait for its reply. With ``pair`` (a fresh id
        and FLEXLB_FRESH_PICK) the hand-off script chooses between ``wid`` and the pair's
        runner-up on both workers' live load, in the same round trip (`HANDOFF_PICK`). An
        ``admitted`` verdict goes only onto a worker whose live backlog is within its
        `max_backlog_ms` (the runner-up's own allowance for it), judged by the script on the live
        state in the step that queues it (`_over_backlog`)."""
        rid = req.request_id
        # The queue's counter gains exactly what the entry says (`pred`, 3 decimals), which is what
        # the owner takes off at commit: 6 decimals here left ~0.0005 ms per request behind, a
        # drift the reconciler measured at 0.011 ms after 600 requests.
        predicted = round(predicted, 3)
        p.prefill_worker = wid
        p.handoffs += 1
        attempt = p.handoffs
        self.replies.forget(rid)  # a late reply to an earlier hand-off must not answer this one
        fut = self.replies.expect(rid)
        meta = self._meta(req, p, wid, predicted, hit_tokens, attempt)
        # Routing's block keys travel with the entry (`k`, 8 bytes a block plus the key space's
        # seed): the owner hands them to the worker rather than hashing the prompt again, which
        # cost it ~3.7 ms on an 8 x 8K batch (issue 20). The same for any worker: one whose key
        # space differs is sent keys the owner's client hashes (app/rpc/worker_client.py).
        space = namespace_seed(self.settings.model, self.tokenizer.name, bs)
        packed_keys = pack_keys(space, keys)
        p.t_handoff = time.perf_counter()  # the reply's wait minus the prefill is its queue time
        held = -1
        limit = admitted.max_backlog_ms if admitted is not None else None
        fresh = p.stage == "new"
        moved = False  # the fresh pick sent the request to the policy's runner-up
        # Counted in flight until the round trip answers: requests routed meanwhile on this replica
        # (a burst) see it rather than all ranking and admitting against the same queue, and an
        # earlier hand-off's answer, which cannot include it, does not erase it from our view.
        sent_to = wid
        token = self.fleet.in_flight.sent(sent_to, predicted)
        try:
            if fresh:  # a fresh id: record, reserve and hand off in one round trip
                args = None
                if pair is not None and pair.first.worker_id == wid:
                    alt = pair.alt
                    alt_pred = round(alt.predicted_ms, 3)
                    alt_meta = self._meta(req, p, alt.worker_id, alt_pred, alt.hit_tokens, attempt)
                    alt_limit = self._alt_limit(req, alt.worker_id, alt_pred, admitted)
                    args = PairArgs(pair, json.dumps(alt_meta, separators=(",", ":")), alt_pred, alt_limit)
                try:
                    entry, queued, owed, held, picked = await self._record_and_append(
                        req, p, wid, meta, predicted, args, packed_keys, limit
                    )
                except ApiError:  # refused by the tenant's limit: nothing was queued
                    self.replies.forget(rid)
                    raise
                except BaseException:
                    if args is not None:  # the script may have chosen the runner-up: it must not run
                        other = args.pair.alt.worker_id
                        await self.terminal.run_or_queue(
                            f"tombstone {rid}", lambda: self.store.tombstone(other, rid, 60_000)
                        )
                    raise
                if picked is not None and args is not None:
                    moved = picked.index != 0
                    if moved:
                        limit = args.max_backlog
                    wid, predicted, hit_tokens = self._take_pick(p, wid, predicted, args, picked)
            else:
                entry, queued, owed = await self.handoff.append(
                    wid,
                    meta,
                    p.packed or pack_tokens(req.input_ids),
                    predicted,
                    self.settings.max_queue_len,
                    self._scale(wid),
                    packed_keys,
                    limit,
                )
        finally:
            # the answer (or the failure) stands for it from here: no await since the script's reply
            self.fleet.in_flight.answered(sent_to, token)
        now = time.time()
        # the live queue, with this hand-off when it was taken (an entry id, not a refusal)
        taken = entry is not None and entry != OVER_BACKLOG
        self.fleet.note_queued(wid, queued, now, rid if taken else "")
        self.owed_overlay[wid] = (owed, now)
        if entry == OVER_BACKLOG and admitted is not None:
            self._over_backlog(req, p, wid, queued, owed, replace(admitted, max_backlog_ms=limit), fresh)
        if entry is None:
            self.replies.forget(rid)
            if fresh:
                self._log("queued", req, p)
            raise ApiError("overloaded", f"prefill queue of {wid} is full", retry_after_s=1)
        p.stage = "handed_off"
        if moved:  # counted once queued: a runner-up that refused (full, not idle) moved nothing
            M.FRESH_PICK_MOVED.inc()
        if held == 0:
            if fresh:
                self._log("queued", req, p)
                fresh = False
            if not await self._reserve_elsewhere(req, p):
                # the prefill is queued already: the abort tombstones and cancels it
                raise ApiError(
                    "overloaded", f"decode worker {p.decode_worker} has no KV left", retry_after_s=1
                )
        if held >= 0:
            self.note_decode_hold(req, p)
        overhead = time.perf_counter() - p.t0
        M.ORIGIN_OVERHEAD.observe(overhead)
        M.SAMPLES["origin_overhead_s"].add(overhead)
        if fresh:  # logged after the clock stops: a log line is I/O, not scheduling
            self._log("queued", req, p)
        n_cap = hit_blocks_cap(len(req.input_ids), bs)
        self.mirror.add_speculative(wid, keys[: max(n_cap, 0) + 1], time.time() * 1000)
        self.wake_owner(wid)
        if req.on_admitted is not None:  # admitted: the stream may answer 200 now (keep-alives)
            req.on_admitted()
        reply = await fut
        while reply.get("att", str(attempt)) != str(attempt):  # stale: an earlier hand-off's answer
            reply = await self.replies.expect(rid)
        status = reply.get("status", "")
        if status != "ok":
            code = ENGINE_TO_API.get(status, "worker_error")
            err = ApiError(code, f"prefill on {wid} ended {status}: {reply.get('error', '')}".strip())
            if reply.get("not_started") == "1" and status != "cancelled":
                raise NotStarted(err)
            raise err
        p.stage = "prefilled"
        p.t_first = time.perf_counter()
        # Finished on the worker: our hand-off is no longer queued there (the owner took it), and
        # a snapshot from while it ran still counts it as owed.
        start_ms, end_ms = float(reply.get("start_ms", 0)), float(reply.get("end_ms", 0))
        self.finished.setdefault(wid, []).append((predicted, start_ms, end_ms, time.time()))
        self.fleet.note_prefilled(wid, rid, predicted)
        p.batch_id = reply.get("batch_id", "")
        p.batch_size = int(reply.get("batch_size", 1) or 1)
        p.cached_tokens = int(float(reply.get("cached_tokens", 0)))
        p.prefill_ms = float(reply.get("end_ms", 0)) - float(reply.get("start_ms", 0))
        p.queue_ms = max(0.0, (p.t_first - p.t_handoff) * 1000 - p.prefill_ms)
        self._log("prefilled", req, p)
        return reply

    def _alt_limit(
        self, req: GenRequest, alt: str, alt_pred: float, admitted: Verdict | None
    ) -> float | None:
        """The fresh pick's runner-up's own allowance: the admitted budget with its own predicted
        prefill and time scale (`admission.max_backlog_ms`); None when admission is off."""
        if admitted is None or admitted.max_backlog_ms is None:
            return None
        bc = self.runtime.batcher_config
        window = bc.wait_ms if bc.holds_window else 0.0
        return max_backlog_ms(
            self.runtime.admission,
            alt_pred,
            admitted.budget_ms,
            window_ms=window,
            time_scale=self._scale(alt),
            explicit=bool(req.deadline_ms),
        )

    def _over_backlog(
        self, req: GenRequest, p: Progress, wid: str, queued: float, owed: float, v: Verdict, fresh: bool
    ) -> None:
        """A hand-off the script refused: ``wid``'s live backlog (``queued`` / ``owed`` ms, without
        this request) exceeded the request's allowance (``v.max_backlog_ms``: other replicas' hand-
        offs since our snapshot took the room), nothing was queued. 429 `slo_unattainable`,
        Retry-After the time that live backlog needs to fall back within it
        (`admission.fits_on_live`), counted as admission's other refusals are."""
        self.replies.forget(req.request_id)  # the overlay already holds this answer (`_prefill`)
        if fresh:
            self._log("queued", req, p)
        refused = fits_on_live(self.runtime.admission, v, queued, owed, self._scale(wid))
        M.ADMISSION_REJECTIONS.labels("slo_unattainable").inc()
        raise ApiError(
            "slo_unattainable",
            f"{wid} is busy on the live state ({queued + owed:.0f} ms queued and owed, "
            f"{v.max_backlog_ms or 0.0:.0f} ms fit this request's deadline); retry later",
            retry_after_s=max(refused.retry_after_s, self.runtime.admission.retry_after_s),
        )
