"""The origin's writes before prefill (DESIGN §3 steps 5-7): the request record, the decode
KV reservation and the hand-off to the prefill worker's owner, in one round trip where it can, and
the wait for the owner's reply."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from app import metrics as M
from app.gateway.errors import ApiError
from app.protocol.blocks import hit_blocks_cap, namespace_seed
from app.request.context import LocalOwner, RequestContext
from app.request.routing_inputs import FreshPair
from app.request.types import ENGINE_TO_API, TERMINAL, GenRequest, NotStarted, Progress, StoredOutcome
from app.scheduling.routing import (
    NoWorker,
)
from app.state.handoff import GROUP, pack_keys, pack_tokens
from app.state.resp import stream_entries
from app.state.store import request_fields
from app.state.text import to_str as _s


@dataclass(frozen=True, slots=True)
class _PairArgs:
    """The runner-up's side of a `HANDOFF_PICK`: its entry fields (JSON) and predicted ms."""

    pair: FreshPair
    meta_json: str
    predicted: float


@dataclass(frozen=True, slots=True)
class _Picked:
    """`HANDOFF_PICK`'s answer: 0 the policy's pick, 1 the runner-up; each one's live (queued ms,
    owed ms) as the script read them (the winner's queued ms with this hand-off in it)."""

    index: int
    loads: tuple[tuple[float, float], tuple[float, float]]


