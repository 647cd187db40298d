"""`StateStore`: the typed, async API over the shared Redis state (DESIGN §5, §6; docs/state.md).

Each public method is ONE round trip: one EVALSHA of a script from `app.state.scripts`, or one
plain command. Then the per-request command budget (≤ 12 client-issued commands at batch size 1)
can be counted and kept. The store counts every command it issues in `commands_total`. An EVALSHA
counts as one. The rare SCRIPT LOAD after a NOSCRIPT reply (a restarted or flushed server)
counts too, because it is a real command.

Every write is idempotent or only-newer-wins. A retried, duplicated or stale call repeats work
and never corrupts state:

- reservations: keyed by request id, so reserving twice holds once and only the first release
  frees the tokens;
- prefill ledger: keyed by batch id and fenced by the owner lease, so a stale owner's commit
  raises `FencedOut`. Tombstoned ids never enter it. A fully settled batch id is tombstoned, so a
  late duplicate commit is dropped;
- snapshots: the seq grows within a worker epoch; an unseen epoch replaces the view;
- lifecycle: a forward-only reducer with exactly one terminal transition.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from app.state import scripts
from app.state.keys import Keys
from app.state.lifecycle import TERMINAL, client_id
from app.state.resp import OnReplies, RespConnection
from app.state.scripting import Execute, is_noscript, run_scripts
from app.state.text import to_str as _s

# ---- request lifecycle ------------------------------------------------------------------------
#: Non-terminal states in order; a transition must move strictly forward (skipping is allowed).
PROGRESS: tuple[str, ...] = ("queued", "dispatched", "prefilled", "decoding")
#: Terminal states (`TERMINAL`, app/state/lifecycle.py): exactly one is reached, once.
_TERMINAL_RANK = 100
_RANK: dict[str, int] = {s: i for i, s in enumerate(PROGRESS)} | {s: _TERMINAL_RANK for s in TERMINAL}

_REQUEST_RESERVED = frozenset(
    {"state", "origin", "created_ms", "updated_ms", "outcome", "ended_ms", "attempt"}
)
_SNAPSHOT_RESERVED = frozenset({"epoch", "seq", "_retired"})
_TOTAL_FIELD = "_total"


class FencedOut(Exception):
    """The caller no longer holds the owner lease it claims, so its write was refused.

    Stop acting as the owner. `current` is the lease value now stored: empty when no one holds it.
    """

    def __init__(self, wid: str, expected: str, current: str) -> None:
        super().__init__(f"fenced out of {wid}: expected lease {expected!r}, current {current!r}")
        self.wid = wid
        self.expected = expected
        self.current = current


def _field(v: Any) -> str | bytes:
    """Encode one hash value: strings and bytes as they are, numbers as text, anything else as JSON."""
    if isinstance(v, str | bytes):
        return v
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(v, separators=(",", ":"))


def _flatten(fields: Mapping[str, Any] | None, reserved: frozenset[str]) -> list[str | bytes]:
    out: list[str | bytes] = []
    for k, v in (fields or {}).items():
        if k in reserved:
            raise ValueError(f"field {k!r} is reserved")
        out += [k, _field(v)]
    return out


def request_fields(fields: Mapping[str, Any] | None) -> list[str | bytes]:
    """A request record's extra fields as flat HSET arguments, refusing the ones the lifecycle
    scripts own (state, origin, timestamps, outcome): for callers that build the create-request
    EVALSHA into their own round trip (the origin's record + hand-off pipeline)."""
    return _flatten(fields, _REQUEST_RESERVED)


class StateStore:
    """Async access to the shared state of one cluster (one key prefix).

    `redis` may decode responses or not; the store accepts both. Methods do not retry. A
    connection error surfaces to the caller, and the `fail_closed` policy (DESIGN §6) decides what
    happens next.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        lifecycle_ttl_s: int = 3600,
        settled_batch_ttl_ms: int = 600_000,
        retired_epochs: int = 8,
        fast: RespConnection | None = None,
    ) -> None:
        self.redis = redis
        # Scripts and pipelines of the request and owner paths go over this lean connection when
        # given (app/state/resp.py says why); blocking reads never do, they stay on `redis`.
        self.fast = fast
        self.keys = keys
        self.lifecycle_ttl_s = lifecycle_ttl_s
        # How long a settled batch id stays tombstoned, to drop a late duplicate commit.
        self.settled_batch_ttl_ms = settled_batch_ttl_ms
        # How many previous worker epochs a snapshot remembers, to refuse stragglers.
        self.retired_epochs = retired_epochs
        #: Client-issued Redis commands so far (exported as `flexlb_redis_commands_total`).
        self.commands_total = 0
        self._scripts = {name: redis.register_script(src) for name, src in scripts.ALL.items()}
        self._sources = {str(sc.sha): str(sc.script) for sc in self._scripts.values()}

    # ---- plumbing ---------------------------------------------------------------------------
    async def run_script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One EVALSHA of a registered script; after NOSCRIPT (the server restarted), SCRIPT LOAD and
        retry (`scripting.run_scripts`). An error reply is raised. The reload's two commands show up
        in `commands_total`."""
        cmd = ["EVALSHA", self._scripts[name].sha, len(keys), *keys, *args]
        (res,) = await self.execute_scripts([cmd])
        if isinstance(res, ResponseError):
            raise res
        return res

    async def execute_scripts(
        self, cmds: Sequence[Sequence[Any]], on_last: Callable[[Any], None] | None = None
    ) -> list[Any]:
        """`execute`, and the EVALSHA calls answered NOSCRIPT loaded and rerun once (just those:
        the other commands of the round trip are not repeated). Error replies stay in place.
        `on_last`: called with the last command's reply as it arrives (`hooked`)."""
        ex = self.execute if on_last is None or not cmds else self.hooked(cmds[-1], on_last)
        return await run_scripts(ex, cmds, self._sources)

    def hooked(self, target: Sequence[Any], on_reply: Callable[[Any], None]) -> Execute:
        """`execute` that hands `on_reply` the reply of the command `target` (the same object)
        the moment it arrives, whether or not the caller still waits: the hand-off's reply carries
        entries this replica's owner must take even when the request that sent it is cancelled
        meanwhile (app/state/resp.py). A NOSCRIPT reply is skipped: the rerun's reply comes in
        its turn. Over redis-py (no lean connection) it runs once the caller has the replies."""

        async def execute(batch: Sequence[Sequence[Any]]) -> list[Any]:
            at = next((i for i, c in enumerate(batch) if c is target), None)
            if at is None:
                return await self.execute(batch)

            def hook(replies: list[Any]) -> None:
                if not is_noscript(replies[at]):
                    on_reply(replies[at])

            return await self.execute(batch, hook)

        return execute

    async def execute(self, cmds: Sequence[Sequence[Any]], on_replies: OnReplies | None = None) -> list[Any]:
        """Raw commands in one round trip, replies in order; error replies are returned in place,
        not raised (the caller knows which ones it can retry). `on_replies`: see `hooked`."""
        self.commands_total += len(cmds)
        if self.fast is not None:
            return await self.fast.pipeline(cmds, on_replies)
        async with self.redis.pipeline(transaction=False) as pipe:
            for c in cmds:
                pipe.execute_command(*c)
            res = list(await pipe.execute(raise_on_error=False))
        if on_replies is not None:
            on_replies(res)
        return res

    def sha(self, name: str) -> str:
        return str(self._scripts[name].sha)

    async def load_scripts(self) -> None:
        """Optional warm-up: SCRIPT LOAD every script, so the first real call never pays a NOSCRIPT."""
        for s in self._scripts.values():
            self.commands_total += 1
            await self.redis.script_load(s.script)

    # ---- cluster epoch ----------------------------------------------------------------------
    async def ensure_cluster_epoch(self) -> tuple[str, bool]:
        """Return (epoch, created_now), creating a random epoch if the key is missing.

        A replica remembers the epoch it saw. If a later call returns a different epoch, or
        `created_now` is True after startup, Redis came back empty, and the replica rebuilds
        (consumer groups, leases, resync; DESIGN §6).
        """
        res = await self.run_script("ensure_cluster_epoch", [self.keys.cluster_epoch], [secrets.token_hex(8)])
        return _s(res[0]), int(res[1]) == 1

    # ---- decode reservations ----------------------------------------------------------------
    def reserve_cmd(
        self,
        wid: str,
        request_id: str,
        tokens: int,
        capacity_tokens: int,
        block_size: int = 0,
        blocks: Sequence[int] = (),
    ) -> list[Any]:
        """The `reserve` command for a pipeline (`reserve` below says what it does). With
        `block_size` and the prompt's full-block ids, a block another hold on `wid` names is not
        counted again: the decode engine holds a shared prompt block once."""
        if request_id == _TOTAL_FIELD:
            raise ValueError("request id '_total' is reserved")
        if tokens < 0 or tokens < block_size * len(blocks):
            raise ValueError("tokens must be ≥ 0 and cover the prompt's full blocks")
        extra: list[Any] = [int(block_size), *(str(b) for b in blocks)] if block_size > 0 and blocks else []
        return [
            "EVALSHA",
            self.sha("reserve"),
            2,
            self.keys.reservations(wid),
            self.keys.reservation_blocks(wid),
            request_id,
            int(tokens),
            int(capacity_tokens),
            *extra,
        ]

    def release_cmd(self, wid: str, request_id: str) -> list[Any]:
        """The `release` command for a pipeline."""
        return [
            "EVALSHA",
            self.sha("release"),
            2,
            self.keys.reservations(wid),
            self.keys.reservation_blocks(wid),
            request_id,
        ]

    async def reserve(
        self,
        wid: str,
        request_id: str,
        tokens: int,
        capacity_tokens: int,
        block_size: int = 0,
        blocks: Sequence[int] = (),
    ) -> bool:
        """Hold `tokens` of decode KV on `wid` for `request_id`, if the total stays ≤ `capacity_tokens`
        (a prompt block another hold on `wid` names counted once: `reserve_cmd`).

        The call is idempotent. If the request already holds a reservation, it returns True and
        keeps the original amount. A request id must not be reused after its release: a reserve
        after the release holds again.
        """
        cmd = self.reserve_cmd(wid, request_id, tokens, capacity_tokens, block_size, blocks)
        res = await self.run_script("reserve", cmd[3:5], cmd[5:])
        return int(res) in (1, 2)

    async def release(self, wid: str, request_id: str) -> bool:
        """Free the request's reservation. Only the first call returns True; later ones change nothing.

        A rollback of a failed hand-off is the same call.
        """
        cmd = self.release_cmd(wid, request_id)
        return int(await self.run_script("release", cmd[3:5], cmd[5:])) == 1

    async def reserved_total(self, wid: str) -> int:
        self.commands_total += 1
        v = await self.redis.hget(self.keys.reservations(wid), _TOTAL_FIELD)
        return int(v) if v is not None else 0

    # ---- prefill ledger ---------------------------------------------------------------------
    async def commit_batch(
        self,
        wid: str,
        batch_id: str,
        members: list[str],
        predicted_ms: float,
        start_ms: float,
        fence: int,
        lease_holder: str,
        *,
        epoch: str = "",
        take_ms: float = 0.0,
        then: Sequence[Sequence[Any]] = (),
    ) -> list[str]:
        """Record a dispatched batch in the worker's ledger and return the members that were kept.

        The script is fenced. The worker's owner lease must still read `f"{lease_holder}|{fence}"`,
        or it raises `FencedOut` and writes nothing. Members and batch ids in the tombstones ZSET
        (cancelled before dispatch, or a batch already settled) are dropped. The caller dispatches
        only the members returned, and none at all for an empty list. A batch id already in the
        ledger is not written again: the call returns its stored members. `start_ms` is the
        owner's anchor for when the worker starts the batch, in ms since the epoch. It may lie in
        the future for a batch queued behind others. `epoch` is the worker epoch the batch was
        sent to. `take_ms` (the batch's predicted ms) comes off the hand-off queue's queued-time
        counter in the same step, once: the entries have left the queue. `then`: informational
        commands sent after the commit in the same round trip (the owner's `dispatched` marks,
        issue 20), their replies ignored; they run whatever the commit answered.
        """
        expected = f"{lease_holder}|{fence}"
        if fence <= 0:
            # Fence 0 marks a lease acquisition still in progress (app/cluster/fenced_lease.py): nobody
            # acts under it. We refuse it here, without a round trip.
            raise FencedOut(wid, expected, "")
        uniq = list(dict.fromkeys(members))
        head = json.dumps(
            {
                "predicted_ms": float(predicted_ms),
                "start_ms": float(start_ms),
                "fence": int(fence),
                "holder": lease_holder,
                "epoch": epoch,
            },
            separators=(",", ":"),
        )[:-1]
        cmd = [
            "EVALSHA",
            self.sha("commit_batch"),
            4,
            self.keys.owner_lease(wid),
            self.keys.ledger(wid),
            self.keys.tombstones(wid),
            self.keys.queued_ms(wid),
            expected,
            batch_id,
            head,
            f"{float(take_ms):.6f}",
            *uniq,
        ]
        res, *_ = await self.execute_scripts([cmd, *then])
        if isinstance(res, ResponseError):
            raise res
        if int(res[0]) == -1:
            raise FencedOut(wid, expected, _s(res[1]))
        kept = json.loads(_s(res[1]))
        return list(kept) if isinstance(kept, list) else []  # cjson encodes an empty table as {}

    async def settle(self, wid: str, batch_id: str, request_id: str) -> bool:
        """Remove one member from a committed batch. Only the first call returns True.

        When the batch's last member is settled, the entry goes and its id is tombstoned.
        """
        res = await self.run_script(
            "settle",
            [self.keys.ledger(wid), self.keys.tombstones(wid)],
            [batch_id, request_id, self.settled_batch_ttl_ms],
        )
        return int(res) == 1

    async def anchor_batch(self, wid: str, batch_id: str, start_ms: float) -> bool:
        """Move a committed batch's `start_ms` to where the engine really started it (the owner
        learns it from the worker's `accepted` and from the end of the batch ahead). Only that
        field changes; a batch already settled is left alone and False comes back."""
        args = [batch_id, f"{float(start_ms):.3f}"]
        res = await self.run_script("anchor_batch", [self.keys.ledger(wid)], args)
        return int(res) == 1

    async def settle_batch(self, wid: str, batch_id: str) -> int:
        """Settle every remaining member of a batch at once and return how many there were.

        0 means the batch was not in the ledger.
        """
        res = await self.run_script(
            "settle_batch",
            [self.keys.ledger(wid), self.keys.tombstones(wid)],
            [batch_id, self.settled_batch_ttl_ms],
        )
        return int(res)

    async def read_ledger(self, wid: str) -> dict[str, dict[str, Any]]:
        """batch id → {members, predicted_ms, start_ms, fence, holder, epoch}."""
        self.commands_total += 1
        raw = await self.redis.hgetall(self.keys.ledger(wid))
        return {_s(k): json.loads(_s(v)) for k, v in raw.items()}

    async def tombstone(self, wid: str, some_id: str, ttl_ms: int) -> None:
        """Mark a request or batch id as dead on `wid` for `ttl_ms`, so the commit script drops it.

        An existing tombstone is only extended, never shortened. Expired tombstones are purged by
        this script and by the commit script, using the server's clock.
        """
        await self.run_script("tombstone", [self.keys.tombstones(wid)], [some_id, max(1, math.ceil(ttl_ms))])

    # ---- worker snapshot --------------------------------------------------------------------
    async def write_snapshot(self, wid: str, epoch: str, seq: int, fields: Mapping[str, Any]) -> bool:
        """Only-newer-wins write of the owner's view of a worker. Returns False when refused.

        Within an epoch, `seq` must grow. The fields are merged, so a partial update keeps the
        rest. An epoch never seen before always wins: the worker restarted. It replaces the whole
        view and retires the old epoch. A retired epoch never wins again, so a straggler from
        before the restart cannot overwrite the new view.
        """
        args: list[Any] = [epoch, int(seq), self.retired_epochs, *_flatten(fields, _SNAPSHOT_RESERVED)]
        return int(await self.run_script("write_snapshot", [self.keys.snapshot(wid)], args)) == 1

    async def update_snapshot_fields(self, wid: str, fields: Mapping[str, Any]) -> None:
        """Merge fields derived by the owner itself (e.g. `health`), with no epoch/seq check.

        Why: `write_snapshot` orders the worker's own reports by (epoch, seq). A fact the owner
        derives, such as "the worker is down because polls fail", carries no worker seq. Writing it
        through `write_snapshot` with a made-up epoch would retire the real epoch. One HSET.
        """
        args = _flatten(fields, _SNAPSHOT_RESERVED)
        if not args:
            return
        self.commands_total += 1
        await self.redis.hset(self.keys.snapshot(wid), mapping=dict(zip(args[::2], args[1::2], strict=True)))

    async def read_snapshot(self, wid: str) -> dict[str, str]:
        """The stored view as strings (epoch, seq, the written fields). Empty when none is stored."""
        self.commands_total += 1
        raw = await self.redis.hgetall(self.keys.snapshot(wid))
        out = {_s(k): _s(v) for k, v in raw.items()}
        out.pop("_retired", None)
        return out

    # ---- request lifecycle ------------------------------------------------------------------
    async def create_request(
        self, request_id: str, origin: str, fields: Mapping[str, Any] | None = None
    ) -> bool:
        """Create the lifecycle record in state `queued`. Returns False, changing nothing, if it exists."""
        args = [origin, *_flatten(fields, _REQUEST_RESERVED)]
        return int(await self.run_script("create_request", [self.keys.request(request_id)], args)) == 1

    async def transition(
        self,
        request_id: str,
        to_state: str,
        fields: Mapping[str, Any] | None = None,
        *,
        outcome: Mapping[str, Any] | None = None,
    ) -> bool:
        """Apply one step of the lifecycle reducer. Returns False, changing nothing, when refused.

        queued → dispatched → prefilled → decoding moves strictly forward, and skipping a state is
        allowed. Any non-terminal state may move to one terminal state (completed, failed,
        cancelled, timed_out, owner_lost). Of several concurrent terminal transitions, exactly
        one wins. On the terminal transition, `outcome` is stored as JSON with the state added,
        and the record expires after `lifecycle_ttl_s`.
        """
        cmd = self.transition_cmd(request_id, to_state, fields, outcome=outcome)
        n = int(cmd[2])  # EVALSHA <sha> <numkeys> <keys...> <args...>
        return int(await self.run_script("transition", cmd[3 : 3 + n], cmd[3 + n :])) == 1

    def transition_cmd(
        self,
        request_id: str,
        to_state: str,
        fields: Mapping[str, Any] | None = None,
        *,
        outcome: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """`transition` as a raw command for `execute`, so the origin's final clean-up (release,
        live-set removal, terminal state) is one round trip. The reply is 1 applied / 0 refused."""
        if to_state not in _RANK:
            raise ValueError(f"unknown lifecycle state {to_state!r}")
        terminal = to_state in TERMINAL
        outcome_json = json.dumps({"state": to_state, **(outcome or {})}, separators=(",", ":"))
        # A later attempt (app/state/lifecycle.py) names its head too: its end gives the head its TTL.
        head = client_id(request_id)
        keys = [self.keys.request(request_id)] + ([self.keys.request(head)] if head != request_id else [])
        return [
            "EVALSHA",
            self._scripts["transition"].sha,
            len(keys),
            *keys,
            to_state,
            _RANK[to_state],
            "1" if terminal else "0",
            int(self.lifecycle_ttl_s),
            outcome_json if terminal else "",
            *_flatten(fields, _REQUEST_RESERVED),
        ]

    async def get_request(self, request_id: str) -> dict[str, Any] | None:
        """The lifecycle record. Values are strings, except `outcome`, which is decoded from JSON."""
        self.commands_total += 1
        raw = await self.redis.hgetall(self.keys.request(request_id))
        if not raw:
            return None
        out: dict[str, Any] = {_s(k): _s(v) for k, v in raw.items()}
        if "outcome" in out:
            out["outcome"] = json.loads(out["outcome"])
        return out
