"""One way to open a Redis client from `FLEXLB_REDIS_URL`, plain or Sentinel (issue 14, DESIGN §13
"Redis HA").

`redis://` / `rediss://` / `unix://` URLs go to redis-py as they are. A Sentinel URL names the
sentinels, the monitored master's name and the database:

    redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/<db>]

and yields a client whose connections always go to the current master: after a failover redis-py
asks the sentinels again on the next connection error (or when the old master, now a replica,
answers READONLY), so every loop that retries after an error (app/cluster/loops.py) follows the
failover by itself. The lean RESP client (app/state/resp.py) does not speak Sentinel; callers fall
back to redis-py for these URLs, as for TLS.

What an asynchronous replica can lose when promoted — the master's last writes not yet
replicated — is repaired like any other loss (docs/state.md "Redis high availability").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import unquote, urlparse

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger("flexlb.state")

SENTINEL_SCHEMES = ("redis+sentinel", "sentinel")


def is_sentinel(url: str) -> bool:
    return urlparse(url).scheme in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """(sentinel addresses, master name, db, password) of a Sentinel URL; ValueError if malformed."""
    u = urlparse(url)
    if u.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL: {url!r}")
    netloc = u.netloc.rsplit("@", 1)[-1]
    password = unquote(u.password) if u.password else None
    hosts: list[tuple[str, int]] = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Sentinel address must be host:port, got {part!r} in {url!r}")
        hosts.append((host, int(port)))
    path = [p for p in u.path.split("/") if p]
    if not path:
        raise ValueError(f"Sentinel URL needs the master's name: {url!r}")
    db = int(path[1]) if len(path) > 1 else 0
    return hosts, path[0], db, password


def redis_client(url: str, **kw: Any) -> aioredis.Redis:
    """A redis-py asyncio client for `url` (plain or Sentinel); `kw` as for `Redis.from_url`."""
    if not is_sentinel(url):
        return aioredis.from_url(url, **kw)
    hosts, master, db, password = parse_sentinel_url(url)
    timeout = kw.get("socket_timeout", 2.0)
    sentinel = Sentinel(
        hosts,
        socket_timeout=timeout,
        sentinel_kwargs={
            "socket_timeout": timeout,
            "socket_connect_timeout": kw.get("socket_connect_timeout", 2.0),
        },
    )
    return sentinel.master_for(master, db=db, password=password, **kw)


async def ping(redis: aioredis.Redis, timeout_s: float) -> None:
    """PING, once more at once after a connection error. After a Redis restart the pool still
    holds sockets to the old process, and each fails its first use, however late ("Connection
    closed by server": in test_faults case 5 one did 7 s after the restart, and the replica's
    watch turned its requests away as `state_unavailable` for 0.5 s while Redis served the other
    replica). redis-py drops a connection that failed, so the retry runs on a fresh one; a Redis
    that is really gone fails it too. Only for PING: other commands are not safe to repeat."""
    try:
        await asyncio.wait_for(redis.ping(), timeout_s)
    except RedisConnectionError as exc:
        log.info("redis ping failed on one pooled connection (%s): trying a fresh one", exc)
        await asyncio.wait_for(redis.ping(), timeout_s)
