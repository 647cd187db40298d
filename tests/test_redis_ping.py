"""The replica's Redis probe (`app.state.connect.ping`, its `redis_watch`) tells a pooled socket the
server closed (what a Redis restart leaves in redis-py's pool, each failing its first use however
late) from a Redis that is gone. Real Redis; the broken socket is a real reset on the wire
(tests/faultproxy.py), as a restarted server's predecessor leaves it."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.state.connect import ping

from .faultproxy import FaultProxy
from .gateways import free_port


async def test_a_pooled_connection_the_server_closed_is_not_a_redis_down(redis_url: str) -> None:
    """A pooled socket that breaks on its next use (after a Redis restart, or a connection the
    server or a middlebox closed) must not read as "Redis down". Whether redis-py notices a
    server-closed idle socket before using it changed between its releases (8.1 did not, 7.4 and
    8.2 do), so the broken socket here is made on the wire: the proxy resets the connection
    that carries the next command, which no client can see coming."""
    proxy = FaultProxy(redis_url)
    client = aioredis.from_url(proxy.url, socket_timeout=2.0)
    try:
        await client.ping()
        proxy.drop_next(1)
        with pytest.raises(RedisConnectionError):  # what the watch saw: one PING, one broken socket
            await client.ping()
        await client.ping()
        proxy.drop_next(1)
        await ping(client, 1.0)  # the probe retries on a fresh connection: Redis is up
        assert proxy.resets == 2 and proxy.drops == 0
    finally:
        await client.aclose()
        proxy.close()


async def test_a_redis_that_is_gone_still_fails_the_probe() -> None:
    client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1.0)
    try:
        with pytest.raises(RedisConnectionError):
            await ping(client, 1.0)
    finally:
        await client.aclose()
