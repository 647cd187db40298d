"""The KV side channel's client and server over real TCP on 127.0.0.1 (no Triton needed: the
claim function stands in for the engine; test_worker_triton covers the real worker's channel)."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.netports import free_port
from workers.server.kv_channel import KvClaimClient, KvClaimServer


class Handles:
    """A prefill engine's pinned handles, reduced to what a claim sees."""

    def __init__(self, epoch: str, rids: set[str]) -> None:
        self.epoch, self.pinned = epoch, set(rids)
        self.gate: asyncio.Event | None = None  # set: claims wait for it (a slow engine)

    async def claim(self, rid: str, epoch: str) -> str:
        if self.gate is not None:
            await self.gate.wait()
        if epoch and epoch != self.epoch:
            return "epoch_mismatch"
        if rid not in self.pinned:
            return "unknown_request"
        self.pinned.discard(rid)
        return "ok"


async def start(handles: Handles) -> KvClaimServer:
    srv = KvClaimServer(handles.claim)
    await srv.start("127.0.0.1", free_port())
    return srv


async def test_claims_answered_once_and_epoch_checked() -> None:
    h = Handles("e1", {f"r{i}" for i in range(50)})
    srv = await start(h)
    resolved: list[str] = []

    async def resolve(peer: str) -> str:
        resolved.append(peer)
        return f"127.0.0.1:{srv.port}"

    async def fallback(peer: str, rid: str, epoch: str) -> str:
        raise AssertionError("a peer with a channel is never claimed through control")

    c = KvClaimClient(resolve, fallback)
    try:
        got = await asyncio.gather(*(c.claim("p:1", f"r{i}", "e1") for i in range(50)))
        assert got == ["ok"] * 50 and not h.pinned
        assert await c.claim("p:1", "r0", "e1") == "unknown_request"  # a handle is claimed once
        h.pinned.add("x")
        assert await c.claim("p:1", "x", "other") == "epoch_mismatch"
        assert "x" in h.pinned
        assert resolved == ["p:1"]  # one endpoint lookup, one connection for all of them
    finally:
        await c.close()
        await srv.close()


async def test_peer_restarted_on_a_new_port_is_found_again() -> None:
    h1 = Handles("e1", {"a"})
    srv1 = await start(h1)
    endpoint = {"now": f"127.0.0.1:{srv1.port}"}

    async def resolve(peer: str) -> str:
        return endpoint["now"]

    async def fallback(peer: str, rid: str, epoch: str) -> str:
        raise AssertionError("unexpected fallback")

    c = KvClaimClient(resolve, fallback)
    try:
        assert await c.claim("p:1", "a", "e1") == "ok"
        await srv1.close()
        h2 = Handles("e2", {"b"})
        srv2 = await start(h2)
        endpoint["now"] = f"127.0.0.1:{srv2.port}"
        # The old connection is dead and the old port refuses: the client asks for the endpoint
        # again instead of failing the claim.
        for _ in range(50):  # bounded: until the closed server's connection reads EOF
            try:
                assert await c.claim("p:1", "b", "e2") == "ok"
                break
            except ConnectionError:
                await asyncio.sleep(0.02)
        else:
            pytest.fail("claim never reached the restarted peer")
        await srv2.close()
    finally:
        await c.close()


async def test_peer_without_channel_uses_fallback_and_slow_claims_time_out() -> None:
    calls: list[tuple[str, str, str]] = []

    async def resolve(peer: str) -> None:
        return None  # an older worker: `control.kv_endpoint` answered an error

    async def fallback(peer: str, rid: str, epoch: str) -> str:
        calls.append((peer, rid, epoch))
        return "ok"

    c = KvClaimClient(resolve, fallback)
    assert await c.claim("old:1", "r", "e") == "ok"
    assert calls == [("old:1", "r", "e")]

    h = Handles("e1", {"slow"})
    h.gate = asyncio.Event()
    srv = await start(h)

    async def resolve2(peer: str) -> str:
        return f"127.0.0.1:{srv.port}"

    slow = KvClaimClient(resolve2, fallback, timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError):
            await slow.claim("p:1", "slow", "e1")
        h.gate.set()  # the late answer arrives on the same connection and is dropped
        h.pinned.add("next")
        assert await slow.claim("p:1", "next", "e1") == "ok"
    finally:
        await slow.close()
        await srv.close()


async def test_bad_lines_answer_invalid_and_long_lines_close_the_connection() -> None:
    h = Handles("e1", {"a"})
    srv = await start(h)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"not json\n" + json.dumps({"id": 7}).encode() + b"\n")
        answers = [json.loads(await reader.readline()) for _ in range(2)]
        assert sorted(a["status"] for a in answers) == ["invalid_request", "invalid_request"]
        assert h.pinned == {"a"}  # nothing claimed
        writer.write(b"x" * 10_000 + b"\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()
    finally:
        await srv.close()


async def test_closing_the_server_with_a_connection_open_logs_no_error() -> None:
    """A decode worker keeps its connection to each prefill worker's channel open, so every clean
    stop of a prefill worker closed the server under a live connection. Its cancelled handler made
    Python 3.11's `start_server` callback log "Exception in callback ... CancelledError" at error
    level on every `flexlb up` Ctrl-C: noise an operator's log alerting cannot tell from a fault."""
    h = Handles("e1", {"r0"})
    srv = await start(h)
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    try:
        writer.write(json.dumps({"id": 1, "request_id": "r0", "epoch": "e1"}).encode() + b"\n")
        assert json.loads(await reader.readline())["status"] == "ok"  # the handler is serving it
        await srv.close()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the server hung up
        for _ in range(20):  # let the cancelled handler's done-callbacks run
            await asyncio.sleep(0)
        assert not errors, [str(e.get("exception") or e.get("message")) for e in errors]
    finally:
        loop.set_exception_handler(None)
        writer.close()
