"""A client's retry of its own request id (README "request id", app/state/lifecycle.py): after a
failure the gateway marked `retryable`, a timeout, a disconnect or a cancel the retry is a new
attempt that runs for real; after a completion or a non-retryable failure it replays the stored
outcome; while an attempt runs it is 409. Two gateway replicas (subprocesses) over one real Redis
and the session's real Triton workers, faults caused on the workers themselves; no mocks.

Every test ends by requiring that nothing of any attempt stays held: no decode reservation, no
ledger member, no queued hand-off, no live-set entry, no work on an engine.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.state.keys import Keys

from .conftest import worker_call
from .gateways import Gateway, metric_value, specs, start_gateway, wait_for

TERMINAL = {"completed", "failed", "cancelled", "timed_out", "owner_lost"}


class Pair:
    def __init__(self, a: Gateway, b: Gateway, keys: Keys, r: redis.Redis, pool: dict[str, list[Any]]):
        self.a, self.b, self.keys, self.r, self.pool = a, b, keys, r, pool

    def wids(self, role: str) -> dict[str, str]:
        """worker id → gRPC address."""
        return {f"{w.role}@{w.address}": w.address for w in self.pool[role]}


@pytest.fixture(scope="module")
def pair(worker_pool, shared_embedded_redis, tmp_path_factory) -> Iterator[Pair]:  # type: ignore[no-untyped-def]
    cluster = f"t-retry-{uuid.uuid4().hex[:6]}"
    tmp: Path = tmp_path_factory.mktemp("retry")
    a = start_gateway(tmp, shared_embedded_redis, cluster, specs(worker_pool))
    b = start_gateway(tmp, shared_embedded_redis, cluster)
    r = redis.Redis.from_url(shared_embedded_redis)
    try:
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="both replicas ready")
        yield Pair(a, b, Keys(cluster), r, worker_pool)
    finally:
        a.stop()
        b.stop()
        r.close()


REUSED = "flexlb_request_id_reused_total"


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def gen(gw: Gateway, rid: str, prompt: str = "retry me", max_new_tokens: int = 6, **kw: Any) -> Any:
    """POST /v1/generate with the client's id (an httpx.Response)."""
    body = {"prompt": prompt, "max_new_tokens": max_new_tokens, "request_id": rid, **kw}
    return gw.post("/v1/generate", json=body)


def record(gw: Gateway, rid: str) -> dict[str, Any]:
    resp = gw.get(f"/v1/requests/{rid}")
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def ended(gw: Gateway, rid: str, state: str) -> dict[str, Any]:
    """Bounded poll until the id's current attempt has ended in `state` (a disconnect's clean-up
    runs after the client left)."""
    return wait_for(lambda: (rec := record(gw, rid))["state"] == state and rec, 15, what=f"{rid} {state}")  # type: ignore[no-any-return]


def error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == code, resp.text
    return err  # type: ignore[no-any-return]


def configure(p: Pair, role: str, **kw: Any) -> None:
    for addr in p.wids(role).values():
        assert worker_call(addr, "configure", **kw)["ok"]


def reset(p: Pair) -> None:
    for role in ("prefill", "decode"):
        for addr in p.wids(role).values():
            worker_call(addr, "reset")


def assert_nothing_held(p: Pair, rid: str) -> None:
    """Within a bounded poll: no attempt of `rid` holds decode KV, a ledger member, a queued
    hand-off, a live-set entry or engine work, and the decode reservations sum to 0."""

    def left() -> list[str]:
        out: list[str] = []
        for wid in p.wids("decode"):
            resv = {k.decode(): v.decode() for k, v in p.r.hgetall(p.keys.reservations(wid)).items()}
            out += [f"hold {k} on {wid}" for k in resv if k != "_total"]
            if int(resv.get("_total", "0")) != 0:
                out.append(f"{wid} _total {resv['_total']}")
        for wid in p.wids("prefill"):
            out += [f"ledger {wid}" for _ in range(p.r.hlen(p.keys.ledger(wid)))]
            out += [f"queue {wid}" for _ in range(p.r.xlen(p.keys.queue(wid)))]
        for gw in (p.a, p.b):
            live = p.r.smembers(p.keys.origin_requests(gw.replica_id))
            out += [f"live {m!r} on {gw.replica_id}" for m in live]
        for addr in p.wids("prefill").values():
            st = worker_call(addr, "status")
            out += [f"prefill {b['phase']}" for b in st["live"] if any(rid in x for x in b["request_ids"])]
            out += [f"pinned {x}" for x in st["pinned"] if rid in x]
        for addr in p.wids("decode").values():
            st = worker_call(addr, "status")
            out += [f"decode {ph} {x}" for ph, ids in st["live"].items() for x in ids if rid in x]
        return out

    deadline = time.monotonic() + 10
    while problems := left():
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after 10 s: {problems}")
        time.sleep(0.05)


