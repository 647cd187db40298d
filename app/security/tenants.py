"""Who is calling (API keys → tenant) and whether they may now (per-tenant limits), for the client
API (issue 16). With `FLEXLB_AUTH=none` (the default of `flexlb up`) nothing here runs.

`TenantGate` is ASGI middleware on `/v1/`: it answers 401 before the body is read when the
`Authorization: Bearer` key is missing or unknown, 403 when the key's tenant is disabled, and puts
the tenant into the request's state. It also adds the `x-ratelimit-*` headers the limiter left in
the state to whatever response goes out (a 200, a stream, or the 429), and gives a concurrency
slot back when the request ends.

Keys are looked up in Redis and cached here for `KEY_CACHE_S`: a revoked key stops working on
every replica within that time, and a busy key costs one HGET per replica per interval, not one
per request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from app import metrics as M
from app.gateway.errors import ApiError
from app.security.apikeys import KeyRecord, KeyStore, Limits, limits_for, looks_like_key
from app.security.limits import GENERATION_PATHS, REQUEST_ID_RULE, valid_request_id
from app.security.ratelimit import Limiter, Verdict
from app.state.lifecycle import client_id

log = logging.getLogger("flexlb.security")

#: How long a key lookup is trusted; revocation reaches every replica within this (test: < 1 s).
#: A busy key then costs each replica one HGET per interval: nothing beside the request's commands.
KEY_CACHE_S = 0.25
#: Separator of tenant and client id in a namespaced request id; never valid in a client id.
NS = "~"


def scoped_id(tenant: str | None, rid: str) -> str:
    """The id the cluster stores: the client's id inside its tenant's namespace, so two tenants'
    ids never collide and one tenant cannot name (read, cancel) another's request."""
    return f"{tenant}{NS}{rid}" if tenant else rid


def public_id(rid: str) -> str:
    """The id as its client knows it: without its tenant's namespace, and without the attempt
    number a retry runs under (`<id>#<n>`, app/state/lifecycle.py)."""
    rid = client_id(rid)
    return rid.split(NS, 1)[1] if NS in rid else rid


def path_id(request: Any, rid: str) -> str:
    """A request id from a URL path, checked and namespaced like one from a body."""
    if not valid_request_id(rid):
        raise ApiError("invalid_request", REQUEST_ID_RULE)
    return scoped_id(tenant_of(request), rid)


def tenant_of(request: Any) -> str | None:
    return request.scope.get("state", {}).get("tenant")  # type: ignore[no-any-return]


class Tenants:
    """The replica's view of keys and limits: the key cache, the limits table (from the runtime
    config, replaced whole when it changes) and the limiter."""

    def __init__(
        self, enabled: bool, keys: KeyStore, limiter: Limiter, limits: Callable[[], dict[str, Limits]]
    ) -> None:
        self.enabled = enabled
        self.keys = keys
        self.limiter = limiter
        self._limits = limits  # the replica's copy of the runtime config's `tenant_limits`
        self._cache: dict[str, tuple[KeyRecord | None, float]] = {}
        # tenant → (refused until, monotonic; the x-ratelimit headers of that refusal)
        self._refused: dict[str, tuple[float, list[tuple[bytes, bytes]]]] = {}

    def refused_locally(self, tenant: str) -> tuple[ApiError, list[tuple[bytes, bytes]]] | None:
        """Within a refusal window the cluster's bucket told us about, refuse at the door: no body
        read, no Redis call. Sound because the bucket's refill time is a lower bound (other
        replicas can only take tokens, never add). A flood over the limit then costs a replica
        the HTTP parsing only; bench/tenant_limits.py measures what the other tenants see."""
        window = self._refused.get(tenant)
        if window is None:
            return None
        until, headers = window
        left = until - time.monotonic()
        if left <= 0:
            del self._refused[tenant]
            return None
        M.RATE_LIMITED.labels("requests").inc()
        err = ApiError(
            "rate_limited",
            f"tenant {tenant!r} is over its limit of {self.limits_of(tenant).rps:g} requests/s",
            retry_after_s=max(1.0, left),
        )
        return err, headers

    def limits_of(self, tenant: str) -> Limits:
        return limits_for(self._limits(), tenant)

    async def authenticate(self, key: str) -> KeyRecord | None:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        rec = await self.keys.lookup(key) if looks_like_key(key) else None
        if len(self._cache) > 10_000:  # bounded: unknown keys from a scanner must not grow it
            self._cache.clear()
        self._cache[key] = (rec, now + KEY_CACHE_S)
        return rec

    def check(self, request: Any, cost: int, timeout_ms: int) -> LimitCheck | None:
        """The tenant's limit check for this request, or None when it has no limit. It costs no
        command here: the request's first round trip carries it (`LimitCheck.run`)."""
        tenant = tenant_of(request)
        if tenant is None:
            return None
        lim = limits_for(self._limits(), tenant)
        if not lim.limited:
            return None
        return LimitCheck(self, tenant, lim, cost, timeout_ms, request.scope.setdefault("state", {}))

    def settle(self, check: LimitCheck, v: Verdict, sent: float) -> None:
        """Leave the verdict's `x-ratelimit-*` headers and concurrency slot in the request's state
        for `TenantGate`; raise 429 `rate_limited` (with `Retry-After`) when refused.

        When the bucket has no whole request token left (this request took the last, or was
        refused for want of one), the tenant's generations are refused at the door until one
        refills: a flooding tenant's excess then costs a replica the HTTP parsing only, never a
        tokenisation, a routing or a Redis call. The window counts from `sent` (monotonic, when
        the script was sent: it ran later), so it never outlasts the server's."""
        tenant, lim = check.tenant, check.limits
        check.state["ratelimit_headers"] = v.headers
        if v.holds_slot:
            check.state["slot"] = (tenant, check.rid)
        if v.next_request_ms > 0:
            self._refused[tenant] = (sent + v.next_request_ms / 1000, v.headers)
        if v.allowed:
            return
        retry_s = max(1.0, v.retry_after_ms / 1000)
        # Sent by `TenantGate` too: a stream's error before its first byte is re-raised from its
        # SSE body, which has no Retry-After of its own (it would say the generic 1 s).
        check.state["ratelimit_headers"] = [*v.headers, (b"retry-after", str(round(retry_s)).encode())]
        M.RATE_LIMITED.labels(v.reason or "requests").inc()
        what = {
            "requests": f"{lim.rps:g} requests/s",
            "tokens": f"{lim.tpm} tokens/min",
            "tokens_above_limit": f"{lim.tpm} tokens/min (this request alone needs {check.cost})",
            "concurrent": f"{lim.max_concurrent} concurrent requests",
        }.get(v.reason, v.reason)
        raise ApiError(
            "rate_limited", f"tenant {tenant!r} is over its limit of {what}", retry_after_s=retry_s
        )


