"""The origin's request path (DESIGN §3): record → route → reserve decode KV → hand off the
prefill to the worker's owner → wait for its reply → stream decode → finish.

Every exit path runs one clean-up that is safe to repeat: tombstone or cancel whatever is still
running on an engine, release the decode reservation, write exactly one terminal lifecycle state.
So a request either completes or ends with a typed error, and nothing stays held.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError

from app import metrics as M
from app.gateway.errors import ApiError
from app.request.decode_stage import DecodeStage
from app.request.endings import Endings
from app.request.handoff_round_trip import HandoffRoundTrip
from app.request.handoff_stage import HandoffStage
from app.request.record_stage import RecordStage
from app.request.routing_inputs import RoutingInputs
from app.request.types import ENGINE_TO_API, TERMINAL, GenRequest, NotStarted, Progress, StoredOutcome
from app.scheduling.reserve import DecodeHoldMirror, OutputLengthEstimator
from app.scheduling.routing import (
    NoWorker,
    WorkerView,
)
from app.state.handoff import Handoff

__all__ = ["ENGINE_TO_API", "TERMINAL", "GenRequest", "Pipeline", "Progress", "StoredOutcome"]

log = logging.getLogger("flexlb.request")


class Pipeline(RoutingInputs, RecordStage, HandoffRoundTrip, HandoffStage, DecodeStage, Endings):
    def __init__(self, **collaborators: Any) -> None:
        """``collaborators``: the keywords of `RequestContext` (the replica's services, named)."""
        super().__init__(**collaborators)
        self.handoff = Handoff(self.store)
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
        self.out_est = OutputLengthEstimator(self.settings.reserve_output_tokens)
        # Where our own decode holds name which prompt chunks (FLEXLB_DECODE_PREFER_HELD)
        self.dholds = DecodeHoldMirror()
        # worker id → (its ledger's owed ms, wall s) as our last hand-off there read it
        self.owed_overlay: dict[str, tuple[float, float]] = {}

    async def run(self, req: GenRequest) -> AsyncIterator[tuple[str, Any]]:
        """Yields ("first", token), ("tokens", [ids]) and finally ("end", outcome)."""
        if not self.health()[0]:
            raise ApiError(
                "state_unavailable", f"shared state unavailable: {self.health()[1]}", retry_after_s=1
            )
        if not self.accepting():
            raise ApiError("draining", "this replica is shutting down; retry on another", retry_after_s=1)
        p = Progress(t0=req.t_arrival or time.perf_counter())
        rid = req.request_id
        task = asyncio.current_task()
        if task is not None:
            # setdefault: a duplicate of a request live on this replica must not take its slot
            # (its clean-up would then drop the original's cancel handle and reply future).
            self.live.setdefault(rid, task)
        try:
            self.choose_decode(req, p)
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
            rid = req.request_id
            log.exception("request %s failed", rid, extra={"request_id": rid, "trace_id": req.trace_id})
            err = ApiError("internal", "internal error")
            await self._abort(req, p, "failed", err)
            raise err from exc
        finally:
            rid = req.request_id  # the attempt's id, when a retry re-opened the client's (_record)
            if self.live.get(rid) is task:
                del self.live[rid]
                self.cancel_requested.discard(rid)
            if p.stage != "new":  # only the request that created the record waits for its reply
                self.replies.forget(rid)

    def _rekey(self, old: str, new: str) -> None:
        """A retry re-opened the client's id as attempt `new` (app/state/lifecycle.py): the task
        is live under that id from now on, so a cancel of the attempt (by id, from any replica)
        and this origin's own sweep find it."""
        task = asyncio.current_task()
        if task is not None and self.live.get(old) is task:
            del self.live[old]
        if task is not None:
            self.live.setdefault(new, task)

    async def _execute(self, req: GenRequest, p: Progress) -> AsyncIterator[tuple[str, Any]]:
        rid = req.request_id
        n_in = len(req.input_ids)
        # the decode KV is already reserved (in _record's round trip)
        try:
            bs, keys = self.prompt_keys(req, p)
            now_s = time.time()
            pviews = self.views("prefill", now_s)
            pchoice, pair = self.choose_prefill_pair(n_in, keys, bs, pviews, now_s)
        except NoWorker as exc:
            raise ApiError(
                "no_worker", exc.reason if hasattr(exc, "reason") else str(exc), retry_after_s=1
            ) from None
        admitted = self._admit(req, p, pchoice, pviews)
        retried = False
        for attempt in range(2):
            try:
                reply = await self._prefill(
                    req,
                    p,
                    pchoice.worker_id,
                    pchoice.predicted_ms,
                    keys,
                    bs,
                    pchoice.hit_tokens,
                    pair,
                    admitted,
                )
            except NotStarted as ns:
                # The whole batch failed before the worker accepted it: nothing ran, so the
                # request may run elsewhere — once, on another worker (DESIGN §6).
                if retried:
                    raise ns.error from None
                retried = True
                others = [v for v in self.views("prefill") if v.id != p.prefill_worker]
                try:
                    pchoice = self.choose_prefill(n_in, keys, bs, others, time.time())
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

    def cancel_local(self, request_id: str) -> bool:
        task = self.live.get(request_id)
        if task is None or task.done():
            return False
        self.cancel_requested.add(request_id)
        task.cancel()
        return True