class HandoffStage(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica."""

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
            rec = await self.store.get_request(req.request_id)
            if rec is None or rec.get("origin") != self.replica_id:
                await self.redis.srem(self.keys.origin_requests(self.replica_id), req.request_id)
            if rec is not None and rec.get("state") in TERMINAL:
                raise StoredOutcome(rec.get("outcome") or {"state": rec.get("state")})
            raise ApiError("duplicate_request", f"request {req.request_id!r} is still running")
        p.stage = "recorded"
        self._log("queued", req, p)
        if dec:
            if held == 0 and not await self._reserve_elsewhere(req, p):
                raise ApiError("overloaded", f"decode worker {dec} has no KV left", retry_after_s=1)
            p.stage = "reserved"
            self.note_decode_hold(req, p)

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
        self,
        req: GenRequest,
        p: Progress,
        wid: str,
        meta: dict[str, Any],
        predicted: float,
        pair: _PairArgs | None = None,
        packed_keys: bytes = b"",
    ) -> tuple[str | None, float, float, int, _Picked | None]:
        """`_record` and the hand-off in ONE pipeline (DESIGN §3: the origin's only serial round
        trip), for ids the gateway generated. Returns (entry id or None when the queue is full,
        queued ms, owed ms, decode hold: 1 new / 0 refused / -1 no decode, and with ``pair`` what
        `HANDOFF_PICK` chose: the hand-off went to ``wid`` or to the pair's runner-up)."""
        rid = req.request_id
        p.prefill_worker = wid
        fields = self._record_fields(req, p)
        sha = self.store.sha
        dec = p.decode_worker
        need = len(req.input_ids) + self.out_est.reserve(req.max_new_tokens)
        cap = int(float(self.fleet.snapshots.get(dec, {}).get("kv_total_tokens", 0) or 0)) if dec else 0
        ids = p.packed or pack_tokens(req.input_ids)
        meta_json = json.dumps(meta, separators=(",", ":"))
        cmds: list[list[Any]] = [
            ["SADD", self.keys.origin_requests(self.replica_id), rid],
            [
                "EVALSHA",
                sha("create_request"),
                1,
                self.keys.request(rid),
                self.replica_id,
                *request_fields(fields),
            ],
        ]
        if dec:
            cmds.append(self.store.reserve_cmd(dec, rid, need, cap, *self.decode_hold_blocks(req, p)))
        if pair is None:
            cmd: list[Any] = [
                "EVALSHA",
                sha("handoff"),
                3,
                self.keys.queue(wid),
                self.keys.queued_ms(wid),
                self.keys.ledger(wid),
                self.settings.max_queue_len,
                f"{predicted:.6f}",
                meta_json,
                ids,
                f"{self._scale(wid):g}",
                packed_keys,
            ]
            owners = [self._owner_here(wid)]
            if owners[0] is not None:
                # We own the worker: the hand-off delivers the entry to our owner's consumer in
                # this round trip (scripts._OWN_READ), no hop through its blocked read.
                cmd[2] = 4
                cmd.insert(6, self.keys.owner_lease(wid))
                cmd += [GROUP, owners[0][0].replica_id, owners[0][1]]
            cmds.append(cmd)
            metas = [meta_json]
        else:
            owners = [self._owner_here(wid), self._owner_here(pair.pair.alt.worker_id)]
            cmds.append(self._pick_command(rid, wid, meta_json, predicted, ids, pair, packed_keys, owners))
            metas = [meta_json, pair.meta_json]
        take: Callable[[Any], None] | None = None
        if any(o is not None for o in owners):
            at = 3 if pair is None else 8  # where the script put what it took for our owner

            def take_here(out: Any) -> None:
                """Hand our owner the entries the hand-off took for it as the reply arrives,
                whatever becomes of this request meanwhile (cancelled, timed out, another reply
                of the round trip in error): other origins' are among them, and otherwise only
                the periodic re-claim (`reclaim_idle_ms` later) would find them. An answer lost
                with its connection leaves them to it, as a lost answer to the owner's read does."""
                if isinstance(out, list) and len(out) > at:
                    w = 0 if pair is None else int(out[3]) - 1
                    here = owners[w]
                    if here is not None:
                        _take_here(here[0], out, at, metas[w], ids, packed_keys)

            take = take_here

        # Whatever applied before a failure must be cleaned up as if handed off.
        p.stage = "handed_off"
        try:
            res = await self._round_trip(cmds, req, take)
        except ApiError:  # only the tenant's limit raises it, and then nothing was written
            p.stage = "new"
            raise
        out = res[-1]
        if int(res[1]) != 1:  # a fresh UUID already exists: not ours to touch, drop our hand-off
            await self.store.tombstone(wid, rid, 60_000)
            raise RuntimeError(f"generated request id {rid} collided")
        held = int(res[2]) if dec else -1
        entry, queued, owed = _s(out[0]), float(_s(out[1])), float(_s(out[2]))
        picked = None
        if pair is not None:
            loads = [float(_s(x)) for x in out[4:8]]
            picked = _Picked(int(out[3]) - 1, ((loads[0], loads[1]), (loads[2], loads[3])))
        if entry == "-1":  # the queue was full: recorded (and reserved), nothing queued
            p.stage = "recorded"
            return None, queued, owed, held, picked
        return entry, queued, owed, held, picked

    def _owner_here(self, wid: str) -> tuple[LocalOwner, str] | None:
        """This replica's owner of ``wid`` and the lease value it holds, when the hand-off may
        deliver to it (`OwnerIntake.local_lease`); None otherwise. The entries go to this same
        owner object afterwards: a successor that took the lease meanwhile claims them instead."""
        owner = self.local_owner(wid)
        lease = owner.local_lease() if owner is not None else None
        return (owner, lease) if owner is not None and lease is not None else None

    def _pick_command(
        self,
        rid: str,
        wid: str,
        meta_json: str,
        predicted: float,
        ids: bytes,
        pair: _PairArgs,
        packed_keys: bytes = b"",
        owners: list[tuple[LocalOwner, str] | None] | None = None,
    ) -> list[Any]:
        """The `HANDOFF_PICK` EVALSHA: ``wid`` (the policy's pick) against the pair's runner-up;
        with ``owners`` (ours of each, `_owner_here`) the winner's entries come back for ours."""
        alt = pair.pair.alt.worker_id
        (a0, aq, ao, ahw, ahc), (b0, bq, bo, bhw, bhc) = pair.pair.terms
        here = owners if owners is not None and any(owners) else None
        leases = [self.keys.owner_lease(wid), self.keys.owner_lease(alt)] if here else []
        tail: list[Any] = []
        if here:
            tail = [GROUP, *(x for o in here for x in ((o[0].replica_id, o[1]) if o else ("", "")))]
        return [
            "EVALSHA",
            self.store.sha("handoff_pick"),
            9 if here else 7,
            self.keys.queue(wid),
            self.keys.queued_ms(wid),
            self.keys.ledger(wid),
            self.keys.queue(alt),
            self.keys.queued_ms(alt),
            self.keys.ledger(alt),
            self.keys.request(rid),
            *leases,
            self.settings.max_queue_len,
            ids,
            meta_json,
            pair.meta_json,
            f"{predicted:.6f}",
            f"{pair.predicted:.6f}",
            f"{self._scale(wid):g}",
            f"{self._scale(alt):g}",
            *(repr(float(x)) for x in (a0, aq, ao, b0, bq, bo)),
            repr(float(pair.pair.sign)),
            repr(float(pair.pair.tie_pct)),
            repr(float(pair.pair.tie_abs)),
            pair.pair.winner + 1,
            alt,
            packed_keys,
            *(repr(float(x)) for x in (ahw, ahc, bhw, bhc)),
            *tail,
        ]

    def _queued_base(self, wid: str) -> float:
        """``wid``'s queued ms as this origin counts it: its overlay while newer than the snapshot."""
        ov = self.fleet.queued_overlay.get(wid)
        if ov is not None and ov[1] >= self.fleet.snapshot_time.get(wid, 0.0):
            return ov[0]
        return float(self.fleet.snapshots.get(wid, {}).get("queued_ms", 0.0) or 0.0)

    def _take_pick(
        self, p: Progress, wid: str, base: float, predicted: float, args: _PairArgs, picked: _Picked
    ) -> tuple[str, float, int]:
        """What `HANDOFF_PICK` read and chose, taken in: both workers' live load on this origin's
        overlays, and the request's worker, prediction and hit from the winner's choice."""
        now = time.time()
        choice = args.pair.choice(picked.index)
        for c, (queued, owed) in zip((args.pair.first, args.pair.alt), picked.loads, strict=True):
            self.fleet.queued_overlay[c.worker_id] = (queued, now)
            self.owed_overlay[c.worker_id] = (owed, now)
        if picked.index == 0:
            return wid, predicted, args.pair.first.hit_tokens
        M.FRESH_PICK_MOVED.inc()
        p.prefill_worker = choice.worker_id
        return choice.worker_id, args.predicted, choice.hit_tokens

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
            res = await check.run(req.request_id, cmds, on_last)
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
    ) -> dict[str, str]:
        """Hand the prompt to ``wid``'s owner and wait for its reply. With ``pair`` (a fresh id
        and FLEXLB_FRESH_PICK) the hand-off script chooses between ``wid`` and the pair's
        runner-up on both workers' live load, in the same round trip (`HANDOFF_PICK`)."""
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
        # Counted on our overlay before the round trip: requests routed meanwhile on this replica
        # (a burst) see it, rather than all ranking and admitting against the same queue.
        base = self._queued_base(wid)
        self.fleet.queued_overlay[wid] = (base + predicted, time.time())
        held = -1
        fresh = p.stage == "new"
        if fresh:  # a fresh id: record, reserve and hand off in one round trip
            args = None
            if pair is not None and pair.first.worker_id == wid:
                alt = pair.alt
                alt_pred = round(alt.predicted_ms, 3)
                alt_meta = self._meta(req, p, alt.worker_id, alt_pred, alt.hit_tokens, attempt)
                args = _PairArgs(pair, json.dumps(alt_meta, separators=(",", ":")), alt_pred)
            try:
                entry, queued, owed, held, picked = await self._record_and_append(
                    req, p, wid, meta, predicted, args, packed_keys
                )
            except ApiError:  # refused by the tenant's limit: nothing was queued
                self.replies.forget(rid)
                self.fleet.queued_overlay[wid] = (base, time.time())
                raise
            except BaseException:
                if args is not None:  # the script may have chosen the runner-up: it must not run
                    other = args.pair.alt.worker_id
                    await self.terminal.run_or_queue(
                        f"tombstone {rid}", lambda: self.store.tombstone(other, rid, 60_000)
                    )
                raise
            if picked is not None and args is not None:
                wid, predicted, hit_tokens = self._take_pick(p, wid, base, predicted, args, picked)
        else:
            entry, queued, owed = await self.handoff.append(
                wid,
                meta,
                p.packed or pack_tokens(req.input_ids),
                predicted,
                self.settings.max_queue_len,
                self._scale(wid),
                packed_keys,
            )
        self.owed_overlay[wid] = (owed, time.time())
        if entry is None:
            self.replies.forget(rid)
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
        if held >= 0:
            self.note_decode_hold(req, p)
        overhead = time.perf_counter() - p.t0
        M.ORIGIN_OVERHEAD.observe(overhead)
        M.SAMPLES["origin_overhead_s"].add(overhead)
        if fresh:  # logged after the clock stops: a log line is I/O, not scheduling
            self._log("queued", req, p)
        self.fleet.queued_overlay[wid] = (queued, time.time())
        n_cap = hit_blocks_cap(len(req.input_ids), bs)
        self.mirror.add_speculative(wid, keys[: max(n_cap, 0) + 1], time.time() * 1000)
        self.wake_owner(wid)
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
        ov = self.fleet.queued_overlay.get(wid)
        if ov is not None:
            self.fleet.queued_overlay[wid] = (max(0.0, ov[0] - predicted), ov[1])
        p.batch_id = reply.get("batch_id", "")
        p.batch_size = int(reply.get("batch_size", 1) or 1)
        p.cached_tokens = int(float(reply.get("cached_tokens", 0)))
        p.prefill_ms = float(reply.get("end_ms", 0)) - float(reply.get("start_ms", 0))
        p.queue_ms = max(0.0, (p.t_first - p.t_handoff) * 1000 - p.prefill_ms)
        self._log("prefilled", req, p)
        return reply


def _take_here(owner: LocalOwner, out: list[Any], at: int, meta_json: str, ids: bytes, keys: bytes) -> None:
    """Hand the entries the hand-off delivered to our ``owner`` (``out[at]``: 1 when ours was taken,
    ``out[at + 1]``: the ones before it, other origins') to it, in stream order. Ours is not sent
    back: its fields are what we sent."""
    taken = stream_entries([(b"", out[at + 1])])
    if int(out[at]) == 1:
        own = {b"m": meta_json.encode(), b"ids": ids}
        if keys:
            own[b"k"] = keys
        taken.append((out[0], own))
    if taken:
        owner.take_local(taken)
