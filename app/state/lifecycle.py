"""A request's lifecycle record and its attempts: the scripts that create, advance and re-open it,
and the ids every request-keyed state uses.

**Attempts.** A client may give its own request id. A retry of an id whose request ended keeps
answering the stored outcome — unless that outcome invited the retry: a failure the gateway
itself marked `retryable` (502, 503, 504, 500, `owner_lost`), a timeout, or a cancel (the client
disconnected or called DELETE). Then the retry is a new *attempt* that runs for real. Proxies
that keep `x-request-id` across their own retries (Envoy does) would otherwise get the failure
replayed for the record's whole TTL.

Attempt 1 runs under the client's id itself (nothing changes for the common case); attempt n ≥ 2
under `<client id>#<n>` (`#` is never in a client id, `REQUEST_ID` in app/security/limits.py).
Every request-keyed state — the decode hold, the hand-off entry, the ledger member, the reply,
the tombstone, the worker's own request id and its cancel memory, the origin's live set — is
keyed by that *attempt id*, so a failed attempt's leftovers (a hold whose release is queued, a
worker's memory of a cancel, a late reply) can neither collide with the new attempt nor be
released by it: they are settled under their own id by the paths that settle them today.

The record of attempt 1 is the *head*: `attempt` = the current attempt's number (absent = 1).
Attempt n's record sits under the same hash tag (`Keys.request`), so `RETRY_REQUEST` re-opens
atomically in one slot: it checks that the head still names the attempt the caller read and
that this attempt is still in the terminal state the caller judged retryable, bumps the head,
and creates the new record. Two concurrent retries: one wins, the other reads a running attempt
and answers 409 `duplicate_request`. The head loses its TTL while a later attempt runs and gets
it back with that attempt's terminal transition, so the head never expires under a live attempt
and both expire together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.state.lua_clock import NOW_MS

if TYPE_CHECKING:
    from app.state.store import StateStore

#: Between a client id and its attempt number in an attempt id (never in a client id).
ATTEMPT_SEP = "#"

#: Terminal states: exactly one of them is reached, once; nothing leaves it (the reducer, TRANSITION).
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled", "timed_out", "owner_lost"})


def attempt_id(client_id: str, n: int) -> str:
    """The id attempt `n` of `client_id` runs under: the client id itself for the first."""
    return client_id if n <= 1 else f"{client_id}{ATTEMPT_SEP}{n}"


def client_id(rid: str) -> str:
    """The client's (tenant-scoped) id of an attempt id."""
    return rid.split(ATTEMPT_SEP, 1)[0]


def attempt_of(rid: str) -> int:
    """The attempt number of an attempt id (1 for a client id)."""
    _, sep, n = rid.partition(ATTEMPT_SEP)
    return int(n) if sep else 1


def invites_retry(rec: dict[str, Any]) -> bool:
    """Whether a retry of this ended record starts a new attempt instead of replaying it: the
    client went away (`cancelled`: a disconnect or a DELETE, which no client reads as a final
    answer), it timed out or lost its origin (504, 503: retryable by kind), or its stored error
    says `retryable` (the gateway told the client to try again, so replaying it for an hour would
    be a lie). A completion or a non-retryable error (`failed`, 4xx) replays."""
    state = rec.get("state")
    if state not in TERMINAL or state == "completed":
        return False
    if state in ("cancelled", "timed_out", "owner_lost"):  # 499, 504, 503: whatever the error says
        return True  # (records older than typed errors carry it as a plain string)
    outcome = rec.get("outcome")
    err = outcome.get("error") if isinstance(outcome, dict) else None
    return isinstance(err, dict) and err.get("retryable") is True


async def current_attempt(store: StateStore, cid: str) -> tuple[str, dict[str, Any] | None]:
    """(the attempt id, its record) of the client id's current attempt; (cid, None) when unknown.
    One read, two when a retry re-opened it."""
    head = await store.get_request(cid)
    if head is None:
        return cid, None
    n = int(head.get("attempt") or 1)
    if n <= 1:
        return cid, head
    rid = attempt_id(cid, n)
    return rid, await store.get_request(rid)


