"""The origin's request record (DESIGN §3 step 5): the lifecycle record, this origin's live-set
entry and the decode KV reservation, and a refused reservation's retry elsewhere; with the round
trip every write of the request path goes through (tenant limit, NOSCRIPT reload)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from app import metrics as M
from app.gateway.errors import ApiError
from app.request.context import RequestContext
from app.request.types import TERMINAL, GenRequest, Progress, StoredOutcome
from app.scheduling.routing import NoWorker
from app.security.tenants import public_id
from app.state.lifecycle import attempt_id, invites_retry
from app.state.store import request_fields


class RecordStage(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica: the
    record and decode hold for a client-given id (a gateway id records in the hand-off's round
    trip, app/request/handoff_round_trip.py)."""

    async def _record(self, req: GenRequest, p: Progress) -> None:
        """One round trip: the lifecycle record (refused when the id exists), this origin's
        live-set entry (the master reaps our requests through it if we die) and the decode KV
        reservation — so the hand-off is the second and last round trip before prefill."""
        rid = req.request_id
        dec = p.decode_worker
        fields = self._record_fields(req, p)
        args = [self.replica_id, *request_fields(fields)]
        cmds: list[list[Any]] = [
            ["SADD", self.keys.origin_requests(self.replica_id), rid],
            ["EVALSHA", self.store.sha("create_request"), 1, self.keys.request(rid), *args],
        ]
        if dec:
            cap = int(float(self.fleet.snapshots.get(dec, {}).get("kv_total_tokens", 0) or 0))
            need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
            cmds.append(self.store.reserve_cmd(dec, rid, need, cap, *self.decode_hold_blocks(req, p)))
        res = await self._round_trip(cmds, req)  # refused by the tenant's limit: nothing written
        created = res[1]
        held = int(res[2]) if dec else -1
        if int(created) != 1:
            if held == 1:  # our own fresh hold for a refused duplicate (2 = the original's: keep it)
                await self.store.release(dec, rid)
            head = await self.store.get_request(rid)
            if head is None or head.get("origin") != self.replica_id or head.get("state") in TERMINAL:
                # ours only while an attempt under this very id runs here; an ended one left the set
                await self.redis.srem(self.keys.origin_requests(self.replica_id), rid)
            held = await self._retry_or_refuse(req, p, head)
        p.stage = "recorded"
        self._log("queued", req, p)
        if dec:
            if held == 0 and not await self._reserve_elsewhere(req, p):
                raise ApiError("overloaded", f"decode worker {dec} has no KV left", retry_after_s=1)
            p.stage = "reserved"
            self.note_decode_hold(req, p)

    async def _retry_or_refuse(self, req: GenRequest, p: Progress, head: dict[str, Any] | None) -> int:
        """The client's id exists. Its current attempt ended in a way that invites a retry
        (`invites_retry`: retryable error, timeout, cancel): open the next attempt under its own
        id (app/state/lifecycle.py) in one round trip like the first — live set, record, decode
        hold — and return the hold's answer. Ended otherwise: its stored outcome is the answer.
        Still running (or another retry won the race): 409 `duplicate_request`."""
        cid = req.request_id
        n = int(head.get("attempt") or 1) if head is not None else 1
        cur = head if n <= 1 else await self.store.get_request(attempt_id(cid, n))
        if cur is None or cur.get("state") not in TERMINAL:
            raise ApiError("duplicate_request", f"request {public_id(cid)!r} is still running")
        if not invites_retry(cur):
            M.REQUEST_ID_REUSED.labels(result="replay").inc()
            raise StoredOutcome(cur.get("outcome") or {"state": cur.get("state")})
        rid = attempt_id(cid, n + 1)
        self._rekey(cid, rid)  # before the live-set entry exists: our own sweep must see it running
        req.request_id = rid
        dec = p.decode_worker
        keys = [self.keys.request(cid), self.keys.request(attempt_id(cid, n)), self.keys.request(rid)]
        args = [n, cur["state"], self.replica_id, *request_fields(self._record_fields(req, p))]
        cmds: list[list[Any]] = [
            ["SADD", self.keys.origin_requests(self.replica_id), rid],
            ["EVALSHA", self.store.sha("retry_request"), 3, *keys, *args],
        ]
        if dec:
            cap = int(float(self.fleet.snapshots.get(dec, {}).get("kv_total_tokens", 0) or 0))
            need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
            cmds.append(self.store.reserve_cmd(dec, rid, need, cap, *self.decode_hold_blocks(req, p)))
        res = await self._round_trip(cmds)
        held = int(res[2]) if dec else -1
        if int(res[1]) != 1:  # another retry of the id won: that attempt runs
            if held == 1:
                await self.store.release(dec, rid)
            await self.redis.srem(self.keys.origin_requests(self.replica_id), rid)
            raise ApiError("duplicate_request", f"request {public_id(cid)!r} is still running")
        M.REQUEST_ID_REUSED.labels(result="retry").inc()
        return held

    def _rekey(self, old: str, new: str) -> None:
        """The request now runs under attempt id `new` (was `old`): move what this replica keys by
        it (the pipeline's live task)."""

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

    async def _round_trip(
        self,
        cmds: list[list[Any]],
        req: GenRequest | None = None,
        on_last: Callable[[Any], None] | None = None,
    ) -> list[Any]:
        """One round trip; the scripts answered NOSCRIPT (Redis restarted and lost them) are loaded
        and rerun (`StateStore.execute_scripts`). Any other error reply is raised. `on_last`: the
        last command's reply as it arrives, even if this call is cancelled meanwhile.

        The request's first round trip carries its tenant's limit check when it has one: the
        commands then run inside the check's script, only if it passed (a pipeline cannot make
        its later commands depend on an earlier one), and a refusal raises 429 `rate_limited`."""
        if req is not None and req.limit is not None:
            check, req.limit = req.limit, None  # once per request: a second hand-off is the same request
            res = await check.run(_slot_member(req), cmds, on_last)
        else:
            res = await self.store.execute_scripts(cmds, on_last)
        for x in res:
            if isinstance(x, ResponseError):
                raise x
        return res

    async def _reserve_elsewhere(self, req: GenRequest, p: Progress, tries: int = 2) -> bool:
        """The chosen decode worker refused the reservation: the snapshot we ranked on was older
        than other replicas' reservations. Try the next best workers (up to `tries`, one round trip
        each) before answering 429; the simulator showed most such refusals fit elsewhere."""
        refused = {p.decode_worker}
        need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
        for _ in range(tries):
            views = [v for v in self.views("decode") if v.id not in refused]
            try:
                dq = self.decode_query(req, p, need)
                dec = self.runtime.decode_strategy.choose(dq, views, self.rng)
            except NoWorker:
                return False
            cap = int(float(self.fleet.snapshots.get(dec.worker_id, {}).get("kv_total_tokens", 0) or 0))
            M.DECODE_RESERVE_RETRIES.inc()
            if await self.store.reserve(
                dec.worker_id, req.request_id, need, cap, *self.decode_hold_blocks(req, p)
            ):
                p.decode_worker = dec.worker_id
                # The record names where the hold is (the reconciler and the reaper release it
                # from there); the first choice held nothing.
                await self.redis.hset(self.keys.request(req.request_id), "decode_worker", dec.worker_id)
                return True
            refused.add(dec.worker_id)
        return False


def _slot_member(req: GenRequest) -> str:
    """The request's member in its tenant's concurrency slots. A fresh id is a new UUID; a client's
    id is not unique per request: a duplicate sent while it runs (answered 409 after the limit
    passed) or a retry's attempt took the same member, so its end gave the running request's slot
    back, and the tenant could then run one more than its limit per duplicate. Suffixed with a
    per-request nonce, each holds and returns its own."""
    return req.request_id if req.fresh_id else f"{req.request_id}!{secrets.token_hex(4)}"
