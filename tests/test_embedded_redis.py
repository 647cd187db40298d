"""The embedded redis-server: real process, own session, survives its starter, exits when idle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis

from app.state.embedded_redis import EmbeddedRedis, pid_alive, start_embedded_redis, wait_pid_gone
from app.state.keys import Keys

ROOT = Path(__file__).resolve().parent.parent


def _prefix() -> str:
    return f"flexlb-test-{uuid.uuid4().hex[:8]}"


def _client(er: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(er.url, socket_timeout=2.0)


def test_starts_answers_ping_and_stops() -> None:
    er = start_embedded_redis(_prefix(), idle_s=60)
    try:
        assert er.url == f"redis://127.0.0.1:{er.port}/0"
        r = _client(er)
        assert r.ping()
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("save") == {"save": ""}
        assert Path(r.config_get("dir")["dir"]).resolve() == er.data_dir.resolve()
        assert r.config_get("bind")["bind"] == "127.0.0.1"
        assert int((er.data_dir / "redis.pid").read_text()) == er.pid
        # Its own session: a signal to our process group never reaches it.
        assert os.getsid(er.pid) == er.pid and os.getsid(er.pid) != os.getsid(0)
        assert os.getsid(er.watchdog_pid) == er.watchdog_pid
        r.close()
    finally:
        er.stop()
    assert not pid_alive(er.pid) and not pid_alive(er.watchdog_pid)
    assert not er.data_dir.exists()


def test_survives_sigkill_of_its_starter() -> None:
    code = textwrap.dedent(
        """
        import json, sys, time
        from app.state.embedded_redis import start_embedded_redis
        er = start_embedded_redis(sys.argv[1], idle_s=60)
        print(json.dumps({"url": er.url, "pid": er.pid, "wd": er.watchdog_pid, "dir": str(er.data_dir)}),
              flush=True)
        time.sleep(120)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, _prefix()], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    info = json.loads(child.stdout.readline())
    er = EmbeddedRedis(url=info["url"], pid=info["pid"], watchdog_pid=info["wd"], data_dir=Path(info["dir"]))
    try:
        child.send_signal(signal.SIGKILL)
        assert child.wait(5) == -signal.SIGKILL
        time.sleep(0.3)
        r = _client(er)
        assert r.ping()
        r.set("survived", "1")
        assert r.get("survived") == b"1"
        r.close()
        assert pid_alive(er.pid) and pid_alive(er.watchdog_pid)
    finally:
        er.stop()
    assert not pid_alive(er.pid)
    assert not er.data_dir.exists()


def test_exits_by_itself_when_no_replica_heartbeats() -> None:
    """Heartbeats keep it alive past idle_s. Once they stop, it shuts down and removes its data dir."""
    idle_s = 3
    prefix = _prefix()
    er = start_embedded_redis(prefix, idle_s=idle_s)
    try:
        r = _client(er)
        members = Keys(prefix).members
        t0 = time.monotonic()
        last_expiry_mono = t0
        while time.monotonic() - t0 < idle_s + 1.5:  # heartbeat for longer than the idle window
            r.zadd(members, {"replica-1": time.time() * 1000 + 500})
            last_expiry_mono = time.monotonic() + 0.5
            time.sleep(0.25)
        assert pid_alive(er.pid), "shut down although a replica was heartbeating"
        assert r.ping()
        r.close()
        # No heartbeat from now on: it must go, but not before idle_s after the last expiry.
        assert wait_pid_gone(er.pid, idle_s + 10), "embedded redis did not exit after the idle timeout"
        gone_after = time.monotonic() - last_expiry_mono
        assert gone_after >= idle_s - 0.5, f"exited {gone_after:.2f}s after the last expiry"
        assert wait_pid_gone(er.watchdog_pid, 5)
        deadline = time.monotonic() + 5
        while er.data_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not er.data_dir.exists()
    finally:
        er.stop()


def test_watchdog_cleans_up_when_redis_dies() -> None:
    er = start_embedded_redis(_prefix(), idle_s=60)
    try:
        os.kill(er.pid, signal.SIGKILL)
        assert wait_pid_gone(er.watchdog_pid, 10), "watchdog outlived its redis"
        assert not er.data_dir.exists()
    finally:
        er.stop()


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.state.embedded_redis as mod

    monkeypatch.setattr(mod, "find_redis_server", lambda: "/nonexistent/redis-server")
    with pytest.raises(mod.EmbeddedRedisError):
        start_embedded_redis(_prefix(), attempts=1, start_timeout=1.0)
