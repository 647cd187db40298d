"""SSE keep-alive (FLEXLB_SSE_KEEPALIVE_S): an admitted stream answers 200 at once and sends
`: keep-alive` comments until its first token, so a prefill (or a queue) longer than a client's
read timeout no longer fails the client before the stream starts. Refusals before admission stay
plain typed HTTP statuses; with the setting 0 the 200 waits for the first token as before.

Live: two gateways (keep-alive 0.3 s, and 0) over the session's real Triton workers, whose
prefill is made slow with `configure(formula=...)` (3 modelled s at time scale 1); no mocks.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from app.state.keys import Keys

from .conftest import worker_call
from .gateways import ADMIN_TOKEN, Gateway, start_gateway, wait_for

MODEL = "flexlb-sim"
PREFILL_MS = 3000  # modelled prefill of every request here: twice the clients' read timeout
READ_TIMEOUT_S = 1.5
KEEPALIVE_S = 0.3
# An own TTFT deadline every admitted request here meets (3 s of prefill, maybe one cancelled
# request's not yet settled on the gateway's view of the worker): SLO admission stays out of it.
DEADLINE_MS = 10_000
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Rig:
    def __init__(self, on: Gateway, off: Gateway, prefill: str, decode: str, r: redis.Redis) -> None:
        self.on, self.off, self.prefill, self.decode, self.r = on, off, prefill, decode, r

    def holds(self, gw: Gateway, rid: str) -> list[str]:
        """Where `rid` is still held: the prefill engine, the decode engine, its decode KV reservation."""
        left = []
        st = worker_call(self.prefill, "status")
        left += [f"prefill:{b['phase']}" for b in st["live"] if rid in b["request_ids"]]
        if rid in st["pinned"]:
            left.append("prefill:pinned")
        st = worker_call(self.decode, "status")
        left += [f"decode:{phase}" for phase, ids in st["live"].items() if rid in ids]
        if self.r.hexists(Keys(gw.env["cluster"]).reservations(f"decode@{self.decode}"), rid):
            left.append("decode KV reserved")
        return left


@pytest.fixture(scope="module")
def rig(worker_pool, shared_embedded_redis, tmp_path_factory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("sse")
    p, d = worker_pool["prefill"][0].address, worker_pool["decode"][0].address
    workers = f"prefill@{p},decode@{d}"
    started: list[Gateway] = []
    r = redis.Redis.from_url(shared_embedded_redis)
    try:
        for ka in (str(KEEPALIVE_S), "0"):
            cluster = f"t-sse-{uuid.uuid4().hex[:6]}"
            gw = start_gateway(
                tmp, shared_embedded_redis, cluster, workers=workers, FLEXLB_SSE_KEEPALIVE_S=ka
            )
            gw.env["cluster"] = cluster
            started.append(gw)
        for gw in started:
            wait_for(lambda gw=gw: gw.readyz()["ready"], 60, what="gateway ready")
            # the gateway predicts what the worker takes: admission sees a 3 s prefill
            resp = httpx.put(
                gw.url + "/admin/config", json={"prefill_time_formula": str(PREFILL_MS)}, headers=ADMIN
            )
            assert resp.status_code == 200, resp.text
            version = int(resp.json()["config"]["version"])
            wait_for(lambda gw=gw, v=version: gw.readyz()["config_version"] >= v, 30, what="config applied")
        yield Rig(started[0], started[1], p, d, r)
    finally:
        for gw in started:
            gw.stop()
        r.close()


@pytest.fixture
def slow(rig: Rig, workers_reset) -> Rig:
    assert worker_call(rig.prefill, "configure", formula=str(PREFILL_MS), time_scale=1.0).get("ok")
    return rig


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def read_timeout() -> httpx.Timeout:
    return httpx.Timeout(30.0, read=READ_TIMEOUT_S)


def test_slow_prefill_streams_to_a_client_with_a_shorter_read_timeout(slow: Rig) -> None:
    """(a) 200 and keep-alive comments before the first token; the stream completes although no
    token came for longer than the client's read timeout."""
    body = {
        "prompt": "slow prefill",
        "max_new_tokens": 5,
        "stream": True,
        "request_id": uid("ka"),
        "deadline_ms": DEADLINE_MS,
    }
    lines: list[str] = []
    with (
        httpx.Client(timeout=read_timeout()) as c,
        c.stream("POST", slow.on.url + "/v1/generate", json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in resp.iter_lines() if x]
    first_data = next(i for i, x in enumerate(lines) if x.startswith("data: "))
    assert first_data >= 2 and all(x == ": keep-alive" for x in lines[:first_data]), lines[:first_data]
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]"
    final = events[-1]
    assert final["done"] and len(final["output_ids"]) == 5, final
    # the engine's modelled prefill outlasted the client's read timeout
    assert final["timings"]["prefill_ms"] >= READ_TIMEOUT_S * 1000, final["timings"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_openai_sdk_streams_through_the_keep_alives(slow: Rig, endpoint: str) -> None:
    """(b) the openai SDK with a 1.5 s timeout (read included) skips the comments and gets every chunk."""
    c = openai.OpenAI(
        base_url=slow.on.url + "/v1",
        api_key="-",
        max_retries=0,
        timeout=READ_TIMEOUT_S,
        default_headers={"x-flexlb-slo-ms": str(DEADLINE_MS)},
    )
    if endpoint == "completions":
        stream: Any = c.completions.create(model=MODEL, prompt="slow sdk", max_tokens=6, stream=True)
        chunks = list(stream)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    else:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "slow sdk"}], max_tokens=6, stream=True
        )
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(text) == 6, text  # the simulated model's byte tokens: one character each


