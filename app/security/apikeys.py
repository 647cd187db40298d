"""API keys and tenants, shared by every replica through Redis (issue 16).

A key is `flx_<id>_<secret>`; Redis keeps only its SHA-256 (hex) → the key's record (id, tenant,
created), in one hash, so reading Redis gives no usable key and every replica agrees on what is
valid. The id (8 hex, also inside the key) names a key in listings and revocation without
revealing it. The key is shown once, by whoever created it.

Per-tenant limits live in the runtime config (`tenant_limits`, JSON `{tenant: {rps, tpm,
max_concurrent, max_priority, disabled}}`, `"*"` the default for tenants without an entry), so they apply live
on every replica like the other runtime knobs; `merge_limits` changes one tenant atomically.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis

from app.security.limits import DEFAULT_MAX_PRIORITY, PRIORITIES
from app.state.keys import Keys

#: Tenant names become parts of request ids and Redis hash tags: no braces, no `~` (the namespace
#: separator), nothing a log line would misread.
TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_TENANT_LIMITS = "*"
_KEY = re.compile(r"^flx_([0-9a-f]{8})_[A-Za-z0-9_-]{20,64}$")


class BadTenant(ValueError):
    pass


def check_tenant(name: str) -> str:
    if not TENANT.match(name):
        raise BadTenant("tenant must be 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def looks_like_key(key: str) -> bool:
    return bool(_KEY.match(key))


@dataclass(frozen=True)
class Limits:
    """0 = unlimited. `rps`: requests per second (a bucket of one second's worth); `tpm`: prompt +
    max output tokens per minute; `max_concurrent`: requests in flight cluster-wide;
    `max_priority`: the highest `x-flexlb-priority` class the tenant's requests get (a higher one
    asked for is lowered to it); `disabled`: every request of the tenant is refused (403)."""

    rps: float = 0.0
    tpm: int = 0
    max_concurrent: int = 0
    max_priority: str = DEFAULT_MAX_PRIORITY
    disabled: bool = False

    @property
    def limited(self) -> bool:
        return self.rps > 0 or self.tpm > 0 or self.max_concurrent > 0


_LIMIT_FIELDS = {"rps": float, "tpm": int, "max_concurrent": int, "max_priority": str, "disabled": bool}


def parse_limits(raw: dict[str, Any]) -> Limits:
    """Validate one tenant's entry (raises ValueError)."""
    unknown = set(raw) - set(_LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown limit fields {sorted(unknown)}")
    kw = {k: _LIMIT_FIELDS[k](v) for k, v in raw.items()}
    lim = Limits(**kw)
    if lim.rps < 0 or lim.tpm < 0 or lim.max_concurrent < 0:
        raise ValueError("limits must be >= 0")
    if lim.max_priority not in PRIORITIES:
        raise ValueError(f"max_priority must be one of {', '.join(PRIORITIES)}")
    return lim


def parse_tenant_limits(text: str | None) -> dict[str, Limits]:
    """The runtime config's `tenant_limits` JSON → limits by tenant (`"*"` the default)."""
    if not text:
        return {}
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("tenant_limits must be a JSON object")
    out = {}
    for name, entry in raw.items():
        if name != DEFAULT_TENANT_LIMITS:
            check_tenant(name)
        if not isinstance(entry, dict):
            raise ValueError(f"tenant_limits[{name!r}] must be an object")
        out[name] = parse_limits(entry)
    return out


def limits_for(table: dict[str, Limits], tenant: str) -> Limits:
    return table.get(tenant) or table.get(DEFAULT_TENANT_LIMITS) or Limits()


# KEYS[1] config HASH; ARGV[1] tenant, ARGV[2] JSON of the fields to set → the new tenant_limits JSON.
# Merges one tenant's fields into `tenant_limits` and bumps `version` in one step, so two admins
# changing two tenants at once both land (a read-modify-write from a client would lose one).
MERGE_LIMITS = """
local cur = redis.call('HGET', KEYS[1], 'tenant_limits')
local all = {}
if cur then all = cjson.decode(cur) end
local entry = all[ARGV[1]] or {}
for k, v in pairs(cjson.decode(ARGV[2])) do entry[k] = v end
all[ARGV[1]] = entry
local out = cjson.encode(all)
redis.call('HSET', KEYS[1], 'tenant_limits', out)
redis.call('HINCRBY', KEYS[1], 'version', 1)
return out
"""


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant: str
    created_ms: int


class KeyStore:
    """The cluster's API keys in Redis (`<prefix>:apikeys`, HASH sha256 → record JSON)."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self.hash_key = f"{prefix}:apikeys"
        self.config_key = Keys(prefix).config  # the runtime config hash

    async def add(self, tenant: str) -> tuple[str, KeyRecord]:
        """A new key for `tenant`: (the key — shown once, never stored —, its record)."""
        check_tenant(tenant)
        kid = secrets.token_hex(4)
        key = f"flx_{kid}_{secrets.token_urlsafe(24)}"
        rec = KeyRecord(kid, tenant, int(time.time() * 1000))
        await self.redis.hset(self.hash_key, key_hash(key), json.dumps(asdict(rec)))
        return key, rec

    async def list(self) -> list[KeyRecord]:
        raw = await self.redis.hgetall(self.hash_key)
        recs = [KeyRecord(**json.loads(v)) for v in raw.values()]
        return sorted(recs, key=lambda r: (r.tenant, r.created_ms, r.id))

    async def revoke(self, key_id: str | None = None, tenant: str | None = None) -> list[KeyRecord]:
        """Delete the key with this id, or every key of this tenant; returns what was revoked."""
        raw = await self.redis.hgetall(self.hash_key)
        gone: list[tuple[bytes | str, KeyRecord]] = []
        for h, v in raw.items():
            rec = KeyRecord(**json.loads(v))
            if (key_id is not None and rec.id == key_id) or (tenant is not None and rec.tenant == tenant):
                gone.append((h, rec))
        if gone:
            await self.redis.hdel(self.hash_key, *[h for h, _ in gone])
        return [rec for _, rec in gone]

    async def lookup(self, key: str) -> KeyRecord | None:
        v = await self.redis.hget(self.hash_key, key_hash(key))
        return KeyRecord(**json.loads(v)) if v is not None else None

    async def merge_limits(self, tenant: str, fields: dict[str, Any]) -> dict[str, Limits]:
        """Set some of one tenant's limits (or the default's, `"*"`) in the runtime config."""
        if tenant != DEFAULT_TENANT_LIMITS:
            check_tenant(tenant)
        parse_limits(fields)  # refuse a bad value before it reaches every replica
        out = await self.redis.eval(MERGE_LIMITS, 1, self.config_key, tenant, json.dumps(fields))
        return parse_tenant_limits(out.decode() if isinstance(out, bytes) else out)
