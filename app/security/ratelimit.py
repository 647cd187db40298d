"""Cluster-wide per-tenant limits: token buckets in Redis, checked inside the request's first
round trip (issue 16).

Why on the server: every replica takes from the same buckets, so a tenant cannot get N× its rate
by spreading over N replicas, and the check-and-take is atomic. The clock is the server's
(`TIME`), so replicas with skewed clocks agree. The limit runs only for a tenant that has one:
unlimited tenants cost nothing.

Folded into the record round trip: the origin's first round trip (record + decode hold + hand-off
for a gateway id, `_record_and_append`; record + decode hold for a client id, `_record`) is
several commands in one pipeline, and a pipeline cannot make its later commands depend on an
earlier one. So for a limited tenant the round trip's commands run inside ONE script, `GATE`:
the bucket check first, then each command only when it passed. A refused request writes nothing
but its bucket's refill, and costs one command and no round trip of its own. The price: `GATE`
touches the keys of several hash tags (tenant, request, workers), so it needs one Redis primary
(embedded, standalone or Sentinel, every deployment FlexLB has); Redis Cluster would answer
CROSSSLOT. docs/state.md lists it.

Buckets: requests hold one second's worth (`rps`), refilled continuously; tokens hold one
minute's worth (`tpm`) and a request takes prompt + max output tokens up front (as OpenAI counts
`max_tokens` against the token limit at admission: the output is not known yet). Concurrency is a
sorted set of request ids scored by their deadline: the request leaves it when it ends, and a hold
whose origin died expires with the request's own deadline — it cannot leak.

A refused request takes nothing. The buckets' state is written even on refusal (refill folded
in), which is idempotent: the same state at the same instant.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError, ResponseError

from app.security.apikeys import Limits
from app.state import scripts
from app.state.scripting import Execute, run_scripts
from app.state.store import StateStore

log = logging.getLogger("flexlb.security")

# KEYS[1] bucket HASH {r, k, t}; KEYS[2] in-flight ZSET rid → hold-until ms.
# ARGV: rps, tpm, max_concurrent, cost tokens, request id, timeout ms, ended request ids...
# → {allowed 0|1, reason, retry_ms, remaining_requests, reset_requests_ms, remaining_tokens,
#    reset_tokens_ms, in_flight, next_request_ms (0: a request token is there now)}
# The ended ids (ARGV[7..]) are this replica's finished requests whose slots it has not given back
# yet: removed first, so a release rides on the next admission instead of costing a command.
LIMIT = """
for i = 7, #ARGV do redis.call('ZREM', KEYS[2], ARGV[i]) end
local __t = redis.call('TIME')
local now = tonumber(__t[1]) * 1000 + math.floor(tonumber(__t[2]) / 1000)
local rps, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local st = redis.call('HMGET', KEYS[1], 'r', 'k', 't')
local r, k = rps, tpm
if st[3] then
  local dt = math.max(0, now - tonumber(st[3]))
  if rps > 0 and st[1] then r = math.min(rps, tonumber(st[1]) + dt * rps / 1000) end
  if tpm > 0 and st[2] then k = math.min(tpm, tonumber(st[2]) + dt * tpm / 60000) end
end
local reason, wait = '', 0
if rps > 0 and r < 1 then
  reason = 'requests'
  wait = math.ceil((1 - r) * 1000 / rps)
end
if tpm > 0 then
  if cost > tpm then
    if reason == '' then reason = 'tokens_above_limit' end
    wait = math.max(wait, 60000)
  elseif k < cost then
    if reason == '' then reason = 'tokens' end
    wait = math.max(wait, math.ceil((cost - k) * 60000 / tpm))
  end
end
local inflight = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[2])
  if inflight >= maxc then
    if reason == '' then reason = 'concurrent' end
    wait = math.max(wait, 1000)
  end
end
local ok = 0
if reason == '' then
  ok = 1
  if rps > 0 then r = r - 1 end
  if tpm > 0 then k = k - cost end
  if maxc > 0 then
    local until_ms = now + tonumber(ARGV[6])
    redis.call('ZADD', KEYS[2], until_ms, ARGV[5])
    redis.call('PEXPIREAT', KEYS[2], until_ms + 1000)
    inflight = inflight + 1
  end
