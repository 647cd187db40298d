"""Issue 14 Deliver 5 case 8: a retried id of a request that ended answers its stored outcome on
every endpoint, streaming included (never 500) — or, after a retryable failure, runs once more;
every 429/503 carries `Retry-After`, streaming included; decode KV that is full *now* is 429
`overloaded`, not 503."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from .conftest import worker_call
from .faultproxy import FaultProxy
from .gateways import start_gateway, wait_for

MODEL = "flexlb-sim"


@pytest.fixture
def gw(workers_reset, shared_embedded_redis, cluster, tmp_path):  # type: ignore[no-untyped-def]
    pool = workers_reset
    spec = ",".join(f"{w.role}@{w.address}" for ws in pool.values() for w in ws)
    g = start_gateway(tmp_path, shared_embedded_redis, cluster, spec)
    try:
        wait_for(lambda: g.readyz()["ready"], 60, what="ready")
        yield g, pool
    finally:
        g.stop()


def _calls(url: str, rid: str) -> list[tuple[str, httpx.Response]]:
    h = {"X-Request-Id": rid}
    out = []
    with httpx.Client(timeout=20) as c:
        for stream in (False, True):
            bodies = {
                "/v1/generate": {"prompt": "same prompt", "max_new_tokens": 4, "stream": stream},
                "/v1/completions": {
                    "model": MODEL,
                    "prompt": "same prompt",
                    "max_tokens": 4,
                    "stream": stream,
                },
                "/v1/chat/completions": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "same prompt"}],
                    "max_tokens": 4,
                    "stream": stream,
                },
            }
            for path, body in bodies.items():
                out.append((f"{path} stream={stream}", c.post(url + path, json=body, headers=h)))
    return out


def test_retrying_an_id_that_failed_for_good_answers_its_stored_outcome_on_every_endpoint(gw) -> None:  # type: ignore[no-untyped-def]
    g, _ = gw
    rid = f"bad-{uuid.uuid4().hex[:8]}"
    # ~132 ms of predicted prefill (4,000 tokens, default formula) against the client's own
    # 100 ms deadline: refused after the request was recorded, and not retryable.
    first = g.post(
        "/v1/generate",
        json={"prompt": "x" * 4000, "max_new_tokens": 4, "request_id": rid, "deadline_ms": 100},
    )
    assert first.status_code == 400 and first.json()["error"]["code"] == "deadline_too_short", first.text
    wait_for(lambda: g.get(f"/v1/requests/{rid}").json()["state"] == "failed", 5, what="stored")
    for name, resp in _calls(g.url, rid):
        assert resp.status_code == 400, (name, resp.status_code, resp.text)
        assert resp.json()["error"]["code"] == "deadline_too_short", (name, resp.text)


def test_retrying_a_timed_out_id_runs_once_more_then_answers_that_completion_on_every_endpoint(gw) -> None:  # type: ignore[no-untyped-def]
    """A 504 is `retryable`: the first retry of its id is a new attempt (app/state/lifecycle.py);
    every later one, on any endpoint, streaming included, answers that attempt's completion."""
    g, pool = gw
    for w in pool["prefill"]:
        assert worker_call(w.address, "configure", formula="1500")["ok"]
    rid = f"to-{uuid.uuid4().hex[:8]}"
    first = g.post(
        "/v1/generate",
        json={"prompt": "same prompt", "max_new_tokens": 4, "request_id": rid, "timeout_ms": 200},
    )
    assert first.status_code == 504 and first.json()["error"]["code"] == "deadline_exceeded"
    wait_for(lambda: g.get(f"/v1/requests/{rid}").json()["state"] == "timed_out", 5, what="stored")
    for w in pool["prefill"]:
        worker_call(w.address, "reset")
    for name, resp in _calls(g.url, rid):
        assert resp.status_code == 200, (name, resp.status_code, resp.text)
    rec = g.get(f"/v1/requests/{rid}").json()
    assert rec["state"] == "completed" and rec["attempt"] == 2, rec


