"""The gateway's JSON logging: lines formatted off the caller's thread, and the lifecycle-line
sampling every replica agrees on (app/logging_setup.py)."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import pytest

from app import logging_setup as L


@pytest.fixture
def json_logs():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    L.setup_logging("INFO", out)
    yield out
    L.flush_logs()
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(out: io.StringIO) -> list[dict]:
    return [json.loads(x) for x in out.getvalue().splitlines()]


def _written(out: io.StringIO, n: int) -> list[dict]:
    """The lines once the writer thread wrote `n` (bounded poll: it wakes every 50 ms)."""
    deadline = time.monotonic() + 5
    while len(lines := _lines(out)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines


def test_lines_are_written_by_the_listener_thread_with_the_values_at_log_time(json_logs) -> None:
    seen: list[str] = []
    fmt = L.JsonFormatter.format

    def spy(self, record):
        seen.append(threading.current_thread().name)
        return fmt(self, record)

    L.JsonFormatter.format = spy  # type: ignore[method-assign]
    try:
        state = ["queued"]
        logging.getLogger("flexlb.test").info(
            "request %s %s", "r1", state, extra={"event": "queued", "request_id": "r1", "timings": {"a": 1}}
        )
        state[0] = "changed"  # a mutable arg changed after the call must not change the line
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("flexlb.test").exception("failed", extra={"event": "failed"})
        lines = _written(json_logs, 2)
    finally:
        L.JsonFormatter.format = fmt  # type: ignore[method-assign]
    assert seen and threading.main_thread().name not in seen, seen
    first, second = lines[-2:]
    assert first["msg"] == "request r1 ['queued']" and first["event"] == "queued"
    assert first["request_id"] == "r1" and first["timings"] == {"a": 1}
    assert second["event"] == "failed" and "ValueError: boom" in second["exc"]


def test_flush_writes_what_is_queued_at_once(json_logs) -> None:
    for i in range(3):
        logging.getLogger("flexlb.test").info("line %d", i)
    L.flush_logs()  # a forced exit calls this right before os._exit
    assert [x["msg"] for x in _lines(json_logs)][-3:] == ["line 0", "line 1", "line 2"]


def test_lifecycle_sampling_is_per_request_and_deterministic() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    try:
        L.set_lifecycle_sample(0.0)
        assert not any(L.lifecycle_sampled(r) for r in ids)
        L.set_lifecycle_sample(1.0)
        assert all(L.lifecycle_sampled(r) for r in ids)
        L.set_lifecycle_sample(0.1)
        picked = [r for r in ids if L.lifecycle_sampled(r)]
        assert 300 < len(picked) < 500, len(picked)
        assert picked == [r for r in ids if L.lifecycle_sampled(r)]  # every replica agrees
    finally:
        L.set_lifecycle_sample(1.0)
