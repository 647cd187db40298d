"""A fresh id's one round trip (DESIGN §3 steps 5-6, the origin's only serial one): the request
record, the decode KV reservation and the hand-off to the prefill worker's owner in one pipeline,
the fresh pick between two workers inside the hand-off script (`HANDOFF_PICK`), and the delivery
of what the script took for this replica's own owner."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.gateway.errors import ApiError
from app.request.context import LocalOwner, RequestContext
from app.request.routing_inputs import FreshPair
from app.request.types import GenRequest, Progress
from app.state.handoff import GROUP, OVER_BACKLOG, pack_tokens
from app.state.resp import stream_entries
from app.state.store import request_fields
from app.state.text import to_str as _s


@dataclass(frozen=True, slots=True)
class PairArgs:
    """The runner-up's side of a `HANDOFF_PICK`: its entry fields (JSON) and predicted ms."""

    pair: FreshPair
    meta_json: str
    predicted: float
    # the runner-up's own allowance (`admission.max_backlog_ms` with its own predicted prefill)
    max_backlog: float | None = None


@dataclass(frozen=True, slots=True)
class Picked:
    """`HANDOFF_PICK`'s answer: 0 the policy's pick, 1 the runner-up; each one's live (queued ms,
    owed ms) as the script read them (the winner's queued ms with this hand-off in it)."""

    index: int
    loads: tuple[tuple[float, float], tuple[float, float]]


class HandoffRoundTrip(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica: the
    commands of the record-and-hand-off round trip and what its reply says (`HandoffStage._prefill`
    drives it)."""

    async def _record_and_append(
        self,
        req: GenRequest,
        p: Progress,
        wid: str,
        meta: dict[str, Any],
        predicted: float,
        pair: PairArgs | None = None,
        packed_keys: bytes = b"",
        max_backlog: float | None = None,
    ) -> tuple[str | None, float, float, int, Picked | None]:
        """`_record` and the hand-off in ONE pipeline (DESIGN §3: the origin's only serial round
        trip), for ids the gateway generated. Returns (entry id or None when the queue is full,
        queued ms, owed ms, decode hold: 1 new / 0 refused / -1 no decode, and with ``pair`` what
        `HANDOFF_PICK` chose: the hand-off went to ``wid`` or to the pair's runner-up). With
        ``max_backlog`` (`Verdict.max_backlog_ms`) the script hands off only onto a worker whose
        live backlog is within it, else the entry id is `OVER_BACKLOG` (recorded and reserved, nothing
        queued) and queued / owed ms are the chosen worker's live backlog. The allowance is one
        more argument of the same EVALSHA: no extra command."""
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
            elif max_backlog is not None:
                cmd += ["", "", ""]
            if max_backlog is not None:
                cmd.append(repr(float(max_backlog)))
            cmds.append(cmd)
            metas = [meta_json]
        else:
            owners = [self._owner_here(wid), self._owner_here(pair.pair.alt.worker_id)]
            cmds.append(
                self._pick_command(
                    rid, wid, meta_json, predicted, ids, pair, packed_keys, owners, max_backlog
                )
            )
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
            picked = Picked(int(out[3]) - 1, ((loads[0], loads[1]), (loads[2], loads[3])))
        if entry == "-1":  # the queue was full: recorded (and reserved), nothing queued
            p.stage = "recorded"
            return None, queued, owed, held, picked
        if entry == OVER_BACKLOG:  # the worker's live backlog exceeded the allowance: nothing queued
            p.stage = "recorded"
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
        pair: PairArgs,
        packed_keys: bytes = b"",
        owners: list[tuple[LocalOwner, str] | None] | None = None,
        max_backlog: float | None = None,
    ) -> list[Any]:
        """The `HANDOFF_PICK` EVALSHA: ``wid`` (the policy's pick) against the pair's runner-up;
        with ``owners`` (ours of each, `_owner_here`) the winner's entries come back for ours;
        with ``max_backlog`` (ours) and the pair's own, only onto a worker within its allowance
        (`admission.pick_within`)."""
        alt = pair.pair.alt.worker_id
        (a0, aq, ao, ahw, ahc), (b0, bq, bo, bhw, bhc) = pair.pair.terms
        here = owners if owners is not None and any(owners) else None
        leases = [self.keys.owner_lease(wid), self.keys.owner_lease(alt)] if here else []
        tail: list[Any] = []
        if here:
            tail = [GROUP, *(x for o in here for x in ((o[0].replica_id, o[1]) if o else ("", "")))]
        if max_backlog is not None or pair.max_backlog is not None:
            tail = (tail or [""] * 5) + [_limit(max_backlog), _limit(pair.max_backlog)]
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

    def _take_pick(
        self, p: Progress, wid: str, predicted: float, args: PairArgs, picked: Picked
    ) -> tuple[str, float, int]:
        """What `HANDOFF_PICK` read and chose, taken in: both workers' live load on this origin's
        overlays, and the request's worker, prediction and hit from the winner's choice."""
        now = time.time()
        choice = args.pair.choice(picked.index)
        for c, (queued, owed) in zip((args.pair.first, args.pair.alt), picked.loads, strict=True):
            self.fleet.note_queued(c.worker_id, queued, now)  # ours: `_prefill` marks it after
            self.owed_overlay[c.worker_id] = (owed, now)
        if picked.index == 0:
            return wid, predicted, args.pair.first.hit_tokens
        p.prefill_worker = choice.worker_id
        return choice.worker_id, args.predicted, choice.hit_tokens


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


def _limit(x: float | None) -> str:
    """An allowance argument: exact (repr, the Lua number is the same double), '' for none."""
    return "" if x is None else repr(float(x))