# KEYS[1] request HASH; ARGV: origin, k1, v1, ... → 1 created, 0 exists.
CREATE_REQUEST = (
    NOW_MS
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'origin', ARGV[1])
redis.call('HSET', KEYS[1], 'created_ms', now_str, 'updated_ms', now_str)
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
)

# KEYS[1] the head (attempt 1's record), KEYS[2] the current attempt's record (= KEYS[1] for
# attempt 1), KEYS[3] the new attempt's record; ARGV: current attempt n, the terminal state the
# caller read on KEYS[2] (and judged retryable), origin, k1, v1, ... → 1 created, 0 refused.
# Refused, changing nothing, for a state that is not an ended failure (a running or completed
# attempt never re-opens, whatever the caller says), when another retry already moved the head
# on, when KEYS[2] is no longer in that state (`owner_lost` → `completed`: the stalled origin
# answered after all), or when the new record exists. A terminal outcome never changes
# otherwise, so the caller's judgement still holds when the script applies. Idempotent: a repeat
# finds the head moved on.
RETRY_REQUEST = (
    NOW_MS
    + """
local ended = {failed = 1, cancelled = 1, timed_out = 1, owner_lost = 1}
if not ended[ARGV[2]] then return 0 end
local n = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '1')
if n ~= tonumber(ARGV[1]) then return 0 end
if redis.call('HGET', KEYS[2], 'state') ~= ARGV[2] then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local nxt = string.format('%d', n + 1)
redis.call('HSET', KEYS[1], 'attempt', nxt)
redis.call('PERSIST', KEYS[1])
redis.call('HSET', KEYS[3], 'state', 'queued', 'origin', ARGV[3], 'attempt', nxt)
redis.call('HSET', KEYS[3], 'created_ms', now_str, 'updated_ms', now_str)
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
return 1
"""
)

# KEYS[1] request HASH, KEYS[2] (attempts ≥ 2 only) the head; ARGV: to_state, to_rank,
# terminal(0|1), ttl_s, outcome_json, k1, v1, ... → 1 applied, 0 refused (missing, already
# terminal, or not forward).
# Ranks: queued 0, dispatched 1, prefilled 2, decoding 3; a terminal state has no rank here, so
# nothing leaves it. The caller passes terminal states with rank 100: any non-terminal state may
# end, once. The outcome JSON is built by the caller and stored verbatim (no cjson round trip,
# which would turn `[]` into `{}` and round floats).
# One exception to "nothing leaves a terminal state": `owner_lost` is the master's presumption
# about an origin it stopped hearing from. An origin that was only stalled (SIGSTOP, a long pause)
# and then completed the request for its client replaces it with `completed` — the client got its
# answer, so the record must say so (issue 14). Nothing else leaves `owner_lost`.
# Expiry: the record expires `ttl_s` after its terminal transition; the head only with the
# attempt it names as current (a late end of an earlier attempt must not expire the head under
# a running one; module docstring).
TRANSITION = (
    NOW_MS
    + """
local ranks = {queued = 0, dispatched = 1, prefilled = 2, decoding = 3, owner_lost = -1}
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return 0 end
if cur == 'owner_lost' and ARGV[1] ~= 'completed' then return 0 end
local cur_rank = ranks[cur]
if cur_rank == nil then return 0 end
if tonumber(ARGV[2]) <= cur_rank then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_ms', now_str)
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[1], 'outcome', ARGV[5], 'ended_ms', now_str)
  local ttl = tonumber(ARGV[4])
  local mine = redis.call('HGET', KEYS[1], 'attempt') or '1'
  if KEYS[2] then
    redis.call('EXPIRE', KEYS[1], ttl)
    if (redis.call('HGET', KEYS[2], 'attempt') or '1') == mine then redis.call('EXPIRE', KEYS[2], ttl) end
  elseif mine == '1' then
    redis.call('EXPIRE', KEYS[1], ttl)
  end
end
return 1
"""
)