@dataclass
class LimitCheck:
    """A limited tenant's check, pending until the request's first round trip (the record, the
    decode hold and the hand-off: app/request/handoff_round_trip.py, or the record and decode hold
    of a client's id: app/request/record_stage.py) carries it in one script."""

    tenants: Tenants
    tenant: str
    limits: Limits
    cost: int  # prompt + max output tokens, taken from the token bucket up front
    timeout_ms: int  # a concurrency hold expires with the request's deadline
    state: dict[str, Any]  # the request's ASGI state: headers and slot for `TenantGate`
    rid: str = ""

    async def run(
        self, rid: str, cmds: Sequence[Sequence[Any]], on_last: Callable[[Any], None] | None = None
    ) -> list[Any]:
        """The check, then `cmds` only when it passed; their replies. A refusal raises 429 and
        leaves Redis as it was (but for the bucket's refill). `on_last`: see `RateLimiter.run`."""
        self.rid = rid
        sent = time.monotonic()
        v, replies = await self.tenants.limiter.run(
            self.tenant, self.limits, rid, self.cost, self.timeout_ms, cmds, on_last
        )
        self.tenants.settle(self, v, sent)
        return replies


def _bearer(scope: Any) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return given.strip() if scheme.lower() == "bearer" else ""
    return ""


class TenantGate:
    """See the module doc. Paths outside `/v1/` (health, metrics, admin) pass untouched."""

    def __init__(self, app: Any, tenants: Tenants) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tenants.enabled or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        key = _bearer(scope)
        try:
            rec = await self.tenants.authenticate(key) if key else None
        except RedisError:
            await _reply(send, ApiError("state_unavailable", "API keys unavailable", retry_after_s=1))
            return
        if rec is None:
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not key else "invalid API key"
            await _reply(send, ApiError("unauthorized", msg))
            return
        limits = self.tenants.limits_of(rec.tenant)
        if limits.disabled:
            await _reply(send, ApiError("forbidden", f"tenant {rec.tenant!r} is disabled"))
            return
        state = scope.setdefault("state", {})
        state["tenant"] = rec.tenant
        state["max_priority"] = limits.max_priority  # the cap clamps x-flexlb-priority to it

        async def send_with_headers(msg: Any) -> None:
            if msg["type"] == "http.response.start":
                extra = state.get("ratelimit_headers")
                if extra:  # ours replace the response's own of the same name (Retry-After)
                    names = {k for k, _ in extra}
                    kept = [h for h in msg.get("headers", []) if h[0].lower() not in names]
                    msg = {**msg, "headers": [*kept, *extra]}
            await send(msg)

        # the buckets count generations only: reading or cancelling a request stays possible
        generation = scope["method"] == "POST" and scope["path"].startswith(GENERATION_PATHS)
        refused = self.tenants.refused_locally(rec.tenant) if generation else None
        if refused is not None:
            await _reply(send, refused[0], refused[1])
            return
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            slot = state.get("slot")
            if slot is not None:
                self.tenants.limiter.release(*slot)


async def _reply(send: Any, err: ApiError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += extra or []
    if err.retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, round(err.retry_after_s))).encode()))
    if err.code == "unauthorized":
        headers.append((b"www-authenticate", b"Bearer"))
    M.REJECTIONS.labels(err.code).inc()
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
