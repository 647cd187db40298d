"""The origin's request path (DESIGN §3): record → route → reserve decode KV → hand off the
prefill to the worker's owner → wait for its reply → stream decode → finish.

Every exit path runs one clean-up that is safe to repeat: tombstone or cancel whatever is still
running on an engine, release the decode reservation, write exactly one terminal lifecycle state.
So a request either completes or ends with a typed error, and nothing stays held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from redis.exceptions import RedisError, ResponseError

from app import metrics as M
from app.gateway.errors import ApiError
from app.protocol.blocks import block_keys, hit_blocks_cap
from app.rpc.worker_client import WorkerUnavailable
from app.scheduling.admission import decide as admission_decide
from app.scheduling.admission import expected_batch_wait_ms
from app.scheduling.formula import BatchItem
from app.scheduling.reserve import OutputLengthEstimator
from app.scheduling.routing import DecodeQuery, NoWorker, PrefillQuery, WorkerView, current_loads
from app.state.handoff import Handoff, pack_tokens
from app.state.store import request_fields
from app.state.text import to_str as _s

if TYPE_CHECKING:
    from app.gateway.replica import Replica

log = logging.getLogger("flexlb.request")

#: Wall ms the gateway itself needs between admission and a first token (hand-off, the owner's
#: read, the reply) on a loaded host, on top of the worker's predicted time (SLO admission).
GATEWAY_FLOOR_MS = 20.0

TERMINAL = {"completed", "failed", "cancelled", "timed_out", "owner_lost"}
ENGINE_TO_API = {
    "cancelled": "cancelled",
    "too_long": "invalid_request",
    "invalid_request": "invalid_request",
    "duplicate": "duplicate_request",
    "deadline_exceeded": "deadline_exceeded",  # the owner ended it: its TTFT deadline passed queued
}


@dataclass
class GenRequest:
    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    timeout_ms: int
    trace_id: str = ""
    endpoint: str = "generate"
    # The gateway made the id up (a fresh UUID): it cannot collide with a live or finished one,
    # so recording the request and handing it off may share one round trip.
    fresh_id: bool = False
    # OpenAI `stop`: fed each output chunk in order, returns how many of its ids to keep when a
    # stop string completed in it (app/api/stop.py). Decoding then ends with finish_reason "stop".
    stop: Callable[[Sequence[int]], int | None] | None = None
    user: str = ""  # OpenAI `user`: only logged
    # TTFT deadline in wall ms from arrival (`deadline_ms` / `x-flexlb-slo-ms`); 0 = the
    # cluster SLO. SLO admission refuses what cannot meet it; the owner ends it if it passes.
    deadline_ms: float = 0.0
    # temperature / top_p / seed (those given): they travel in the hand-off to the prefill batch,
    # and on in the KV to decode. The simulated engines ignore them; a real one samples by them.
    sampling: dict[str, float | int] | None = None
    priority: int = 1  # level of its x-flexlb-priority class (app/dispatch/items.py); `pr` if not 1


@dataclass
class Progress:
    """What the clean-up needs to know about how far the request got."""

    stage: str = "new"  # new | recorded | reserved | handed_off | prefilled | decoding | done
    prefill_worker: str = ""
    decode_worker: str = ""
    batch_id: str = ""
    batch_size: int = 1
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    t0: float = 0.0
    t_handoff: float = 0.0
    t_first: float = 0.0
    prefill_ms: float = 0.0
    queue_ms: float = 0.0
    handoffs: int = 0  # hand-offs made so far; each reply names the one it answers
    packed: bytes = b""  # the prompt as little-endian int32, converted once for keys and hand-off


class StoredOutcome(Exception):
    """The request id already finished: the stored outcome is the answer (idempotent retry)."""

    def __init__(self, outcome: dict[str, Any]) -> None:
        super().__init__("stored outcome")
        self.outcome = outcome


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


class Pipeline:
    def __init__(self, replica: Replica) -> None:
        self.r = replica
        self.handoff = Handoff(replica.store)
        self.rng = random.Random()
        self._background: set[asyncio.Task[None]] = set()  # fire-and-forget worker calls
        self.live: dict[str, asyncio.Task[Any]] = {}  # request id → the task running it here
        self.cancel_requested: set[str] = set()  # ids cancel_local() cancelled and still live
        # worker id → this origin's prefills that finished there lately: (predicted ms, modelled
        # start and end on the worker's clock, wall time of the reply); see `routing.current_loads`.
        self.finished: dict[str, list[tuple[float, float, float, float]]] = {}
        # worker id → (the snapshot dict it was parsed from, registry state, its view): snapshots
        # are replaced, never mutated, a few times a second, while every request ranks every
        # worker: parse each snapshot once, not ~10 text fields per worker per request.
        self._view_cache: dict[str, tuple[dict[str, str], str | None, WorkerView]] = {}
        # Decode KV per request: max_new_tokens, or the learned mean / pXX (FLEXLB_RESERVE_OUTPUT_TOKENS)
        self.out_est = OutputLengthEstimator(replica.settings.reserve_output_tokens)
        # worker id → (its ledger's owed ms, wall s) as our last hand-off there read it
        self.owed_overlay: dict[str, tuple[float, float]] = {}

    # ---- routing inputs ------------------------------------------------------------------
    def views(self, role: str) -> list[WorkerView]:
        r = self.r
        out = []
        ids = r.prefill_ids() if role == "prefill" else r.decode_ids()
        for wid in ids:
            snap = r.snapshots.get(wid, {})
            state = r.workers.get(wid, {}).get("state")
            cached = self._view_cache.get(wid)
            if cached is not None and cached[0] is snap and cached[1] == state and cached[2].role == role:
                view = cached[2]
            else:
                view = _parse_view(wid, role, snap, state)
                self._view_cache[wid] = (snap, state, view)
            prefill = role == "prefill"
            now = time.time()
            queued, owed = current_loads(
                view.queued_ms,
                float(snap.get("owed_ms", 0.0) or 0.0) if prefill else 0.0,
                float(snap.get("now_ms", 0.0) or 0.0),
                r.queued_overlay.get(wid),
                r.snapshot_time.get(wid, 0.0),
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

    def block_size(self) -> int:
        for wid in self.r.prefill_ids():
            bs = self.r.snapshots.get(wid, {}).get("block_size")
            if bs:
                return int(float(bs))
        return 64

    # ---- the request ---------------------------------------------------------------------
    async def run(self, req: GenRequest) -> AsyncIterator[tuple[str, Any]]:
        """Yields ("first", token), ("tokens", [ids]) and finally ("end", outcome)."""
        r = self.r
        if not r.redis_ok:
            raise ApiError(
                "state_unavailable", f"shared state unavailable: {r.redis_reason}", retry_after_s=1
            )
        if not r.accepting:
            raise ApiError("draining", "this replica is shutting down; retry on another", retry_after_s=1)
        p = Progress(t0=time.perf_counter())
        rid = req.request_id
        task = asyncio.current_task()
        if task is not None:
            # setdefault: a duplicate of a request live on this replica must not take its slot
            # (its clean-up would then drop the original's cancel handle and reply future).
            self.live.setdefault(rid, task)
        try:
            self._choose_decode(req, p)
            if not req.fresh_id:
                await self._record(req, p)  # a client id: refuse a duplicate before any hand-off
            async with asyncio.timeout(req.timeout_ms / 1000):
                async for ev in self._execute(req, p):
                    yield ev
            outcome = self._outcome(req, p, "completed")
            self.out_est.observe(len(p.output_ids))  # learns the model's output lengths
            await self._finish(req, p, "completed", outcome)
            self._observe(req, p, "ok")
            yield ("end", outcome)
        except StoredOutcome:
            raise
        except asyncio.CancelledError:
            await self._abort(req, p, "cancelled", ApiError("cancelled", "request cancelled"))
            raise
        except TimeoutError:
            err = ApiError("deadline_exceeded", f"request exceeded timeout_ms={req.timeout_ms}")
            await self._abort(req, p, "timed_out", err)
            raise err from None
        except ApiError as err:
            if p.stage != "new":
                await self._abort(req, p, "cancelled" if err.code == "cancelled" else "failed", err)
            elif err.code in ("no_worker", "draining", "overloaded", "slo_unattainable"):  # nothing written
                self._observe(req, p, err.code)
            raise
        except RedisError as exc:  # fail_closed: shared state unreachable mid-request
            err = ApiError(
                "state_unavailable", f"shared state unavailable: {type(exc).__name__}", retry_after_s=1
            )
            await self._abort(req, p, "failed", err)
            raise err from None
        except GeneratorExit:  # the consumer went away (client disconnect)
            # After the last event a consumer that stops iterating closes us here too: that is the
            # normal end, not a cancel (every completed request was also counted `cancelled`).
            if p.stage != "done":
                await self._abort(req, p, "cancelled", ApiError("cancelled", "client disconnected"))
            raise
        except Exception as exc:
            log.exception("request %s failed", rid, extra={"request_id": rid, "trace_id": req.trace_id})
            err = ApiError("internal", "internal error")
            await self._abort(req, p, "failed", err)
            raise err from exc
        finally:
            if self.live.get(rid) is task:
                del self.live[rid]
                self.cancel_requested.discard(rid)
            if p.stage != "new":  # only the request that created the record waits for its reply
                r.replies.forget(rid)

    def _choose_decode(self, req: GenRequest, p: Progress) -> None:
        """Pure: the decode worker (DESIGN §3 step 5) is chosen before anything is written, so its
        KV reservation rides in the record's round trip. `max_tokens: 1` never touches decode."""
        if req.max_new_tokens <= 1:
            return
        views = self.views("decode")
        try:
            dq = DecodeQuery(len(req.input_ids), self.out_est.reserve(req.max_new_tokens))
            p.decode_worker = self.r.decode_strategy.choose(dq, views, self.rng).worker_id
        except NoWorker as exc:
            need = len(req.input_ids) + req.max_new_tokens
            # KV that is full *now* on a worker big enough is load: 429 overloaded, come back
            # later. Only when no live worker could ever hold it is it 503 no_worker.
            fits = any(v.up and not v.draining and v.kv_total_tokens >= need for v in views)
            raise ApiError("overloaded" if fits else "no_worker", str(exc), retry_after_s=1) from None

    async def _record(self, req: GenRequest, p: Progress) -> None:
        """One round trip: the lifecycle record (refused when the id exists), this origin's
        live-set entry (the master reaps our requests through it if we die) and the decode KV
        reservation — so the hand-off is the second and last round trip before prefill."""
        r = self.r
        rid = req.request_id
        dec = p.decode_worker
        fields = self._record_fields(req, p)
        args = [r.replica_id, *request_fields(fields)]
        cmds: list[list[Any]] = [
            ["SADD", r.keys.origin_requests(r.replica_id), rid],
            ["EVALSHA", r.store.sha("create_request"), 1, r.keys.request(rid), *args],
        ]
        if dec:
            cap = int(float(r.snapshots.get(dec, {}).get("kv_total_tokens", 0) or 0))
            need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
            cmds.append(["EVALSHA", r.store.sha("reserve"), 1, r.keys.reservations(dec), rid, need, cap])
        res = await self._round_trip(cmds)
        created = res[1]
        held = int(res[2]) if dec else -1
        if int(created) != 1:
            if held == 1:  # our own fresh hold for a refused duplicate (2 = the original's: keep it)
                await r.store.release(dec, rid)
            rec = await r.store.get_request(req.request_id)
            if rec is None or rec.get("origin") != r.replica_id:
                await r.redis.srem(r.keys.origin_requests(r.replica_id), req.request_id)
            if rec is not None and rec.get("state") in TERMINAL:
                raise StoredOutcome(rec.get("outcome") or {"state": rec.get("state")})
            raise ApiError("duplicate_request", f"request {req.request_id!r} is still running")
        p.stage = "recorded"
        self._log("queued", req, p)
        if dec:
            if held == 0 and not await self._reserve_elsewhere(req, p):
                raise ApiError("overloaded", f"decode worker {dec} has no KV left", retry_after_s=1)
            p.stage = "reserved"

    def _record_fields(self, req: GenRequest, p: Progress) -> dict[str, Any]:
        """The record carries its holds from creation (issue 14): the decode worker and the
        tokens held there, and the prefill worker when already chosen — so the reconciler and the
        reaper of a dead origin can release them without trusting the origin to have written its
        terminal state."""
        fields: dict[str, Any] = {
            "endpoint": req.endpoint,
            "input_tokens": len(req.input_ids),
            "trace_id": req.trace_id,
        }
        if p.decode_worker:
            fields["decode_worker"] = p.decode_worker
            fields["decode_tokens"] = len(req.input_ids) + req.max_new_tokens
        if p.prefill_worker:
            fields["prefill_worker"] = p.prefill_worker
        return fields

    async def _record_and_append(
        self, req: GenRequest, p: Progress, wid: str, meta: dict[str, Any], predicted: float
    ) -> tuple[str | None, float, float, int]:
        """`_record` and the hand-off in ONE pipeline (DESIGN §3: the origin's only serial round
        trip), for ids the gateway generated. Returns (entry id or None when the queue is full,
        queued ms, owed ms, decode hold: 1 new / 0 refused / -1 no decode)."""
        r = self.r
        rid = req.request_id
        p.prefill_worker = wid
        fields = self._record_fields(req, p)
        sha = r.store.sha
        dec = p.decode_worker
        need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
        cap = int(float(r.snapshots.get(dec, {}).get("kv_total_tokens", 0) or 0)) if dec else 0
        ids = p.packed or pack_tokens(req.input_ids)
        meta_json = json.dumps(meta, separators=(",", ":"))
        cmds: list[list[Any]] = [
            ["SADD", r.keys.origin_requests(r.replica_id), rid],
            [
                "EVALSHA",
                sha("create_request"),
                1,
                r.keys.request(rid),
                r.replica_id,
                *request_fields(fields),
            ],
        ]
        if dec:
            cmds.append(["EVALSHA", sha("reserve"), 1, r.keys.reservations(dec), rid, need, cap])
        cmds.append(
            [
                "EVALSHA",
                sha("handoff"),
                3,
                r.keys.queue(wid),
                r.keys.queued_ms(wid),
                r.keys.ledger(wid),
                r.settings.max_queue_len,
                f"{predicted:.6f}",
                meta_json,
                ids,
                f"{self._scale(wid):g}",
            ]
        )
        # Whatever applied before a failure must be cleaned up as if handed off.
        p.stage = "handed_off"
        res = await self._round_trip(cmds)
        if int(res[1]) != 1:  # a fresh UUID already exists: not ours to touch, drop our hand-off
            await r.store.tombstone(wid, rid, 60_000)
            raise RuntimeError(f"generated request id {rid} collided")
        held = int(res[2]) if dec else -1
        entry, queued, owed = _s(res[-1][0]), float(_s(res[-1][1])), float(_s(res[-1][2]))
        if entry == "-1":  # the queue was full: recorded (and reserved), nothing queued
            p.stage = "recorded"
            return None, queued, owed, held
        return entry, queued, owed, held

    def _scale(self, wid: str) -> float:
        """The worker's time scale (wall ms per modelled ms) from its snapshot."""
        return float(self.r.snapshots.get(wid, {}).get("time_scale", 1.0) or 1.0)

    async def _round_trip(self, cmds: list[list[Any]]) -> list[Any]:
        """One round trip; the scripts answered NOSCRIPT (Redis restarted and lost them) are loaded
        and rerun (`StateStore.execute_scripts`). Any other error reply is raised."""
        res = await self.r.store.execute_scripts(cmds)
        for x in res:
            if isinstance(x, ResponseError):
                raise x
        return res

    async def _reserve_elsewhere(self, req: GenRequest, p: Progress, tries: int = 2) -> bool:
        """The chosen decode worker refused the reservation: the snapshot we ranked on was older
        than other replicas' reservations. Try the next best workers (up to `tries`, one round trip
        each) before answering 429; the simulator showed most such refusals fit elsewhere."""
        r = self.r
        refused = {p.decode_worker}
        need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
        for _ in range(tries):
            views = [v for v in self.views("decode") if v.id not in refused]
            try:
                dec = r.decode_strategy.choose(
                    DecodeQuery(len(req.input_ids), self.out_est.reserve(req.max_new_tokens)), views, self.rng
                )
            except NoWorker:
                return False
            cap = int(float(r.snapshots.get(dec.worker_id, {}).get("kv_total_tokens", 0) or 0))
            M.DECODE_RESERVE_RETRIES.inc()
            if await r.store.reserve(dec.worker_id, req.request_id, need, cap):
                p.decode_worker = dec.worker_id
                # The record names where the hold is (the reconciler and the reaper release it
                # from there); the first choice held nothing.
                await r.redis.hset(r.keys.request(req.request_id), "decode_worker", dec.worker_id)
                return True
            refused.add(dec.worker_id)
        return False

    async def _execute(self, req: GenRequest, p: Progress) -> AsyncIterator[tuple[str, Any]]:
        r = self.r
        rid = req.request_id
        n_in = len(req.input_ids)
        # the decode KV is already reserved (in _record's round trip)
        try:
            bs = self.block_size()
            arr = np.asarray(req.input_ids, dtype="<i4")
            p.packed = arr.tobytes()
            keys = block_keys(arr, bs, model=r.settings.model, tokenizer=r.tokenizer.name)
            now_ms = time.time() * 1000
            pviews = self.views("prefill")
            hits = r.mirror.match(keys, [v.id for v in pviews], now_ms)
            pchoice = r.prefill_strategy.choose(PrefillQuery(n_in, hits, bs), pviews, self.rng)
        except NoWorker as exc:
            raise ApiError(
                "no_worker", exc.reason if hasattr(exc, "reason") else str(exc), retry_after_s=1
            ) from None
        self._admit(req, p, pchoice, pviews)
        retried = False
        for attempt in range(2):
            try:
                reply = await self._prefill(
                    req, p, pchoice.worker_id, pchoice.predicted_ms, keys, bs, pchoice.hit_tokens
                )
            except _NotStarted as ns:
                # The whole batch failed before the worker accepted it: nothing ran, so the
                # request may run elsewhere — once, on another worker (DESIGN §6).
                if retried:
                    raise ns.error from None
                retried = True
                others = [v for v in self.views("prefill") if v.id != pchoice.worker_id]
                try:
                    hits = r.mirror.match(keys, [v.id for v in others], time.time() * 1000)
                    pchoice = r.prefill_strategy.choose(PrefillQuery(n_in, hits, bs), others, self.rng)
                except NoWorker:
                    raise ns.error from None
                M.PREFILL_RETRIES.inc()
                log.info(
                    "prefill batch failed before it started; retrying on %s",
                    pchoice.worker_id,
                    extra={"request_id": rid, "trace_id": req.trace_id},
                )
                reply = await self._prefill(
                    req, p, pchoice.worker_id, pchoice.predicted_ms, keys, bs, pchoice.hit_tokens
                )
            first = int(reply["first_token"])
            stopped = False
            if attempt == 0:
                p.output_ids.append(first)
                stopped = req.stop is not None and req.stop([first]) is not None
                yield ("first", first)
            if req.max_new_tokens == 1 or stopped:
                # No decode will fetch this KV: unpin it now rather than at the handle's expiry
                # (30 s of pinned prefix the cache could otherwise evict or reuse).
                self._release_prefill_kv(p.prefill_worker, rid, reply.get("epoch", ""))
                p.finish_reason = "stop" if stopped else "length"
                return
            reason = ""
            async for ev in self._decode(req, p, reply):
                if isinstance(ev, str):
                    reason = ev
                else:
                    yield ("tokens", ev)
            if reason == "stop":
                p.finish_reason = "stop"
                return
            if reason == "kv_expired" and attempt == 0:
                log.info("kv handle expired; re-running prefill once", extra={"request_id": rid})
                continue
            if reason != "length":
                raise ApiError("worker_error", f"decode ended: {reason}")
            p.finish_reason = "length"
            return

    def _admit(self, req: GenRequest, p: Progress, choice: Any, views: list[WorkerView]) -> None:
        """SLO admission on the chosen worker (app/scheduling/admission.py), before anything is
        handed off: a request that cannot meet its deadline there gets 429 `slo_unattainable`
        at once instead of queueing where it would miss anyway and delay the rest."""
        r = self.r
        cfg = r.admission
        if cfg.mode == "off":
            return
        view = next((v for v in views if v.id == choice.worker_id), None)
        if view is None:
            return
        scale = float(r.snapshots.get(choice.worker_id, {}).get("time_scale", 1.0) or 1.0)
        bc = r.batcher_config
        own = choice.predicted_ms or r.formula.predict_batch(
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

    async def _prefill(
        self,
        req: GenRequest,
        p: Progress,
        wid: str,
        predicted: float,
        keys: list[int],
        bs: int,
        hit_tokens: int = 0,
    ) -> dict[str, str]:
        r = self.r
        rid = req.request_id
        # The queue's counter gains exactly what the entry says (`pred`, 3 decimals), which is what
        # the owner takes off at commit: 6 decimals here left ~0.0005 ms per request behind, a
        # drift the reconciler measured at 0.011 ms after 600 requests.
        predicted = round(predicted, 3)
        p.prefill_worker = wid
        p.handoffs += 1
        attempt = p.handoffs
        r.replies.forget(rid)  # a late reply to an earlier hand-off must not answer this one
        fut = r.replies.expect(rid)
        deadline = time.time() * 1000 + req.timeout_ms
        meta = {
            "rid": rid,
            "origin": r.replica_id,
            "pred": round(predicted, 3),
            "deadline": round(deadline),
            "trace": req.trace_id,
            "t": round(time.time(), 6),
            "hit": hit_tokens,
            "att": attempt,
        }
        if r.admission.mode != "off":
            # the owner's batcher caps batches by it, and ends the request typed if it passes
            # while queued when the client set it (or FLEXLB_ADMISSION_DROP_LATE=always)
            slo = req.deadline_ms or r.batcher_config.slo_ttft_ms * self._scale(wid)
            meta["ttft_dl"] = round(time.time() * 1000 + slo - (time.perf_counter() - p.t0) * 1000)
            if req.deadline_ms or r.admission.drop_late == "always":
                meta["drop"] = 1
        meta.update({"pr": req.priority} if req.priority != 1 else {})  # the owner's batch order
        if req.sampling:
            meta["smp"] = req.sampling
        p.t_handoff = time.perf_counter()  # the reply's wait minus the prefill is its queue time
        # Counted on our overlay before the round trip: requests routed meanwhile on this replica
        # (a burst) see it, rather than all ranking and admitting against the same queue.
        ov = r.queued_overlay.get(wid)
        base = ov[0] if ov is not None and ov[1] >= r.snapshot_time.get(wid, 0.0) else None
        if base is None:
            base = float(r.snapshots.get(wid, {}).get("queued_ms", 0.0) or 0.0)
        r.queued_overlay[wid] = (base + predicted, time.time())
        held = -1
        fresh = p.stage == "new"
        if fresh:  # a fresh id: record, reserve and hand off in one round trip
            entry, queued, owed, held = await self._record_and_append(req, p, wid, meta, predicted)
        else:
            entry, queued, owed = await self.handoff.append(
                wid,
                meta,
                p.packed or pack_tokens(req.input_ids),
                predicted,
                r.settings.max_queue_len,
                self._scale(wid),
            )
        self.owed_overlay[wid] = (owed, time.time())
        if entry is None:
            r.replies.forget(rid)
            if fresh:
                self._log("queued", req, p)
            raise ApiError("overloaded", f"prefill queue of {wid} is full", retry_after_s=1)
        p.stage = "handed_off"
        if held == 0:
            if fresh:
                self._log("queued", req, p)
                fresh = False
            if not await self._reserve_elsewhere(req, p):
                # the prefill is queued already: the abort tombstones and cancels it
                raise ApiError(
                    "overloaded", f"decode worker {p.decode_worker} has no KV left", retry_after_s=1
                )
        overhead = time.perf_counter() - p.t0
        M.ORIGIN_OVERHEAD.observe(overhead)
        M.SAMPLES["origin_overhead_s"].add(overhead)
        if fresh:  # logged after the clock stops: a log line is I/O, not scheduling
            self._log("queued", req, p)
        r.queued_overlay[wid] = (queued, time.time())
        n_cap = hit_blocks_cap(len(req.input_ids), bs)
        r.mirror.add_speculative(wid, keys[: max(n_cap, 0) + 1], time.time() * 1000)
        r.wake_owner(wid)
        reply = await fut
        while reply.get("att", str(attempt)) != str(attempt):  # stale: an earlier hand-off's answer
            reply = await r.replies.expect(rid)
        status = reply.get("status", "")
        if status != "ok":
            code = ENGINE_TO_API.get(status, "worker_error")
            err = ApiError(code, f"prefill on {wid} ended {status}: {reply.get('error', '')}".strip())
            if reply.get("not_started") == "1" and status != "cancelled":
                raise _NotStarted(err)
            raise err
        p.stage = "prefilled"
        p.t_first = time.perf_counter()
        # Finished on the worker: our hand-off is no longer queued there (the owner took it), and
        # a snapshot from while it ran still counts it as owed.
        start_ms, end_ms = float(reply.get("start_ms", 0)), float(reply.get("end_ms", 0))
        self.finished.setdefault(wid, []).append((predicted, start_ms, end_ms, time.time()))
        ov = r.queued_overlay.get(wid)
        if ov is not None:
            r.queued_overlay[wid] = (max(0.0, ov[0] - predicted), ov[1])
        p.batch_id = reply.get("batch_id", "")
        p.batch_size = int(reply.get("batch_size", 1) or 1)
        p.cached_tokens = int(float(reply.get("cached_tokens", 0)))
        p.prefill_ms = float(reply.get("end_ms", 0)) - float(reply.get("start_ms", 0))
        p.queue_ms = max(0.0, (p.t_first - p.t_handoff) * 1000 - p.prefill_ms)
        self._log("prefilled", req, p)
        return reply

    async def _decode(self, req: GenRequest, p: Progress, reply: dict[str, str]) -> AsyncIterator[Any]:
        r = self.r
        dec = p.decode_worker
        snap = r.snapshots.get(dec, {})
        p.stage = "decoding"
        self._log("decoding", req, p)
        pre_addr = r.workers.get(p.prefill_worker, {}).get("address") or p.prefill_worker.split("@", 1)[1]
        stream = r.client(dec).decode(
            req.request_id,
            snap.get("epoch", ""),
            len(req.input_ids),
            req.max_new_tokens - 1,
            kv_worker=pre_addr,
            kv_epoch=reply.get("epoch", ""),
            timeout=req.timeout_ms / 1000,
        )
        try:
            async with contextlib.aclosing(stream):  # leaving early ends the RPC now
                async for ev in stream:
                    if ev.event == "tokens":
                        if req.request_id in self.cancel_requested:  # a cancel something swallowed
                            raise asyncio.CancelledError
                        keep = req.stop(ev.tokens) if req.stop is not None else None
                        tokens = ev.tokens if keep is None else ev.tokens[:keep]
                        p.output_ids.extend(tokens)
                        yield tokens
                        if keep is not None:
                            await self._stop_decode(req, dec)
                            yield "stop"
                            return
                    else:
                        yield ev.finish_reason
                        return
        except WorkerUnavailable as exc:
            task = asyncio.current_task()
            if req.request_id in self.cancel_requested or (task is not None and task.cancelling()):
                # Our own cancel (DELETE, client gone) that grpc.aio turned into an RPC error: the
                # request ends `cancelled`, not `failed` with a worker_error.
                raise asyncio.CancelledError from exc
            raise ApiError("worker_error", f"decode worker {dec} failed: {str(exc)[:200]}") from None

    async def _stop_decode(self, req: GenRequest, dec: str) -> None:
        """A stop string ended the output early: cancel the engine's decode, which frees its KV
        (the gateway's reservation is released by `_finish`). A failed cancel is logged: the
        engine still ends the decode at max_new_tokens or the deadline."""
        try:
            await asyncio.wait_for(self.r.client(dec).cancel(req.request_id), 2.0)
        except Exception as exc:
            log.warning("cancel of stopped decode %s on %s failed: %s", req.request_id, dec, exc)

    # ---- endings -------------------------------------------------------------------------
    def _outcome(
        self, req: GenRequest, p: Progress, state: str, err: ApiError | None = None
    ) -> dict[str, Any]:
        total_ms = (time.perf_counter() - p.t0) * 1000
        out: dict[str, Any] = {
            "state": state,
            "request_id": req.request_id,
            "output_ids": p.output_ids,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(p.output_ids),
            "cached_tokens": p.cached_tokens,
            "prefill_worker": p.prefill_worker,
            "decode_worker": p.decode_worker if req.max_new_tokens > 1 else "",
            "batch_id": p.batch_id,
            "batch_size": p.batch_size,
            "finish_reason": p.finish_reason,
            "timings": {
                "queue_ms": round(p.queue_ms, 3),
                "prefill_ms": round(p.prefill_ms, 3),
                "first_token_ms": round((p.t_first - p.t0) * 1000, 3) if p.t_first else None,
                "total_ms": round(total_ms, 3),
            },
        }
        if err is not None:
            out["error"] = err.body()["error"]
        return out

    async def _finish(self, req: GenRequest, p: Progress, state: str, outcome: dict[str, Any]) -> None:
        r = self.r
        rid = req.request_id
        cmds: list[list[Any]] = []
        if p.decode_worker and p.stage != "new":
            cmds.append(["EVALSHA", r.store.sha("release"), 1, r.keys.reservations(p.decode_worker), rid])
        cmds.append(["SREM", r.keys.origin_requests(r.replica_id), rid])
        fields = {"prefill_worker": p.prefill_worker, "decode_worker": p.decode_worker}
        cmds.append(r.store.transition_cmd(rid, state, fields, outcome=outcome))
        # Never lost, never fatal (issue 14): a final round trip Redis did not answer is retried
        # from the replica's bounded queue (every command here is idempotent for this id). The
        # client's answer does not wait for it — a stream that sent its last token ends with its
        # finish_reason even while Redis restarts.
        await r.terminal.run_or_queue(f"finish {rid}", lambda: self._round_trip(cmds))
        p.stage = "done"
        self._log(
            state, req, p, code=str(outcome.get("error", {}).get("code", "")) if state != "completed" else ""
        )

    def _observe(self, req: GenRequest, p: Progress, code: str) -> None:
        M.REQUESTS.labels(req.endpoint, code).inc()
        if code != "ok":
            return
        end = time.perf_counter()
        if p.t_first:
            M.TTFT.observe(p.t_first - p.t0)
            if len(p.output_ids) > 1:
                M.TPOT.observe((end - p.t_first) / (len(p.output_ids) - 1))
        M.E2E.observe(end - p.t0)

    async def _abort(self, req: GenRequest, p: Progress, state: str, err: ApiError) -> None:
        """Clean-up on every failure path; shielded so a second cancel cannot cut it short."""
        self._observe(req, p, err.code)
        if p.stage in ("new", "done"):
            return
        # Shielded so a second cancel cannot cut the clean-up short. It raises nothing it can
        # name: state writes that fail are queued for retry, engine cancels that fail are logged
        # (the engine ends streams whose consumer vanished, and KV handles expire). Anything else
        # is a bug and must surface, not be swallowed around a state change.
        await asyncio.shield(self._abort_inner(req, p, state, err))

    async def _abort_inner(self, req: GenRequest, p: Progress, state: str, err: ApiError) -> None:
        r = self.r
        rid = req.request_id
        if p.stage == "handed_off" and p.prefill_worker:
            # Queued: the tombstone makes the owner's commit drop it. Dispatched: the engine cancels.
            wid = p.prefill_worker
            await r.terminal.run_or_queue(f"tombstone {rid}", lambda: r.store.tombstone(wid, rid, 60_000))
            await self._cancel_on(wid, rid)
        if p.stage == "decoding" and p.decode_worker:
            await self._cancel_on(p.decode_worker, rid)
        if p.stage == "prefilled" and p.prefill_worker:  # KV pinned on prefill, decode never fetched it
            await self._cancel_on(p.prefill_worker, rid)
        await self._finish(req, p, state, self._outcome(req, p, state, err))

    async def _cancel_on(self, wid: str, rid: str) -> None:
        try:
            await asyncio.wait_for(self.r.client(wid).cancel(rid), 2.0)
        except (WorkerUnavailable, TimeoutError) as exc:
            log.info("cancel of %s on %s failed: %s", rid, wid, exc, extra={"request_id": rid})

    def _release_prefill_kv(self, wid: str, rid: str, epoch: str) -> None:
        async def release() -> None:
            try:
                await self.r.client(wid).release(rid, epoch, timeout=2.0)
            except Exception as exc:  # the handle still expires on its own
                log.debug("kv release of %s on %s failed: %s", rid, wid, exc)

        t = asyncio.create_task(release())
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def cancel_local(self, request_id: str) -> bool:
        task = self.live.get(request_id)
        if task is None or task.done():
            return False
        self.cancel_requested.add(request_id)
        task.cancel()
        return True

    def _log(self, event: str, req: GenRequest, p: Progress, code: str = "") -> None:
        """One JSON line per lifecycle transition (DESIGN §9), with the ids an operator greps."""
        extra: dict[str, Any] = {
            "event": event,
            "request_id": req.request_id,
            "trace_id": req.trace_id,
            "prefill_worker": p.prefill_worker or None,
            "decode_worker": p.decode_worker or None,
            "batch_id": p.batch_id or None,
        }
        if code:
            extra["code"] = code
        if req.user:
            extra["user"] = req.user
        log.info("request %s %s", req.request_id, event, extra=extra)


class _NotStarted(Exception):
    """A prefill hand-off whose batch failed before the worker accepted it."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error
