"""How a request ends (DESIGN §3 step 10): its outcome, the one terminal write with the
reservation's release, the clean-up every failure path runs, metrics and the lifecycle log line."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from app import metrics as M
from app.gateway.errors import ApiError
from app.logging_setup import lifecycle_sampled
from app.request.context import RequestContext
from app.request.types import GenRequest, Progress

log = logging.getLogger("flexlb.request")


class Endings(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica."""

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
        rid = req.request_id
        cmds: list[list[Any]] = []
        if p.decode_worker and p.stage != "new":
            cmds.append(self.store.release_cmd(p.decode_worker, rid))
        self.dholds.drop(rid)  # this origin's view of its holds (DecodeHoldMirror)
        cmds.append(["SREM", self.keys.origin_requests(self.replica_id), rid])
        fields = {"prefill_worker": p.prefill_worker, "decode_worker": p.decode_worker}
        cmds.append(self.store.transition_cmd(rid, state, fields, outcome=outcome))
        # Never lost, never fatal (issue 14): a final round trip Redis did not answer is retried
        # from the replica's bounded queue (every command here is idempotent for this id). The
        # client's answer does not wait for it — a stream that sent its last token ends with its
        # finish_reason even while Redis restarts.
        await self.terminal.run_or_queue(f"finish {rid}", lambda: self._round_trip(cmds))
        p.stage = "done"
        self._log(
            state,
            req,
            p,
            code=str(outcome.get("error", {}).get("code", "")) if state != "completed" else "",
            timings=outcome.get("timings"),
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
        # Shielded so a second cancel cannot cut the clean-up short, and awaited to its end even
        # then: the request stays in `live` until its terminal write is done or queued, or the
        # origin's own sweep would see a non-terminal record nobody runs and end it `failed`
        # under the clean-up's feet (a DELETE's notify and the sweep of the cancel set both
        # cancel the task). It raises nothing it can name: state writes that fail are queued for
        # retry, engine cancels that fail are logged (the engine ends streams whose consumer
        # vanished, and KV handles expire). Anything else is a bug and must surface.
        inner = asyncio.ensure_future(self._abort_inner(req, p, state, err))
        interrupted = False
        while True:
            try:
                await asyncio.shield(inner)
                break
            except asyncio.CancelledError:
                if inner.done():
                    break
                interrupted = True
        if interrupted:
            raise asyncio.CancelledError

    async def _abort_inner(self, req: GenRequest, p: Progress, state: str, err: ApiError) -> None:
        rid = req.request_id
        if p.stage == "handed_off" and p.prefill_worker:
            # Queued: the tombstone makes the owner's commit drop it. Dispatched: the engine cancels.
            wid = p.prefill_worker
            await self.terminal.run_or_queue(
                f"tombstone {rid}", lambda: self.store.tombstone(wid, rid, 60_000)
            )
            await self._cancel_on(wid, rid)
        if p.stage == "decoding" and p.decode_worker:
            await self._cancel_on(p.decode_worker, rid)
        if p.stage == "prefilled" and p.prefill_worker:  # KV pinned on prefill, decode never fetched it
            await self._cancel_on(p.prefill_worker, rid)
        await self._finish(req, p, state, self._outcome(req, p, state, err))

    def _log(self, event: str, req: GenRequest, p: Progress, code: str = "", timings: Any = None) -> None:
        """One JSON line per lifecycle transition (DESIGN §9), with the ids an operator greps.
        Intermediate transitions only for the sampled share of requests (app/logging_setup.py);
        the terminal line, which carries `timings`, always."""
        if timings is None and not lifecycle_sampled(req.request_id):
            return
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
        if timings is not None:
            extra["timings"] = timings
        if req.user:
            extra["user"] = req.user
        log.info("request %s %s", req.request_id, event, extra=extra)