def test_refusals_before_admission_stay_http_statuses(slow: Rig) -> None:
    """(c) a refusal by SLO admission (a 1 s deadline against the 3 s prefill the idle worker needs:
    400 deadline_too_short, no retry can meet it) and a validation 400 are typed HTTP errors with
    JSON bodies on a keep-alive gateway, never a 200 stream."""
    with httpx.Client(timeout=read_timeout()) as c:
        body = {"prompt": "cannot make it", "max_new_tokens": 4, "stream": True, "deadline_ms": 1000}
        resp = c.post(slow.on.url + "/v1/generate", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["code"] == "deadline_too_short" and not resp.json()["error"]["retryable"]
        resp = c.post(
            slow.on.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 10**9, "stream": True},
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_request"


def test_keep_alive_off_keeps_the_old_behaviour(slow: Rig) -> None:
    """(d) FLEXLB_SSE_KEEPALIVE_S=0: no byte before the first token (that client times out), and
    the stream carries no comments."""
    rid = uid("off")
    body = {
        "prompt": "slow, no keep-alive",
        "max_new_tokens": 3,
        "stream": True,
        "request_id": rid,
        "deadline_ms": DEADLINE_MS,
    }
    with (
        httpx.Client(timeout=read_timeout()) as c,
        pytest.raises(httpx.ReadTimeout),
        c.stream("POST", slow.off.url + "/v1/generate", json=body) as resp,
    ):
        resp.read()
    # that client's hang-up cancelled it: nothing stays held
    wait_for(lambda: not slow.holds(slow.off, rid), 10, what=f"{rid} released")
    body["request_id"] = uid("off2")
    with httpx.stream("POST", slow.off.url + "/v1/generate", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [x for x in resp.iter_lines() if x]
    assert lines[0].startswith("data: {") and not any(x.startswith(":") for x in lines), lines
    assert json.loads(lines[-2][6:])["done"] and lines[-1] == "data: [DONE]"


def test_disconnect_during_keep_alives_cancels_and_releases(slow: Rig) -> None:
    """(e) a client that hangs up after the 200, before its first token, cancels the request:
    the prefill leaves the engine, the decode KV reservation goes, the lifecycle ends cancelled."""
    rid = uid("gone")
    data = json.dumps(
        {
            "prompt": "hang up",
            "max_new_tokens": 50,
            "stream": True,
            "request_id": rid,
            "deadline_ms": DEADLINE_MS,
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", slow.on.port), timeout=10)
    sock.sendall(
        (
            f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode()
        + data
    )
    buf = b""
    deadline = time.monotonic() + 10
    while buf.count(b": keep-alive") < 2:
        assert time.monotonic() < deadline, buf
        chunk = sock.recv(65536)
        assert chunk, buf
        buf += chunk
    assert buf.startswith(b"HTTP/1.1 200") and b"data: " not in buf, buf
    held = slow.holds(slow.on, rid)
    assert held == ["prefill:running", "decode KV reserved"], held
    sock.close()

    def state() -> str | None:
        resp = slow.on.get(f"/v1/requests/{rid}")
        return resp.json()["state"] if resp.status_code == 200 else None

    wait_for(lambda: not slow.holds(slow.on, rid) and state() == "cancelled", 10, what=f"{rid} cancelled")
    key = Keys(slow.on.env["cluster"]).reservations(f"decode@{slow.decode}")
    assert int(slow.r.hget(key, "_total") or 0) == 0


def test_keep_alives_fill_a_gap_between_tokens(rig: Rig, workers_reset) -> None:
    """A decode step longer than the keep-alive period (8 modelled ms at time scale 100: 0.8 wall s
    a token) gets comments between its tokens too, and the client's read timeout never fires."""
    assert worker_call(rig.prefill, "configure", formula="50", time_scale=1.0).get("ok")
    assert worker_call(rig.decode, "configure", time_scale=100.0).get("ok")
    body = {"prompt": "slow decode", "max_new_tokens": 4, "stream": True, "deadline_ms": DEADLINE_MS}
    with (
        httpx.Client(timeout=read_timeout()) as c,
        c.stream("POST", rig.on.url + "/v1/generate", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = [x for x in resp.iter_lines() if x]
    data = [i for i, x in enumerate(lines) if x.startswith("data: {")]
    final = json.loads(lines[data[-1]][6:])
    assert final["done"] and len(final["output_ids"]) == 4, final
    between = lines[data[0] : data[-1]]
    assert ": keep-alive" in between, lines


def test_cancel_during_keep_alives_ends_the_stream_with_an_error_event(slow: Rig) -> None:
    """A DELETE after the 200, before the first token: the stream ends with a typed `Error` event
    then `data: [DONE]` (a failure after the headers), and nothing stays held."""
    rid = uid("del")
    body = {"prompt": "cancel me", "max_new_tokens": 20, "stream": True, "request_id": rid}
    body["deadline_ms"] = DEADLINE_MS
    lines: list[str] = []
    with (
        httpx.Client(timeout=read_timeout()) as c,
        c.stream("POST", slow.on.url + "/v1/generate", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line:
                lines.append(line)
            if line == ": keep-alive" and len(lines) == 2:
                wait_for(lambda: "prefill:running" in slow.holds(slow.on, rid), 5, what="prefill running")
                gone = slow.on.delete(f"/v1/requests/{rid}")
                assert gone.status_code == 202, gone.text
    assert all(x == ": keep-alive" for x in lines[:-2]), lines
    assert json.loads(lines[-2][6:])["error"]["code"] == "cancelled" and lines[-1] == "data: [DONE]", lines
    wait_for(lambda: not slow.holds(slow.on, rid), 10, what=f"{rid} released")