# ---- (a) a retryable failure, retried: runs again ---------------------------------------------
@pytest.mark.parametrize("failure", ["worker_error", "deadline_exceeded"])
def test_a_retryable_failure_retried_with_the_same_id_runs_again_and_completes(
    pair: Pair, workers_reset, failure: str
) -> None:
    rid = uid(failure)
    if failure == "worker_error":  # the decode engine fails every request it fetches
        configure(pair, "decode", faults={"error_rate": 1.0})
        first = gen(pair.a, rid)
        err = error(first, 502, "worker_error")
        state = "failed"
    else:  # a prefill that outlasts the request's own timeout: queued or running on the engine
        configure(pair, "prefill", formula="1500")
        first = gen(pair.a, rid, timeout_ms=200)
        err = error(first, 504, "deadline_exceeded")
        state = "timed_out"
    assert err["retryable"] is True
    ended(pair.a, rid, state)
    if failure == "deadline_exceeded":
        # The failed attempt's leftover is still there: its prefill is tombstoned under the
        # client's id (60 s), so a new attempt under that same id would be dropped at commit.
        tombs = [p for p in pair.wids("prefill") if pair.r.zscore(pair.keys.tombstones(p), rid) is not None]
        assert tombs, "attempt 1 left no tombstone"
    reset(pair)  # the fault is gone: what a proxy's retry a moment later meets
    retried = metric_value(pair.b, REUSED, result="retry")
    second = gen(pair.b, rid)  # the retry lands on the other replica, as a proxy's may
    assert second.status_code == 200, second.text
    assert metric_value(pair.b, REUSED, result="retry") == retried + 1
    out = second.json()
    assert out["request_id"] == rid and len(out["output_ids"]) == 6 and out["finish_reason"] == "length"
    rec = record(pair.a, rid)
    assert rec["state"] == "completed" and rec["attempt"] == 2 and rec["origin"] == pair.b.replica_id
    assert rec["outcome"]["request_id"] == rid  # the attempt number is internal
    # The new attempt's completion is now the id's stored answer: replayed, byte for byte.
    again = gen(pair.a, rid, prompt="something else", max_new_tokens=2)
    assert again.status_code == 200 and again.content == second.content
    assert_nothing_held(pair, rid)


# ---- (b) a disconnect mid-stream, retried: runs again -----------------------------------------
def test_a_client_that_disconnected_mid_stream_retries_and_gets_a_full_completion(
    pair: Pair, workers_reset
) -> None:
    rid = uid("gone")
    configure(pair, "decode", time_scale=20.0)  # decode slow enough to hang up in the middle
    body = json.dumps({"prompt": "hang up", "max_new_tokens": 40, "request_id": rid, "stream": True}).encode()
    head = (
        f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1:{pair.a.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", pair.a.port), timeout=30)
    try:
        sock.sendall(head + body)
        buf = b""
        while buf.count(b'"token_ids"') < 2:  # the first token and a decode chunk: mid-stream
            chunk = sock.recv(65536)
            assert chunk, buf
            buf += chunk
    finally:
        sock.close()  # the client goes away
    ended(pair.a, rid, "cancelled")
    reset(pair)
    second = gen(pair.b, rid, prompt="hang up", max_new_tokens=40)
    assert second.status_code == 200, second.text
    assert len(second.json()["output_ids"]) == 40
    rec = record(pair.b, rid)
    assert rec["state"] == "completed" and rec["attempt"] == 2
    assert_nothing_held(pair, rid)


# ---- (c) a completion, retried: replayed ------------------------------------------------------
def test_a_completed_request_retried_is_replayed_byte_for_byte_and_runs_nothing(
    pair: Pair, workers_reset
) -> None:
    rid = uid("done")
    first = gen(pair.a, rid)
    assert first.status_code == 200, first.text
    for gw in (pair.a, pair.b):
        replayed = metric_value(gw, REUSED, result="replay")
        again = gen(gw, rid, prompt="a different prompt", max_new_tokens=3)
        assert again.status_code == 200 and again.content == first.content
        assert metric_value(gw, REUSED, result="replay") == replayed + 1
    rec = record(pair.b, rid)
    assert rec["state"] == "completed" and "attempt" not in rec
    assert_nothing_held(pair, rid)


# ---- (d) a non-retryable failure, retried: replayed -------------------------------------------
def test_a_non_retryable_failure_retried_is_replayed(pair: Pair, workers_reset) -> None:
    rid = uid("bad")
    # ~132 ms of predicted prefill (4,000 tokens, the default formula) against the client's own
    # 100 ms deadline: refused after the request was recorded, `retryable: false`.
    first = gen(pair.a, rid, prompt="x" * 4000, deadline_ms=100)
    assert error(first, 400, "deadline_too_short")["retryable"] is False
    ended(pair.a, rid, "failed")
    for gw in (pair.a, pair.b):
        again = gen(gw, rid, prompt="short and easy")
        error(again, 400, "deadline_too_short")
        assert again.content == first.content
    assert "attempt" not in record(pair.b, rid)
    assert_nothing_held(pair, rid)


# ---- (e) a retry while an attempt runs: 409; cancel reaches the current attempt ---------------
def test_a_retry_while_the_retried_attempt_runs_is_409_and_a_cancel_reaches_that_attempt(
    pair: Pair, workers_reset
) -> None:
    rid = uid("busy")
    configure(pair, "decode", faults={"error_rate": 1.0})
    error(gen(pair.a, rid), 502, "worker_error")
    ended(pair.a, rid, "failed")
    reset(pair)
    configure(pair, "prefill", formula="30000")  # attempt 2 stays in prefill until cancelled
    result: dict[str, httpx.Response] = {}
    th = threading.Thread(target=lambda: result.setdefault("r", gen(pair.a, rid)))
    th.start()
    try:
        wait_for(
            lambda: (rec := record(pair.b, rid)).get("attempt") == 2 and rec["state"] not in TERMINAL,
            15,
            what="attempt 2 running",
        )
        for gw in (pair.a, pair.b):
            error(gen(gw, rid), 409, "duplicate_request")
        resp = pair.b.delete(f"/v1/requests/{rid}")  # from the replica that is not its origin
        assert resp.status_code == 202 and resp.json()["cancelled"], resp.text
    finally:
        th.join(30)
    error(result["r"], 499, "cancelled")
    ended(pair.b, rid, "cancelled")
    reset(pair)
    third = gen(pair.b, rid)  # after a cancel: attempt 3 runs
    assert third.status_code == 200, third.text
    rec = record(pair.a, rid)
    assert rec["state"] == "completed" and rec["attempt"] == 3
    assert_nothing_held(pair, rid)
