"""The owner's side of the prefill path for one worker: consume the worker's hand-off queue,
commit each batch to the fenced ledger, dispatch it over gRPC, and return every result to its
origin's reply stream, settling and acknowledging as results arrive (settle on reply, DESIGN §7).

Here every request is its own batch (schedule mode `direct`); the batching work puts the
batcher's decisions between `_read` and `_dispatch` without changing either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from app import metrics as M
from app.cache.shared_spec import SpecOutbox
from app.cluster.leases import Lease
from app.cluster.loops import LoopHealth
from app.dispatch.adopt import OwnerAdopt
from app.dispatch.claim import OwnerClaims
from app.dispatch.intake import OwnerIntake
from app.dispatch.items import QueueItem, carried_keys, failure
from app.dispatch.ledger import OwnerLedger
from app.logging_setup import lifecycle_sampled
from app.protocol.codes import EngineStatus
from app.rpc.worker_client import WorkerClient, WorkerUnavailable
from app.scheduling.accounting import EngineTimeline
from app.scheduling.batcher import Batcher, BatcherConfig, Decision, Pending
from app.scheduling.commit import commit_step, committed_ms
from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, Formula, compile_formula
from app.state.connect import redis_client
from app.state.handoff import Handoff
from app.state.resp import RespConnection
from app.state.retry import TRANSIENT, TerminalWrites
from app.state.store import FencedOut, StateStore

log = logging.getLogger("flexlb.owner")


class OwnerDispatcher(OwnerClaims, OwnerAdopt, OwnerLedger, OwnerIntake):
    def __init__(
        self,
        wid: str,
        replica_id: str,
        lease: Lease,
        store: StateStore,
        client: WorkerClient,
        redis_url: str,
        *,
        epoch: Callable[[], str],
        config: Callable[[], BatcherConfig] | None = None,
        formula: Callable[[], Formula] | None = None,
        time_scale: Callable[[], float] = lambda: 1.0,
        on_worker_error: Callable[[str], None] | None = None,
        loops: LoopHealth | None = None,
        terminal: TerminalWrites | None = None,
        reclaim_idle_ms: int = 5000,
        reclaim_every_s: float = 2.0,
        share_speculative: bool = True,
        local_reply: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        self.wid = wid
        self.replica_id = replica_id
        self.lease = lease
        self.store = store
        self.handoff = Handoff(store)
        self.client = client
        self.epoch = epoch
        default = BatcherConfig()
        self.config = config or (lambda: default)
        self.formula = formula or (lambda: compile_formula(DEFAULT_PREFILL_FORMULA))
        self.time_scale = time_scale
        self.on_worker_error = on_worker_error
        self.loops = loops or LoopHealth()
        # `is None`, not `or`: an empty queue is falsy (it has a length), and `or` gave every owner
        # a private queue whenever the replica's was empty, i.e. always: its reply + settle
        # retries then escaped the replica's drain on stop, and a dispatcher dropped with its
        # lease left that queue's task to be garbage-collected pending ("Task was destroyed but
        # it is pending!", seen after a Redis restart in the soak).
        self.terminal = terminal if terminal is not None else TerminalWrites(self.loops)
        # Periodic re-claim (XAUTOCLAIM) of pending entries idle this long that no task of ours is
        # handling: a dispatch whose reply could not be written, a read that died mid-way.
        self.reclaim_idle_ms = reclaim_idle_ms
        self.reclaim_every_s = reclaim_every_s
        self._handling: set[str] = set()  # entry ids read and not yet answered by us
        # FLEXLB_SHARED_SPECULATIVE: each read hand-off's blocks, published for every replica.
        self.spec_out = SpecOutbox(enabled=share_speculative)
        # Set after the first claim: XAUTOCLAIM takes entries pending for *any* consumer, us
        # included, so reading new entries before it would hand the claim our own fresh entries
        # to "redispatch" (cancelling their running batch on the worker).
        self._claimed_once = asyncio.Event()
        self.reclaimed = 0
        # This replica's reply inbox (`ReplyRouter.deliver`): replies to requests it originated
        # skip the reply stream (see `_reply`).
        self.local_reply = local_reply
        self.local_taken = 0  # entries the origin in this process took in its hand-off (intake.py)
        # Blocking stream reads get their own connection (DESIGN §5): the lean one for the
        # hand-off reads (on every request's path, app/state/resp.py), redis-py for the rest and
        # for URLs the lean client does not speak.
        self._reader = redis_client(redis_url, socket_timeout=10.0)
        self._lean_reader = RespConnection.from_url(redis_url, timeout_s=10.0)
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        # request id → the previous owner's batch, for claimed entries we dispatch again; see
        # `_dispatch` on `duplicate`.
        self._redispatched: dict[str, str] = {}
        self.wake = asyncio.Event()  # new items, a finished batch, a config change
        self._cfg_seen: BatcherConfig | None = None
        self.batcher = Batcher(self._scaled_config(), self._predict)
        self.dispatched = 0
        self._batch_sizes: dict[str, int] = {}
        # Set by stop(): the loops end by themselves even when the cancel was swallowed (grpc.aio
        # turns a cancel inside a worker call into an RPC error, which the loops treat as a failure).
        self._stopping = False
        # Set by drain(): stop taking entries, flush what the batcher holds, let batches finish.
        self._draining = False
        self._finished_seen: dict[str, float] = {}  # batch id → wall ms its finished record first came in
        self._last_audit = 0.0
        self._marks: set[asyncio.Task[Any]] = set()  # off-path ledger re-anchors
        # Where each of our batches starts on the engine (wall ms), so the ledger's owed time
        # runs from the real start, not from the dispatch (DESIGN §7, store.commit_batch).
        self.timeline = EngineTimeline()

    def _scaled_config(self) -> BatcherConfig:
        cfg = self.config()
        self._cfg_seen = cfg
        return cfg.scaled(self.time_scale())

    def _predict(self, items: Any) -> float:
        """Batch time in wall ms (the batcher's clock): modelled ms × the worker's time scale."""
        return self.formula().predict_batch(items) * self.time_scale()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"owner-read:{self.wid}"),
            asyncio.create_task(self._decide_loop(), name=f"owner-batch:{self.wid}"),
            asyncio.create_task(self._claim_loop(), name=f"owner-claim:{self.wid}"),
        ]
        for t, kind in zip(self._tasks, ("owner_read", "owner_decide", "owner_claim"), strict=True):
            self.loops.watch(t, f"{kind}:{self.wid}")

    async def drain(self, deadline_s: float) -> bool:
        """Graceful hand-over before the lease is released: read no more entries, dispatch what
        the batcher holds without waiting for a window, and wait (bounded) for the batches in
        flight to be answered. Whatever is still pending at the deadline stays unacknowledged in
        the stream, so the next owner claims it (deliver / adopt / dispatch once). True when
        nothing was left behind."""
        self._draining = True
        self.wake.set()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if not self.batcher.pending and not self._inflight:
                return True
            self.wake.set()
            await asyncio.sleep(0.02)
        return False

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)  # never raises; a loop that died was reported by watch
        for kind in ("owner_read", "owner_decide", "owner_claim", "owner_dispatch"):
            self.loops.forget(f"{kind}:{self.wid}")
        for t in list(self._inflight):
            t.cancel()
        if self._spec_flush is not None:  # a hint's write (intake.py): nothing to finish
            self._spec_flush.cancel()
        # Closing connections: the lease moved on, there is no state left to protect here.
        with contextlib.suppress(*TRANSIENT):
            await self._reader.aclose()
        if self._lean_reader is not None:
            with contextlib.suppress(*TRANSIENT):
                await self._lean_reader.close()

    async def _decide_loop(self) -> None:
        name = f"owner_decide:{self.wid}"
        while not self._stopping:
            try:
                await self._decide_once()
                self.loops.ok(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # items stay in the batcher (or pending in the stream): retried
                await self.loops.failed(name, exc)

    async def _decide_once(self) -> None:
        """One turn of the batcher: answer what it refused, dispatch what it formed, or wait for
        the next wake (new items, a finished batch, a config change) or its timer."""
        if not self.lease.is_valid():  # a lapsed owner stops acting; entries stay pending
            await asyncio.sleep(0.1)
            return
        d = self.decide(time.time() * 1000)
        if d.failed:
            await self._take_refused([p.payload for p, _ in d.failed])  # type: ignore[misc]
        for p, code in d.failed:
            item: QueueItem = p.payload  # type: ignore[assignment]
            M.BATCH_FAILED.labels(code).inc()
            if code == "deadline_exceeded":
                M.ADMISSION_REJECTIONS.labels("deadline_passed_in_queue").inc()
            await self._reply(item, "", {"status": code, "error": f"refused by the batcher: {code}"})
        if d.items:
            M.BATCH_FLUSHES.labels(d.reason).inc()
            M.BATCH_SIZE.observe(len(d.items))
            now = time.time() * 1000
            for p in d.items:
                M.BATCH_WAIT.observe(max(0.0, now - p.arrival_ms) / 1000)
            t = asyncio.create_task(self._dispatch([p.payload for p in d.items], d.reason))  # type: ignore[misc]
            self._inflight.add(t)
            t.add_done_callback(self._batch_done)
            return
        timeout = None
        if d.wake_at_ms is not None:
            timeout = max(0.0, d.wake_at_ms - time.time() * 1000) / 1000
        self.wake.clear()
        # `asyncio.timeout`, not `wait_for`: on 3.11 `wait_for` runs the wait as a task of its own,
        # one more task hop between a hand-off's arrival and its dispatch (issue 20).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout if timeout is not None else 0.5):
                await self.wake.wait()

    def _batch_done(self, t: asyncio.Task[None]) -> None:
        self._inflight.discard(t)
        self.batch_finished(time.time() * 1000)

    # ---- the decisions, without I/O (the simulator makes the same: tests/test_live_sim_equivalence.py)
    def admit(self, item: QueueItem, now_ms: float) -> None:
        """A hand-off read from the queue (or claimed) joins the batcher, stamped with when the
        owner read it, its predicted ms in the batcher's (wall) clock and its TTFT deadline."""
        self.batcher.add(
            Pending(
                item.request_id,
                len(item.tokens),
                item.hit_tokens,
                now_ms,
                item.predicted_ms * self.time_scale(),
                item,
                deadline_ms=item.ttft_deadline_ms,
                drop_late=item.drop_late,
                priority=item.priority,
                tenant=item.tenant,
            )
        )
        self.wake.set()

    def decide(self, now_ms: float) -> Decision:
        """The batcher's decision at ``now_ms`` under the current knobs (a drain flushes without
        waiting); a released batch is counted in flight before this returns (`commit_step`)."""
        if self._draining:
            if self.batcher.config.wait_ms:
                self.batcher.config = dataclasses.replace(self.batcher.config, wait_ms=0.0)
        elif self.config() is not self._cfg_seen:
            self.batcher.config = self._scaled_config()
        return commit_step(self.batcher, now_ms)

    def batch_finished(self, now_ms: float) -> None:
        """A dispatched batch was answered (or failed): the worker has room for the next."""
        self.batcher.batch_finished(now_ms)
        self.wake.set()

    async def _dispatch(self, items: list[QueueItem], reason: str = "direct") -> None:
        """Commit and send one batch under our view of the worker's epoch (its poller's). A batch
        the worker refused `epoch_mismatch` before its engine saw it — it restarted and the view
        still has the old epoch: a dispatch that raced the restart, or an adopted request's re-run
        (adopt.py) — is committed and sent once more, under a new batch id and the epoch the
        refusal named, instead of failing its requests: nothing of it ran, so that is its first
        run on that epoch. Counted `flexlb_dispatch_epoch_retries_total`."""
        # A re-admitted member's hand-off was taken off queued_ms by its first commit already.
        fresh = [i for i in items if not i.queued_taken]
        again = await self._send(items, reason, self.epoch(), committed_ms(fresh))
        if again is not None:
            live, epoch = again
            M.DISPATCH_EPOCH_RETRIES.inc()
            log.warning(
                "owner %s: worker epoch is now %s: batch of %d sent again", self.wid, epoch, len(live)
            )
            # The first commit took the members' predicted ms off queued_ms already.
            await self._send(live, reason, epoch, 0.0, retry=False)

    async def _send(
        self, items: list[QueueItem], reason: str, epoch: str, take_ms: float, retry: bool = True
    ) -> tuple[list[QueueItem], str] | None:
        """One commit and prefill call; returns (live members, the worker's epoch) when the worker
        refused the whole batch `epoch_mismatch` before accepting it and `retry` allows one more."""
        batch_id = f"b-{uuid.uuid4().hex[:16]}"
        # The ledger owes the batch's own prediction: one forward pass pays the per-batch cost
        # once, where the sum of the members' single predictions would count it n times.
        predicted = self.formula().predict_batch(
            [Pending(i.request_id, len(i.tokens), i.hit_tokens, 0.0).item for i in items]
        )
        by_id = {i.request_id: i for i in items}
        self._batch_sizes[batch_id] = len(items)
        # Anchored where the engine will start it: behind our batches still on the worker.
        start_ms = self.timeline.commit(batch_id, time.time() * 1000, predicted * self.time_scale())
        # The members' `dispatched` marks (informational: GET /v1/requests shows the worker and
        # batch; the terminal transition carries the same fields) ride in the commit's round trip
        # instead of one of their own (issue 20). A pipeline cannot make them depend on the
        # commit: a member the commit drops (tombstoned: its origin is ending it) or a fenced-out
        # commit (the new owner dispatches it, under its own batch id) may show `dispatched` for
        # this batch until the request's terminal state, which names the batch that ran.
        marks = [
            self.store.transition_cmd(rid, "dispatched", {"prefill_worker": self.wid, "batch_id": batch_id})
            for rid in by_id
        ]
        try:
            kept = await self.store.commit_batch(
                self.wid,
                batch_id,
                list(by_id),
                predicted,
                start_ms,
                self.lease.fence,
                self.replica_id,
                epoch=epoch,
                take_ms=take_ms,
                then=marks,
            )
        except FencedOut:
            self.timeline.forget(batch_id)
            self._batch_sizes.pop(batch_id, None)
            log.warning("owner %s fenced out; leaving %d entries for the new owner", self.wid, len(items))
            return None
        except TRANSIENT as exc:
            # Committed or not, nothing was sent to the worker: the entries stay pending and the
            # periodic re-claim takes them up again (a committed batch the worker never saw is
            # settled and its members dispatched once, as for a dead owner's).
            self.loops.record(f"owner_dispatch:{self.wid}", exc)
            self._batch_sizes.pop(batch_id, None)  # not ours to send: the audit may settle it
            for i in items:
                self._handling.discard(i.entry_id)
            return None
        self.loops.ok(f"owner_dispatch:{self.wid}")
        for rid in set(by_id) - set(kept):  # cancelled while queued: tombstoned before the commit
            await self._reply(
                by_id[rid], batch_id, {"status": "cancelled", "error": "cancelled while queued"}
            )
        live = [by_id[r] for r in kept]
        if not live:
            # Every member cancelled while queued: nothing is sent, so the `finally` below that
            # forgets the batch's size never runs. Kept, the entry stayed for the owner's life
            # (0.5-1.2 per 1,000 requests with 2 % cancels, bench/leak_probe.py).
            self.timeline.forget(batch_id)
            self._batch_sizes.pop(batch_id, None)
            return None
        self.dispatched += 1
        for i in live:
            if not lifecycle_sampled(i.request_id):  # the terminal line is the origin's
                continue
            log.info(
                "request %s dispatched",
                i.request_id,
                extra={
                    "event": "dispatched",
                    "request_id": i.request_id,
                    "trace_id": i.trace_id,
                    "prefill_worker": self.wid,
                    "batch_id": batch_id,
                    "batch_size": len(live),
                    "reason": reason,
                },
            )
        deadline = max((i.deadline_ms for i in live), default=0.0)
        timeout = max(1.0, (deadline - time.time() * 1000) / 1000) if deadline else None
        answered: set[str] = set()
        accepted = False
        again = ""  # the worker's epoch, when it refused the batch for ours and we send it again
        now = time.time()
        for i in live:
            if i.t_handoff:
                M.HANDOFF_LATENCY.observe(max(0.0, now - i.t_handoff))
                M.SAMPLES["handoff_latency_s"].add(max(0.0, now - i.t_handoff))
        M.observe_dispatch((len(i.tokens), i.hit_tokens) for i in live)
        batch_pred_ms = predicted
        try:
            async for ev in self.client.prefill(
                batch_id,
                epoch,
                [(i.request_id, i.tokens) for i in live],
                timeout=timeout,
                sampling=[i.sampling for i in live],
                keys=carried_keys(live),
            ):
                if ev.event == "accepted":
                    accepted = True
                    self._spawn_reanchor(
                        self.timeline.accepted(batch_id, ev.queue_position, time.time() * 1000)
                    )
                elif ev.event == "results":
                    M.observe_batch_results(batch_pred_ms, ev.results)
                    for r in ev.results:
                        item = by_id.get(r["request_id"])
                        if item is None:
                            continue
                        answered.add(item.request_id)
                        old = self._redispatched.pop(item.request_id, None)
                        if old is not None and r.get("status") == EngineStatus.DUPLICATE:
                            # The previous owner's batch was still on its way when we looked and
                            # has reached the worker since: follow it rather than answer the
                            # client "duplicate" (nothing of ours runs for this request).
                            await self.store.settle(self.wid, batch_id, item.request_id)
                            t = asyncio.create_task(self._adopt(item, old, ev.epoch))
                            self._inflight.add(t)
                            t.add_done_callback(self._inflight.discard)
                            M.CLAIMED.labels("adopted").inc()
                            continue
                        await self._reply(item, batch_id, {**r, "epoch": ev.epoch, "worker": self.wid})
                elif ev.event == "error":
                    code = "epoch_mismatch" if ev.error.startswith("epoch_mismatch") else "worker_error"
                    fresh = ev.epoch not in ("", epoch)  # the worker's epoch is not the one we sent
                    if retry and code == "epoch_mismatch" and fresh and not (accepted or answered):
                        again = ev.epoch  # refused before its engine saw it: send it again
                        answered.update(i.request_id for i in live)
                        continue
                    for item in live:
                        if item.request_id not in answered:
                            answered.add(item.request_id)
                            await self._reply(item, batch_id, failure(code, ev.error, accepted))
        except asyncio.CancelledError:
            # Lease lost or replica stopping: the entries stay pending for the next owner, who
            # delivers, adopts or dispatches them once. Answering here would end requests that
            # are still running fine on the worker.
            answered.update(i.request_id for i in live)
            raise
        except (WorkerUnavailable, TimeoutError) as exc:
            if self._stopping or not self.lease.is_valid():
                # Our own cancel that grpc.aio turned into an RPC error, or we are a stale owner
                # (paused past the lease): as above, the entries stay pending for the new owner,
                # who adopts or dispatches them — a stale failure must not end a running request.
                answered.update(i.request_id for i in live)
                return None
            if self.on_worker_error is not None:
                self.on_worker_error(self.wid)
            for item in live:
                if item.request_id not in answered:
                    answered.add(item.request_id)
                    await self._reply(item, batch_id, failure("worker_error", str(exc)[:300], accepted))
        finally:
            if not self.lease.is_valid():  # stale: the new owner answers what is left
                answered.update(i.request_id for i in live)
            for item in live:
                if item.request_id not in answered:  # _reply never raises: it queues on failure
                    await self._reply(item, batch_id, failure("worker_error", "no result", accepted))
            self._batch_sizes.pop(batch_id, None)
            self._spawn_reanchor(self.timeline.finish(batch_id, time.time() * 1000))
        if not again or not self.lease.is_valid():
            return None  # (a stale owner's refused batch: the new owner dispatches its members)
        try:  # it never ran: its owed time goes now, not at the old epoch's sweep or the audit's TTL
            await self.store.settle_batch(self.wid, batch_id)
        except TRANSIENT as exc:  # the audit or the sweep settles it later; the retry goes on
            log.warning("owner %s: settling refused batch %s failed: %s", self.wid, batch_id, exc)
        return live, again

    async def _reply(self, item: QueueItem, batch_id: str, result: dict[str, Any]) -> None:
        # Answered (whatever the path: a result, a dropped commit, a refusal, a failure): no
        # `duplicate` of it is left to follow, so its entry leaves the map (it grew for good).
        self._redispatched.pop(item.request_id, None)
        fields = {
            "rid": item.request_id,
            "batch_id": batch_id,
            "batch_size": str(self._batch_sizes.get(batch_id, 1)),
            "worker": self.wid,
            "att": str(item.attempt),
            **{k: str(v) for k, v in result.items() if k not in ("request_id",)},
        }

        local = self.local_reply if item.origin == self.replica_id else None

        async def write() -> None:
            if local is None:
                await self.handoff.reply_and_settle(
                    item.origin, fields, self.wid, batch_id, item.request_id, item.entry_id
                )
            else:
                # The origin is this process (issue 20): only the settlement goes to Redis, and
                # the reply goes to the waiting request in process once Redis took it — never
                # earlier than the stream's reply would have (one XADD and the origin's XREAD
                # less; a Redis that refuses it holds the reply back exactly as before).
                await self.handoff.settle_ack(self.wid, batch_id, item.request_id, item.entry_id)
                local(fields)
                M.HANDOFF_IN_PROCESS.labels("reply").inc()
            self._handling.discard(item.entry_id)

        # A reply that Redis did not take is retried from the bounded local queue (issue 14):
        # the origin is waiting for it, and the entry stays pending (and ours) until it is written.
        try:
            await self.terminal.run_or_queue(f"reply {item.request_id}", write)
        except RedisError as exc:  # not transient (a script error): never retried as it is
            self.loops.record(f"owner_dispatch:{self.wid}", exc)
            self._handling.discard(item.entry_id)  # the periodic re-claim answers it again
