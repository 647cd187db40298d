"""The Redis key layout: every key FlexLB writes, in one place (docs/state.md describes each).

Per-worker keys carry the hash tag `{w:<id>}` and per-replica keys `{r:<id>}`, so every atomic
operation (a Lua script) touches one slot and the state can move to Redis Cluster unchanged.
Request lifecycle keys are tagged by request id. Worker ids are `role@host:port`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "flexlb"

    # ---- cluster-wide --------------------------------------------------------------------
    @property
    def cluster_epoch(self) -> str:
        """Random id written once; missing or changed → Redis came back empty: rebuild."""
        return f"{self.prefix}:cluster_epoch"

    @property
    def members(self) -> str:
        """ZSET replica id → heartbeat expiry (ms since epoch); the master reaps expired ones."""
        return f"{self.prefix}:members"

    @property
    def master_lease(self) -> str:
        """STRING `replica_id|fence`, SET NX PX; renewed by compare-and-extend."""
        return f"{self.prefix}:lease:master"

    @property
    def fence_counter(self) -> str:
        """INCR counter handing out fencing epochs for every lease."""
        return f"{self.prefix}:lease:fence"

    @property
    def replicas_seen(self) -> str:
        """SET of every replica id that ever started: the reconciler finds dead replicas' leftovers
        (reply stream, live set, queue-group consumers) through it without a keyspace SCAN."""
        return f"{self.prefix}:replicas"

    @property
    def workers(self) -> str:
        """SET of registered worker ids."""
        return f"{self.prefix}:workers"

    @property
    def config(self) -> str:
        """HASH of runtime config (strategies, formula, batcher knobs) + `version`."""
        return f"{self.prefix}:config"

    # ---- per worker ------------------------------------------------------------------------
    def w(self, worker_id: str, what: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:{what}"

    def worker_info(self, wid: str) -> str:
        """HASH address, role, state (active|draining|removed), added_ms."""
        return self.w(wid, "info")

    def owner_lease(self, wid: str) -> str:
        """STRING `replica_id|fence`, PX lease TTL."""
        return self.w(wid, "owner")

    def snapshot(self, wid: str) -> str:
        """HASH the owner's latest view: epoch, seq, health, kv, queue, owed ms (only-newer-wins)."""
        return self.w(wid, "snap")

    def cache_stream(self, wid: str) -> str:
        """STREAM of cache diffs: fields epoch, version, prev, full, add, rem (packed uint64 LE)."""
        return self.w(wid, "cache")

    def spec_stream(self, wid: str) -> str:
        """STREAM of speculative entries the owner read: fields o (origin), t (ms), keys (uint64 LE)."""
        return self.w(wid, "spec")

    def cache_snapshot(self, wid: str) -> str:
        """HASH epoch, version, keys (packed uint64 LE), stream_id: a new mirror loads it first."""
        return self.w(wid, "cache_snap")

    def queue(self, wid: str) -> str:
        """STREAM prefill hand-off queue; consumer group `owner`; entries acked+deleted when settled."""
        return self.w(wid, "queue")

    def queued_ms(self, wid: str) -> str:
        """STRING float: predicted ms of what waits in the queue (incremented by the hand-off script)."""
        return self.w(wid, "queued_ms")

    def ledger(self, wid: str) -> str:
        """HASH batch id → JSON {predicted_ms, start_ms, fence, holder, epoch, members}: committed batches.

        Written only by the fenced commit script; settle scripts remove members (entry gone when empty).
        """
        return self.w(wid, "ledger")

    def tombstones(self, wid: str) -> str:
        """ZSET request/batch id → expiry ms: cancelled before dispatch; the commit script drops them.

        Fully settled batch ids are tombstoned too, so a late duplicate commit is dropped.
        Scores use the server clock (`TIME`); the scripts purge expired entries.
        """
        return self.w(wid, "tomb")

    def reservations(self, wid: str) -> str:
        """HASH request id → reserved decode KV tokens; field `_total` keeps the sum."""
        return self.w(wid, "resv")

    def reservation_blocks(self, wid: str) -> str:
        """HASH block id → how many decode holds on `wid` name it; `@<request id>` → that hold's
        "block_size id id ..." (the `reserve` / `release` scripts: a shared prompt block is held once)."""
        return self.w(wid, "resvb")

    # ---- per replica -----------------------------------------------------------------------
    def r(self, replica_id: str, what: str) -> str:
        return f"{self.prefix}:{{r:{replica_id}}}:{what}"

    def member(self, rid: str) -> str:
        """HASH address, started_ms, version; PX member TTL (heartbeat renews)."""
        return self.r(rid, "member")

    def replies(self, rid: str) -> str:
        """STREAM prefill results for requests this replica originated."""
        return self.r(rid, "replies")

    def notify(self, rid: str) -> str:
        """Pub/sub channel: cancels and wake-ups addressed to this replica."""
        return self.r(rid, "notify")

    def origin_requests(self, rid: str) -> str:
        """SET of live request ids this replica originated (reaped when it dies)."""
        return self.r(rid, "live")

    def cancels(self, rid: str) -> str:
        """SET of request ids cancelled through another replica, for this origin to act on: the
        durable half of a cancel (the notify message is only the fast path, at most once)."""
        return self.r(rid, "cancels")

    # ---- per request -----------------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """HASH lifecycle: state, origin, prefill/decode worker, batch id, outcome JSON; TTL once terminal.

        Tagged by the client's id: attempt n ≥ 2 of a request (`<id>#<n>`, app/state/lifecycle.py)
        sits in its head's slot as `…:req#<n>`, so re-opening it is one atomic script."""
        head, sep, n = request_id.partition("#")
        return f"{self.prefix}:{{q:{head}}}:req{sep}{n}"
