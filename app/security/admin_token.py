"""One admin token for the whole cluster (issue 16).

Replicas behind one load balancer must accept the same token, or an operator's call succeeds or
fails by which replica it lands on. The rule:

- `FLEXLB_ADMIN_TOKEN` set (what `flexlb up` and docker-compose do: one token given to every
  replica): that token. Its SHA-256 is also offered to Redis with `SET NX`, so a replica started
  later without a token accepts the same one.
- unset: the cluster's token is the one whose SHA-256 is stored in Redis. The first replica of a
  cluster generates a token, stores only its hash (`SET NX`: of two replicas starting at once,
  exactly one wins) and logs the token once; every other replica loads the stored hash.

Only the hash is ever stored, so reading Redis does not give admin access. Verification compares
digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

import redis.asyncio as aioredis

log = logging.getLogger("flexlb.security")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def admin_hash_key(prefix: str) -> str:
    """STRING: SHA-256 (hex) of the cluster's admin token."""
    return f"{prefix}:admin_token_sha256"


class AdminAuth:
    def __init__(self, configured: str | None, prefix: str) -> None:
        self.configured = configured
        self.key = admin_hash_key(prefix)
        self.digest: str | None = token_hash(configured) if configured else None

    async def resolve(self, redis: aioredis.Redis) -> None:
        """Agree with the cluster on the token (see the module doc). Safe to repeat; raises on a
        Redis error (the caller retries at the next admin call)."""
        if self.configured:
            stored = await self._offer(redis, str(self.digest))
            if stored is not None and stored != self.digest:
                log.warning(
                    "FLEXLB_ADMIN_TOKEN differs from the cluster's stored admin token; this replica "
                    "accepts only its own (give every replica the same token)"
                )
            return
        if self.digest is not None:
            return
        token = secrets.token_urlsafe(24)
        digest = token_hash(token)
        stored = await self._offer(redis, digest)
        if stored is None:
            log.warning(
                "FLEXLB_ADMIN_TOKEN unset; generated the cluster's admin token (shown once, only its "
                "hash is kept in Redis): %s",
                token,
            )
            self.digest = digest
        else:
            self.digest = stored
            log.info("FLEXLB_ADMIN_TOKEN unset; using the cluster's admin token (hash in Redis)")

    async def _offer(self, redis: aioredis.Redis, digest: str) -> str | None:
        """Store `digest` unless a hash is stored already: None when ours was stored, else the
        stored one. SET NX, then GET (not `SET NX GET`, which needs Redis 7)."""
        if await redis.set(self.key, digest, nx=True):
            return None
        stored = await redis.get(self.key)
        return _s(stored) if stored is not None else None

    def check(self, given: str) -> bool:
        if self.digest is None:
            return False
        return hmac.compare_digest(token_hash(given).encode(), self.digest.encode())


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