def test_every_429_and_503_carries_retry_after_streaming_included(gw) -> None:  # type: ignore[no-untyped-def]
    g, pool = gw
    dec = pool["decode"][0]
    assert worker_call(dec.address, "configure", kv_capacity_tokens=400, time_scale=20.0)["ok"]
    wid = f"decode@{dec.address}"
    wait_for(
        lambda: (
            g.get("/admin/workers", admin=True).json()["workers"][wid]["snapshot"].get("kv_total_tokens")
            in ("400", 400)
        ),
        5,
        what="the small KV in the snapshot",
    )
    # never fits anywhere: 503 no_worker, streaming or not, with Retry-After
    for stream in (False, True):
        resp = g.post("/v1/generate", json={"prompt": "x" * 100, "max_new_tokens": 500, "stream": stream})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker", resp.text
        assert resp.headers.get("Retry-After") == "1"
    # fits, but the KV is held by a running stream: 429 overloaded (was 503 no_worker)
    holder = threading.Thread(
        target=lambda: httpx.post(
            g.url + "/v1/generate", json={"prompt": "hold", "max_new_tokens": 300}, timeout=60
        ),
        daemon=True,
    )
    holder.start()
    wait_for(
        lambda: (
            int(
                g.get("/admin/workers", admin=True)
                .json()["workers"][wid]["snapshot"]
                .get("reserved_tokens", 0)
            )
            > 0
        ),
        10,
        what="the hold in the snapshot",
    )
    for stream in (False, True):
        resp = g.post("/v1/generate", json={"prompt": "y" * 50, "max_new_tokens": 200, "stream": stream})
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "overloaded", resp.text
        assert resp.headers.get("Retry-After") == "1"
    worker_call(dec.address, "reset")
    holder.join(30)


def test_cancel_is_durable_when_the_notify_message_is_lost_and_says_what_it_found(
    workers_reset, shared_embedded_redis, cluster, tmp_path
) -> None:
    """A cancel sent through A for a request whose origin B is cut off from Redis at that moment:
    the pub/sub message is lost for good, yet the request ends `cancelled` once B is back (the
    cancel is recorded in B's cancel set). The answer says running / finished / unknown."""
    pool = workers_reset
    spec = ",".join(f"{w.role}@{w.address}" for ws in pool.values() for w in ws)
    proxy = FaultProxy(shared_embedded_redis)
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec)
    b = start_gateway(tmp_path, proxy.url, cluster)
    try:
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="ready")
        for w in pool["prefill"]:
            assert worker_call(w.address, "configure", formula="6000")["ok"]
        rid = f"cx-{uuid.uuid4().hex[:8]}"
        out: dict[str, httpx.Response] = {}
        th = threading.Thread(
            target=lambda: out.setdefault(
                "r",
                httpx.post(
                    b.url + "/v1/generate",
                    json={
                        "prompt": "cancel me",
                        "max_new_tokens": 4,
                        "request_id": rid,
                        "timeout_ms": 30_000,
                    },
                    timeout=40,
                ),
            ),
            daemon=True,
        )
        th.start()
        wait_for(lambda: a.get(f"/v1/requests/{rid}").status_code == 200, 10, what="recorded")
        proxy.down()  # B's subscriber is gone: the notify message below reaches no one
        resp = a.delete(f"/v1/requests/{rid}")
        assert resp.status_code == 202 and resp.json()["found"] == "running", resp.text
        time.sleep(0.5)
        proxy.up()
        th.join(20)
        assert not th.is_alive(), "the cancel never reached the request"
        assert out["r"].json()["error"]["code"] == "cancelled", out["r"].text
        wait_for(lambda: a.get(f"/v1/requests/{rid}").json()["state"] == "cancelled", 5, what="recorded")
        again = a.delete(f"/v1/requests/{rid}")
        assert again.status_code == 200 and again.json()["found"] == "finished", again.text
        assert a.delete("/v1/requests/never-seen-id").status_code == 404
    finally:
        a.stop()
        b.stop()
        proxy.close()