end
redis.call('HSET', KEYS[1], 'r', string.format('%.6f', r), 'k', string.format('%.3f', k), 't', now)
redis.call('PEXPIRE', KEYS[1], 120000)
local reset_r, reset_k = 0, 0
if rps > 0 then reset_r = math.ceil((rps - r) * 1000 / rps) end
if tpm > 0 then reset_k = math.ceil((tpm - k) * 60000 / tpm) end
local next_r = 0
if rps > 0 and r < 1 then next_r = math.ceil((1 - r) * 1000 / rps) end
return {ok, reason, wait, math.floor(r), reset_r, math.floor(k), reset_k, inflight, next_r}
"""


def _function(name: str, body: str) -> str:
    """A script as a Lua function of its own KEYS and ARGV (parameters shadow the globals), so
    `GATE` runs it unchanged on its slice of the gate's keys and arguments."""
    return f"local function {name}(KEYS, ARGV)\n{body}\nend\n"


#: The commands of the request's first round trip that `GATE` can carry, by script name.
_FOLDED = ("create_request", "reserve", "handoff", "handoff_pick")

# KEYS: the tenant's bucket and in-flight set (LIMIT's), then each carried command's keys in order.
# ARGV: n_limit (LIMIT's argument count), n_cmds, per command (name, n_keys, n_args), LIMIT's
# arguments, then each command's arguments in order.
# → {verdict} refused: nothing else ran | {verdict, reply 1, ..., reply n} admitted, where
# `verdict` is LIMIT's answer and each reply the command's own, as it would have been alone.
GATE = (
    _function("limit", LIMIT)
    + "".join(_function(n, scripts.ALL[n]) for n in _FOLDED)
    + """
local function sadd(KEYS, ARGV) return redis.call('SADD', KEYS[1], ARGV[1]) end
local run = {
  sadd = sadd, create_request = create_request, reserve = reserve, handoff = handoff,
  handoff_pick = handoff_pick,
}
local function slice(t, from, n)
  local out = {}
  for i = 1, n do out[i] = t[from + i - 1] end
  return out
end
local nl, nc = tonumber(ARGV[1]), tonumber(ARGV[2])
local a = 3 + 3 * nc
local verdict = limit(slice(KEYS, 1, 2), slice(ARGV, a, nl))
if verdict[1] ~= 1 then return {verdict} end
local out = {verdict}
local k, g = 3, a + nl
for i = 0, nc - 1 do
  local name, nk, na = ARGV[3 + 3 * i], tonumber(ARGV[4 + 3 * i]), tonumber(ARGV[5 + 3 * i])
  out[#out + 1] = run[name](slice(KEYS, k, nk), slice(ARGV, g, na))
  k, g = k + nk, g + na
end
return out
"""
)
GATE_SHA = hashlib.sha1(GATE.encode()).hexdigest()
_NAME_OF = {hashlib.sha1(scripts.ALL[n].encode()).hexdigest(): n for n in _FOLDED}


def fold(limit_keys: list[str], limit_args: list[Any], cmds: Sequence[Sequence[Any]]) -> list[Any]:
    """The EVALSHA of `GATE` that runs LIMIT and then, if it passed, `cmds` (plain `SADD key
    member` or EVALSHA of a `_FOLDED` script)."""
    keys, head, tail = list(limit_keys), [], []
    for c in cmds:
        if c[0] == "SADD" and len(c) == 3:
            name, ks, args = "sadd", [c[1]], [c[2]]
        elif c[0] == "EVALSHA" and c[1] in _NAME_OF:
            n = int(c[2])
            name, ks, args = _NAME_OF[c[1]], list(c[3 : 3 + n]), list(c[3 + n :])
        else:
            raise ValueError(f"cannot fold {c[0]} into the limit gate")
        head += [name, len(ks), len(args)]
        keys += ks
        tail += args
    return ["EVALSHA", GATE_SHA, len(keys), *keys, len(limit_args), len(cmds), *head, *limit_args, *tail]


def bucket_key(prefix: str, tenant: str) -> str:
    return f"{prefix}:{{t:{tenant}}}:rl"


def inflight_key(prefix: str, tenant: str) -> str:
    return f"{prefix}:{{t:{tenant}}}:inflight"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str
    retry_after_ms: int
    headers: list[tuple[bytes, bytes]]
    holds_slot: bool  # took a concurrency slot that must be given back when the request ends
    # ms until the bucket holds a whole request token again (0: it does now): no request of the
    # tenant can pass anywhere before, since replicas only take from the bucket
    next_request_ms: int = 0


