"""The lean RESP connection the origin's hand-off round trip uses (app/state/resp.py), against a
real Redis: replies in order under concurrency, error replies in place, and recovery from a
connection the server killed or that timed out."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.state import scripts
from app.state.resp import RespConnection, encode, stream_entries


def test_encode_is_resp_bulk_arrays() -> None:
    assert encode([["SET", "k", 5], ["GET", b"k\x00"]]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n*2\r\n$3\r\nGET\r\n$2\r\nk\x00\r\n"
    )
    assert encode([["X", 1.5]]) == b"*2\r\n$1\r\nX\r\n$3\r\n1.5\r\n"


def test_urls_it_cannot_speak_fall_back() -> None:
    assert RespConnection.from_url("rediss://h:6380/0") is None
    assert RespConnection.from_url("redis://h:6379/0?health_check_interval=2") is None
    c = RespConnection.from_url("redis://:pw@h:7000/3")
    assert c is not None and (c.host, c.port, c.db, c.password) == ("h", 7000, 3, "pw")


async def test_pipeline_replies_match_redis_py(redis_url: str) -> None:
    r = aioredis.from_url(redis_url)
    c = RespConnection(redis_url)
    k = f"t-resp:{uuid.uuid4().hex}"
    try:
        sha = await r.script_load(scripts.HANDOFF)
        res = await c.pipeline(
            [
                ["SET", k + ":s", "v"],
                ["INCRBY", k + ":n", 7],
                ["GET", k + ":s"],
                ["HSET", k + ":h", "a", 1],
                ["LPUSH", k + ":s", "x"],  # WRONGTYPE: an error reply, in place
                ["EVALSHA", sha, 3, k + ":q", k + ":qms", k + ":l", 10, "2.5", "{}", b"\x01\x00\x00\x00", 1],
                ["EVALSHA", "0" * 40, 0],
            ]
        )
        assert res[:4] == [b"OK", 7, b"v", 1]
        assert isinstance(res[4], ResponseError) and "WRONGTYPE" in str(res[4])
        entry, queued, owed = res[5]
        assert entry.count(b"-") == 1 and queued == b"2.500000" and owed == b"0.000"
        assert await r.xlen(k + ":q") == 1
        assert isinstance(res[6], NoScriptError)
    finally:
        await r.delete(k + ":s", k + ":n", k + ":h", k + ":q", k + ":qms", k + ":l")
        await c.close()
        await r.aclose()


async def test_concurrent_pipelines_keep_their_replies(redis_url: str) -> None:
    c = RespConnection(redis_url)
    r = aioredis.from_url(redis_url)
    k = f"t-resp:{uuid.uuid4().hex}"

    async def one(i: int) -> list:
        return await c.pipeline([["SET", f"{k}:{i}", i], ["INCRBY", f"{k}:{i}", i], ["GET", f"{k}:{i}"]])

    try:
        out = await asyncio.gather(*(one(i) for i in range(200)))
        assert [o[2] for o in out] == [str(2 * i).encode() for i in range(200)]
    finally:
        await r.delete(*(f"{k}:{i}" for i in range(200)))
        await c.close()
        await r.aclose()


async def test_killed_connection_fails_waiters_then_reconnects(redis_url: str) -> None:
    """A real fault: the server drops our connection (CLIENT KILL) while a command waits."""
    c = RespConnection(redis_url)
    r = aioredis.from_url(redis_url)
    k = f"t-resp:{uuid.uuid4().hex}"
    try:
        (my_id,) = await c.pipeline([["CLIENT", "ID"]])
        waiting = asyncio.create_task(c.pipeline([["BLPOP", k, 5]]))
        deadline = time.monotonic() + 2
        while not (c._proto and c._proto.waiters) and time.monotonic() < deadline:  # BLPOP written
            await asyncio.sleep(0.005)
        assert c._proto is not None and len(c._proto.waiters) == 1 and not waiting.done()
        assert await r.execute_command("CLIENT", "KILL", "ID", my_id) == 1
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(waiting, 3)
        (new_id,) = await c.pipeline([["CLIENT", "ID"]])
        assert new_id != my_id
    finally:
        await c.close()
        await r.aclose()


async def test_timeout_raises_and_the_late_reply_is_dropped(redis_url: str) -> None:
    c = RespConnection(redis_url, timeout_s=0.2)
    k = f"t-resp:{uuid.uuid4().hex}"
    try:
        with pytest.raises(RedisTimeoutError):
            await c.pipeline([["BLPOP", k, 0.5]])
        proto = c._proto
        assert proto is not None and len(proto.waiters) == 1
        deadline = time.monotonic() + 5
        while proto.waiters and time.monotonic() < deadline:  # the late nil reply arrives
            await asyncio.sleep(0.02)
        assert not proto.waiters and not proto.closed
        # the late BLPOP answer was not taken for this one's, on the same connection
        assert await c.pipeline([["ECHO", "after"]]) == [b"after"]
        assert c._proto is proto
    finally:
        await c.close()


async def test_blocking_stream_reads_match_redis_py(redis_url: str) -> None:
    """The owner's XREADGROUP and the origin's XREAD over the lean connection (`stream_entries`)
    give what redis-py gives; a BLOCK that times out is [], and an error reply is raised."""
    r = aioredis.from_url(redis_url)
    c = RespConnection(redis_url, timeout_s=5.0)
    k = f"t-resp-x:{uuid.uuid4().hex}"
    try:
        ids = [await r.xadd(k, {"m": f'{{"n": {i}}}', "ids": bytes([i, 0, 0, 0])}) for i in range(3)]
        want = [(e, f) for _s, es in await r.xread({k: "0-0"}) for e, f in es]
        got = stream_entries(await c.call("XREAD", "COUNT", 256, "BLOCK", 50, "STREAMS", k, "0-0"))
        assert got == want and [e for e, _ in got] == ids and got[1][1][b"ids"] == b"\x01\x00\x00\x00"
        assert stream_entries(await c.call("XREAD", "BLOCK", 30, "STREAMS", k, "$")) == []
        await r.xgroup_create(k, "g", id="0")
        got = stream_entries(await c.call("XREADGROUP", "GROUP", "g", "c1", "COUNT", 2, "STREAMS", k, ">"))
        assert [e for e, _ in got] == ids[:2]
        await r.xdel(k, ids[0])  # pending but deleted: no fields
        got = stream_entries(await c.call("XREADGROUP", "GROUP", "g", "c1", "STREAMS", k, "0"))
        assert got == [(ids[0], {}), (ids[1], want[1][1])]
        with pytest.raises(ResponseError, match="NOGROUP"):
            await c.call("XREADGROUP", "GROUP", "nogroup", "c1", "STREAMS", k, ">")
    finally:
        await r.delete(k)
        await r.aclose()
        await c.close()
