"""The replica's Redis probe (`app.state.connect.ping`, its `redis_watch`) tells a pooled socket the
server closed (what a Redis restart leaves in redis-py's pool, each failing its first use however
late) from a Redis that is gone. Real Redis; the server closes the connection for real
(`CLIENT KILL`), as the restarted server's predecessor did."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.state.connect import ping

from .gateways import free_port


async def test_a_pooled_connection_the_server_closed_is_not_a_redis_down(redis_url: str) -> None:
    client = aioredis.from_url(redis_url, socket_timeout=2.0)
    killer = aioredis.from_url(redis_url)
    try:
        await client.ping()
        await killer.client_kill_filter(_id=await client.client_id())
        with pytest.raises(RedisConnectionError):  # what the watch saw: one PING, one stale socket
            await client.ping()
        await client.ping()
        await killer.client_kill_filter(_id=await client.client_id())
        await ping(client, 1.0)  # the probe retries on a fresh connection: Redis is up
    finally:
        await client.aclose()
        await killer.aclose()


async def test_a_redis_that_is_gone_still_fails_the_probe() -> None:
    client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1.0)
    try:
        with pytest.raises(RedisConnectionError):
            await ping(client, 1.0)
    finally:
        await client.aclose()