def _duration(ms: int) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `250ms`."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    s = math.ceil(ms / 1000)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class Limiter:
    """Admission against a tenant's buckets, and the concurrency slots' return.

    A slot is given back lazily: `release()` only notes the request id; the tenant's next
    admission on this replica removes it in the same script (no command of its own), and a flush
    `RELEASE_DELAY_S` later removes what no admission took (one ZREM per tenant per interval:
    the few hundredths of a command per request a limited tenant costs beyond its gate, when
    its requests come spaced wider than the delay). The price: a finished request may count
    against its tenant for up to that delay.
    """

    RELEASE_DELAY_S = 0.1

    def __init__(self, store: StateStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self._ended: dict[str, list[str]] = {}  # tenant → finished request ids still holding slots
        self._flush: asyncio.Task[None] | None = None

    async def run(
        self,
        tenant: str,
        lim: Limits,
        rid: str,
        cost: int,
        timeout_ms: int,
        cmds: Sequence[Sequence[Any]] = (),
        on_last: Callable[[Any], None] | None = None,
    ) -> tuple[Verdict, list[Any]]:
        """The tenant's check and, when it passes, `cmds`, in one EVALSHA of `GATE` (counted in
        `flexlb_redis_commands_total`; after NOSCRIPT, a restarted Redis, loaded and run again).
        Returns the verdict and the commands' replies (empty when refused). `on_last`: the last
        command's reply as it arrives, when it ran (`StateStore.hooked`)."""
        keys = [bucket_key(self.prefix, tenant), inflight_key(self.prefix, tenant)]
        ended = self._ended.pop(tenant, [])
        args = [repr(float(lim.rps)), lim.tpm, lim.max_concurrent, cost, rid, timeout_ms, *ended]
        gate = fold(keys, args, cmds)
        ex: Execute = self.store.execute
        if on_last is not None and cmds:
            hook = on_last

            def last(res: Any) -> None:  # {verdict, reply, ...}: replies only when it passed
                if isinstance(res, list) and len(res) > len(cmds):
                    hook(res[-1])

            ex = self.store.hooked(gate, last)
        try:
            (res,) = await run_scripts(ex, [gate], {GATE_SHA: GATE})
            if isinstance(res, ResponseError):
                raise res
        except BaseException:
            self._ended.setdefault(tenant, []).extend(ended)  # maybe not applied: the flush retries
            raise
        v = res[0]
        ok, reason, wait = int(v[0]), _str(v[1]), int(v[2])
        rem_r, reset_r, rem_k, reset_k = int(v[3]), int(v[4]), int(v[5]), int(v[6])
        headers: list[tuple[bytes, bytes]] = []
        if lim.rps > 0:
            headers += [
                (b"x-ratelimit-limit-requests", _num(lim.rps)),
                (b"x-ratelimit-remaining-requests", str(max(rem_r, 0)).encode()),
                (b"x-ratelimit-reset-requests", _duration(reset_r).encode()),
            ]
        if lim.tpm > 0:
            headers += [
                (b"x-ratelimit-limit-tokens", str(lim.tpm).encode()),
                (b"x-ratelimit-remaining-tokens", str(max(rem_k, 0)).encode()),
                (b"x-ratelimit-reset-tokens", _duration(reset_k).encode()),
            ]
        next_ms = int(v[8]) if len(v) > 8 else 0
        verdict = Verdict(ok == 1, reason, wait, headers, ok == 1 and lim.max_concurrent > 0, next_ms)
        return verdict, list(res[1:])

    async def admit(self, tenant: str, lim: Limits, rid: str, cost: int, timeout_ms: int) -> Verdict:
        """The check alone (nothing folded)."""
        return (await self.run(tenant, lim, rid, cost, timeout_ms))[0]

    def release(self, tenant: str, rid: str) -> None:
        """The request ended: its slot goes back with the tenant's next admission or the flush."""
        self._ended.setdefault(tenant, []).append(rid)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.RELEASE_DELAY_S)
        try:
            await self.flush()
        except RedisError as exc:  # the holds expire at their requests' deadlines anyway
            log.warning("concurrency slots not released (%d tenants): %s", len(self._ended), exc)

    async def flush(self) -> None:
        """Give back every slot still noted, one ZREM per tenant in one round trip."""
        ended, self._ended = self._ended, {}
        if ended:
            cmds = [["ZREM", inflight_key(self.prefix, t), *rids] for t, rids in ended.items()]
            await self.store.execute(cmds)


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(v: float) -> bytes:
    return (str(int(v)) if float(v).is_integer() else f"{v:g}").encode()
