"""Cluster-wide per-tenant limits: token buckets in Redis, one Lua call per request (issue 16).

Why one script on the server: every replica takes from the same buckets, so a tenant cannot get
N× its rate by spreading over N replicas, and the check-and-take is atomic. The clock is the
server's (`TIME`), so replicas with skewed clocks agree. Both keys carry the tenant's hash tag
(`{t:<tenant>}`), so the script touches one slot (Redis Cluster). It runs only for a tenant that
has a limit: unlimited tenants cost no command.

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
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError, RedisError, ResponseError

from app.security.apikeys import Limits
from app.state.store import StateStore

log = logging.getLogger("flexlb.security")

# KEYS[1] bucket HASH {r, k, t}; KEYS[2] in-flight ZSET rid → hold-until ms.
# ARGV: rps, tpm, max_concurrent, cost tokens, request id, timeout ms, ended request ids...
# → {allowed 0|1, reason, retry_ms, remaining_requests, reset_requests_ms, remaining_tokens,
#    reset_tokens_ms, in_flight}
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
return {ok, reason, wait, math.floor(r), reset_r, math.floor(k), reset_k, inflight}
"""


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
    `RELEASE_DELAY_S` later removes what no admission took (one ZREM per tenant per interval).
    Measured with bench/tenant_limits.py: per request, +1 command with a concurrency limit instead
    of +2. The price: a finished request may count against its tenant for up to that delay.
    """

    RELEASE_DELAY_S = 0.1

    def __init__(self, store: StateStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self._sha = hashlib.sha1(LIMIT.encode()).hexdigest()
        self._ended: dict[str, list[str]] = {}  # tenant → finished request ids still holding slots
        self._flush: asyncio.Task[None] | None = None

    async def _eval(self, keys: list[str], args: list[Any]) -> Any:
        """One EVALSHA on the store's connection (counted in `flexlb_redis_commands_total`); after
        NOSCRIPT (a restarted Redis) load the script and run it again."""
        cmd = ["EVALSHA", self._sha, len(keys), *keys, *args]
        (res,) = await self.store.execute([cmd])
        if isinstance(res, NoScriptError):
            res = (await self.store.execute([["SCRIPT", "LOAD", LIMIT], cmd]))[1]
        if isinstance(res, ResponseError):
            raise res
        return res

    async def admit(self, tenant: str, lim: Limits, rid: str, cost: int, timeout_ms: int) -> Verdict:
        keys = [bucket_key(self.prefix, tenant), inflight_key(self.prefix, tenant)]
        ended = self._ended.pop(tenant, [])
        args = [repr(float(lim.rps)), lim.tpm, lim.max_concurrent, cost, rid, timeout_ms, *ended]
        try:
            res = await self._eval(keys, args)
        except BaseException:
            self._ended.setdefault(tenant, []).extend(ended)  # not applied: the flush retries them
            raise
        ok, reason, wait = int(res[0]), _str(res[1]), int(res[2])
        rem_r, reset_r, rem_k, reset_k = int(res[3]), int(res[4]), int(res[5]), int(res[6])
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
        return Verdict(ok == 1, reason, wait, headers, ok == 1 and lim.max_concurrent > 0)

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
