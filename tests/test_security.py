"""Tenants and security end to end (issue 16): two real gateway replicas with `FLEXLB_AUTH=keys`
and no configured admin token, sharing one real Redis, in front of the session's real Triton
workers. No mocks: keys, buckets and the admin token hash live in Redis; bodies and connections
are real sockets.

The module's replicas start without `FLEXLB_ADMIN_TOKEN`: the first generates the cluster's token
and logs it once, the second must accept the same one (hash in Redis).
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from app.security.apikeys import Limits
from app.security.limits import trace_id_from
from app.security.ratelimit import GATE, Limiter, inflight_key
from app.state.keys import Keys
from app.state.store import StateStore

from .conftest import worker_call
from .gateways import ROOT, Gateway, start_gateway, wait_for

CAP = 2  # the replicas' FLEXLB_MAX_CONCURRENT_REQUESTS
FLEXLB = [sys.executable, "-m", "app.cli"]


@dataclass
class Sec:
    a: Gateway
    b: Gateway
    token: str
    redis_url: str
    cluster: str
    r: redis.Redis

    def admin(self, method: str, gw: Gateway, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.request(method, gw.url + path, headers=headers, timeout=10, **kw)

    def gen(
        self, gw: Gateway, key: str | None, rid: str | None = None, priority: str = "", **body: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if rid:
            headers["X-Request-Id"] = rid
        if priority:
            headers["x-flexlb-priority"] = priority
        payload = {"prompt": "hello", "max_new_tokens": 2, **body}
        return httpx.post(gw.url + "/v1/generate", json=payload, headers=headers, timeout=20)

    def add_key(self, tenant: str, **limits: Any) -> str:
        res = self.admin("POST", self.a, "/admin/keys", json={"tenant": tenant, **limits})
        assert res.status_code == 200, res.text
        return str(res.json()["key"])

    def limits_applied(self) -> None:
        """Both replicas run the runtime config version now stored (tenant limits live there)."""
        want = int(self.r.hget(Keys(self.cluster).config, "version") or 0)
        for gw in (self.a, self.b):
            wait_for(lambda gw=gw: gw.readyz()["config_version"] >= want, 5, what="limits applied")


@pytest.fixture(scope="module")
def sec(
    worker_pool: Any, shared_embedded_redis: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sec]:
    tmp = tmp_path_factory.mktemp("sec")
    cluster = f"t-sec-{uuid.uuid4().hex[:6]}"
    wids = [f"prefill@{w.address}" for w in worker_pool["prefill"]]
    wids.append(f"decode@{worker_pool['decode'][0].address}")
    env = {"FLEXLB_ADMIN_TOKEN": "", "FLEXLB_AUTH": "keys", "FLEXLB_MAX_CONCURRENT_REQUESTS": str(CAP)}
    a = start_gateway(tmp, shared_embedded_redis, cluster, workers=",".join(wids), **env)
    b = None
    try:
        b = start_gateway(tmp, shared_embedded_redis, cluster, workers=",".join(wids), **env)
        m = re.search(r"admin token \(shown once[^)]*\): (\S+?)\"", a.log())
        assert m is not None, a.log()[-2000:]
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 20, what="both replicas ready")
        r = redis.Redis.from_url(shared_embedded_redis)
        yield Sec(a, b, m.group(1), shared_embedded_redis, cluster, r)
        r.close()
    finally:
        for g in (a, b):
            if g is not None:
                g.stop()


def _hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _upload(port: int, head: bytes, chunks: Iterator[bytes]) -> tuple[bytes, int]:
    """Send `head`, then `chunks` while another thread reads the answer (a server that refuses
    mid-upload answers and closes; reading only after sending would lose the answer to the reset).
    Returns (the answer's first bytes, body bytes sent before the server stopped taking them)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    got = bytearray()

    def read() -> None:
        try:
            while chunk := s.recv(65536):
                got.extend(chunk)
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    try:
        s.sendall(head)
        for c in chunks:
            if got:
                break
            s.sendall(c)
            sent += len(c)
    except OSError:
        pass  # the server closed the connection: what it answered is in `got`
    reader.join(10)
    s.close()
    return bytes(got), sent


# ---- input limits before work ------------------------------------------------------------------
def test_a_10_mib_body_is_refused_before_it_is_read_whole(sec: Sec) -> None:
    key = sec.add_key("bodies")
    auth = f"Authorization: Bearer {key}\r\n".encode()
    ten_mib = 10 * 1024 * 1024
    before = _hwm_kib(sec.a.proc.pid)
    # Declared length: refused from the headers alone, before one body byte is sent.
    head = b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
    answer, sent = _upload(sec.a.port, head + f"Content-Length: {ten_mib}\r\n\r\n".encode(), iter([]))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code":"request_too_large"' in answer.replace(b" ", b"")
    # Chunked, no length: refused once the streamed count passes 4 MiB.
    chunk = b"x" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    head_chunked = head + b"Transfer-Encoding: chunked\r\n\r\n"
    answer, sent = _upload(sec.a.port, head_chunked, iter([framed] * (ten_mib // len(chunk))))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < ten_mib, "the server read the whole body"
    grown_kib = _hwm_kib(sec.a.proc.pid) - before
    print(f"\n[body limit] peak RSS grew {grown_kib} KiB; {sent / 2**20:.1f} MiB sent before the refusal")
    assert grown_kib < 6 * 1024, f"peak RSS grew {grown_kib} KiB for a refused 10 MiB body"
    assert sec.gen(sec.a, key).status_code == 200  # the replica serves on


def _hold(port: int, key: str, cls: str) -> socket.socket:
    """A generation request whose body never finishes arriving: it holds a slot of the cap."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nx-flexlb-priority: {cls}\r\n".encode()
        + b'Content-Length: 100\r\n\r\n{"prompt":'
    )
    return s


def test_the_replica_cap_answers_429_before_reading_the_body(sec: Sec) -> None:
    key = sec.add_key("capped", max_priority="system")
    sec.limits_applied()
    held = []
    try:
        for _ in range(CAP):  # `system` may fill the whole cap
            held.append(_hold(sec.b.port, key, "system"))
        t0 = time.monotonic()
        res = wait_for(
            lambda: (x := sec.gen(sec.b, key, priority="system")).status_code == 429 and x,
            5,
            what="429 at cap",
        )
        assert res.json()["error"]["code"] == "overloaded"
        assert res.headers["retry-after"] == "1"
        assert time.monotonic() - t0 < 5
        assert sec.gen(sec.a, key).status_code == 200  # the cap is per replica
    finally:
        for s in held:
            s.close()
    wait_for(lambda: sec.gen(sec.b, key).status_code == 200, 5, what="the cap freed by the disconnects")


def test_under_overload_lower_priority_classes_are_refused_first(sec: Sec) -> None:
    """With one of the cap's two slots taken, `bulk`, `default` and `interactive` (each may fill
    only part of the cap) are refused while `system` still gets in — for a tenant granted it; a
    tenant that asks for more than its grant is lowered to it."""
    ops, plain = sec.add_key("ops", max_priority="system"), sec.add_key("plain")
    sec.limits_applied()

    def gen(key: str, cls: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}", "x-flexlb-priority": cls}
        return httpx.post(sec.b.url + "/v1/generate", json={"prompt": "hi"}, headers=headers, timeout=20)

    held = _hold(sec.b.port, ops, "system")
    try:
        refused = wait_for(lambda: (x := gen(ops, "bulk")).status_code == 429 and x, 5, what="bulk refused")
        err = refused.json()["error"]
        assert err["code"] == "overloaded" and "'bulk'" in err["message"]
        for cls in ("default", "interactive"):
            assert gen(ops, cls).status_code == 429, cls
        assert gen(ops, "system").status_code == 200
        assert gen(plain, "system").status_code == 429  # lowered to interactive: no grant
        for wrong in ("urgent", ""):  # present but empty is a bad value too (schemathesis found it)
            bad = gen(plain, wrong)
            assert bad.status_code == 400 and "x-flexlb-priority" in bad.json()["error"]["message"]
        # the body's `priority` counts like the header: in at the door as `system`, it asks for
        # `bulk` and must fit bulk's share too
        body = {"prompt": "hi", "priority": "bulk"}
        headers = {"Authorization": f"Bearer {ops}", "x-flexlb-priority": "system"}
        low = httpx.post(sec.b.url + "/v1/generate", json=body, headers=headers, timeout=20)
        assert low.status_code == 429 and "'bulk'" in low.json()["error"]["message"], low.text
    finally:
        held.close()
    wait_for(lambda: gen(plain, "bulk").status_code == 200, 5, what="the slot freed by the disconnect")


def test_ids_that_would_change_a_redis_hash_tag_are_refused(sec: Sec) -> None:
    key = sec.add_key("ids")
    for bad in ("a{b}", "x}", "{q:1}"):
        res = sec.gen(sec.a, key, rid=bad)
        assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_request", bad
        path = "/v1/requests/" + bad.replace("{", "%7B").replace("}", "%7D")
        res = httpx.get(sec.a.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=5)
        assert res.status_code == 400, bad
    good = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_from(f"00-{good}-00f067aa0ba902b7-01") == good
    for tp in (f"00-{good[:-1]}}}-00f067aa0ba902b7-01", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "junk"):
        tid = trace_id_from(tp)
        assert re.fullmatch(r"[0-9a-f]{32}", tid) and tid != good and "}" not in tid


# ---- control plane ----------------------------------------------------------------------------
def test_replicas_without_a_token_share_the_clusters_one_and_state_changes_need_post(sec: Sec) -> None:
    for gw in (sec.a, sec.b):  # the token the first replica generated works on the second too
        assert sec.admin("GET", gw, "/admin/stats").status_code == 200
        wrong = httpx.get(gw.url + "/admin/stats", headers={"Authorization": "Bearer nope"}, timeout=5)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    stored = sec.r.get(f"{sec.cluster}:admin_token_sha256")
    assert stored is not None and sec.token.encode() not in stored  # only the hash is kept
    assert sec.b.log().count(sec.token) == 0  # shown once, by the replica that made it
    res = sec.admin("GET", sec.a, "/admin/stats", params={"reset": "true"})
    assert res.status_code == 400 and "POST /admin/stats/reset" in res.json()["error"]["message"]
    assert sec.admin("POST", sec.a, "/admin/stats/reset").status_code == 200
    assert all(v == [] for v in sec.admin("GET", sec.a, "/admin/stats").json()["samples"].values())


# ---- API keys and tenants -----------------------------------------------------------------------
def test_a_key_works_on_both_replicas_and_is_revoked_on_both_within_1s(sec: Sec) -> None:
    out = subprocess.run(
        [*FLEXLB, "keys", "add", "--tenant", "acme", "--redis-url", sec.redis_url, "--cluster", sec.cluster],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    key = out.stdout.strip()
    assert key.startswith("flx_") and key not in str(sec.r.hgetall(f"{sec.cluster}:apikeys"))
    for gw in (sec.a, sec.b):
        res = sec.gen(gw, key)
        assert res.status_code == 200, res.text
    # the OpenAI SDK sends its api_key as `Authorization: Bearer`
    sdk = openai.OpenAI(base_url=sec.b.url + "/v1", api_key=key, max_retries=0, timeout=20)
    chat = sdk.chat.completions.create(
        model="flexlb-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=sec.b.url + "/v1", api_key="flx_00000000_" + "y" * 32, max_retries=0
        ).models.list()
    for bad in (None, "flx_00000000_" + "x" * 32, "not-a-key"):
        res = sec.gen(sec.a, bad)
        assert res.status_code == 401 and res.json()["error"]["code"] == "unauthorized"
    kid = next(
        k["id"] for k in sec.admin("GET", sec.a, "/admin/keys").json()["keys"] if k["tenant"] == "acme"
    )
    models = {"Authorization": f"Bearer {key}"}
    t0 = time.monotonic()
    assert sec.admin("DELETE", sec.b, f"/admin/keys/{kid}").status_code == 200
    for gw in (sec.a, sec.b):
        wait_for(lambda gw=gw: httpx.get(gw.url + "/v1/models", headers=models).status_code == 401, 2)
    elapsed = time.monotonic() - t0
    print(f"\n[keys] revoked on both replicas after {elapsed * 1000:.0f} ms")
    assert elapsed < 1.0


def test_a_disabled_tenant_gets_403(sec: Sec) -> None:
    key = sec.add_key("paused")
    assert sec.admin("PUT", sec.a, "/admin/tenants/paused/limits", json={"disabled": True}).status_code == 200
    sec.limits_applied()
    res = sec.gen(sec.b, key)
    assert res.status_code == 403 and res.json()["error"]["code"] == "forbidden"


def test_another_tenants_request_id_answers_404_on_get_and_delete(sec: Sec) -> None:
    alice, bob = sec.add_key("alice"), sec.add_key("bob")
    rid = f"shared-{uuid.uuid4().hex[:6]}"
    res = sec.gen(sec.a, alice, rid=rid)
    assert res.status_code == 200 and res.json()["request_id"] == rid
    url = f"/v1/requests/{rid}"
    for gw in (sec.a, sec.b):
        mine = httpx.get(gw.url + url, headers={"Authorization": f"Bearer {alice}"}, timeout=5)
        assert mine.status_code == 200 and mine.json()["state"] == "completed"
        theirs = httpx.get(gw.url + url, headers={"Authorization": f"Bearer {bob}"}, timeout=5)
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "not_found"
        gone = httpx.delete(gw.url + url, headers={"Authorization": f"Bearer {bob}"}, timeout=5)
        assert gone.status_code == 404
    # the same client id is bob's own in bob's namespace: no collision, no stored-outcome replay
    res = sec.gen(sec.b, bob, rid=rid, prompt="bob's prompt")
    assert res.status_code == 200 and res.json()["request_id"] == rid
    assert res.json()["usage"]["prompt_tokens"] != 5


def test_a_tenant_over_its_rate_gets_429_with_headers_while_another_is_unaffected(sec: Sec) -> None:
    slow, tok, free = sec.add_key("slow", rps=1), sec.add_key("tok", tpm=10), sec.add_key("free")
    sec.limits_applied()
    first = sec.gen(sec.a, slow)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    over = sec.gen(sec.b, slow)  # the other replica: the bucket is the cluster's
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "rate_limited"
    assert over.headers["retry-after"] == "1"
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert re.fullmatch(r"\d+ms|1s", over.headers["x-ratelimit-reset-requests"])
    for gw in (sec.a, sec.b):  # a tenant without limits is untouched, and gets no headers
        res = sec.gen(gw, free)
        assert res.status_code == 200 and "x-ratelimit-limit-requests" not in res.headers
    # tokens: prompt (5) + max output (3) = 8 of 10 per minute; the next 8 must wait ~36 s
    ok = sec.gen(sec.a, tok, max_new_tokens=3)
    assert ok.status_code == 200 and ok.headers["x-ratelimit-remaining-tokens"] == "2"
    assert ok.headers["x-ratelimit-limit-tokens"] == "10"
    over = sec.gen(sec.b, tok, max_new_tokens=3)
    assert over.status_code == 429 and 30 <= int(over.headers["retry-after"]) <= 40
    streamed = sec.gen(sec.a, tok, max_new_tokens=3, stream=True)  # refused before its first byte
    assert streamed.status_code == 429 and 30 <= int(streamed.headers["retry-after"]) <= 40
    assert streamed.headers.get_list("retry-after") == [streamed.headers["retry-after"]]
    assert "10 tokens/min" in over.json()["error"]["message"]
    assert sec.gen(sec.b, free).status_code == 200


def test_a_refused_client_id_leaves_no_record(sec: Sec) -> None:
    """The limit rides the record's round trip (`_record` for a client id): a refusal writes no
    record, no hold and no live-set entry, so the id is unknown afterwards and free to reuse."""
    key = sec.add_key("once", rps=1)
    sec.limits_applied()
    assert sec.gen(sec.a, key).status_code == 200
    # that took the bucket's last request token: replica a now refuses the tenant at the door,
    # before reading the body (a malformed one gets 429, not 400) and without calling Redis
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    door = httpx.post(sec.a.url + "/v1/generate", content=b"{not json", headers=auth, timeout=5)
    assert door.status_code == 429 and door.json()["error"]["code"] == "rate_limited", door.text
    rid = f"refused-{uuid.uuid4().hex[:6]}"
    over = sec.gen(sec.b, key, rid=rid)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limited"
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    gone = httpx.get(f"{sec.b.url}/v1/requests/{rid}", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    assert gone.status_code == 404
    keys = Keys(sec.cluster)
    scoped = f"once~{rid}"
    assert not sec.r.exists(keys.request(scoped))
    for gw in (sec.a, sec.b):
        assert not sec.r.sismember(keys.origin_requests(gw.replica_id), scoped)
    # once the bucket refills, the same client id runs (its record and hold made inside the gate)
    ok = wait_for(lambda: (x := sec.gen(sec.b, key, rid=rid)).status_code == 200 and x, 5, what="refill")
    assert ok.json()["request_id"] == rid and sec.r.hget(keys.request(scoped), "state") == b"completed"


def test_a_duplicate_of_a_running_id_keeps_the_tenants_concurrency_limit(sec: Sec, worker_pool: Any) -> None:
    """A duplicate of a client id that is running passes the tenant's limit (a slot is free),
    then gets 409. It held a slot of its own: when it ended, it gave back only that one. With the
    id itself as the slot's member, the duplicate's end gave back the running request's slot, and
    the tenant ran 3 requests under a limit of 2."""
    # `system` fills the whole replica cap (2): the tenant's limit is what refuses, not a replica's
    key = sec.add_key("conc", max_concurrent=2, max_priority="system")
    sec.limits_applied()
    slots = inflight_key(sec.cluster, "conc")
    prefill = [w.address for w in worker_pool["prefill"]]
    for addr in prefill:
        worker_call(addr, "configure", formula="3000")  # each request's prefill runs 3 s
    try:
        with ThreadPoolExecutor(2) as pool:
            rid = f"dup-{uuid.uuid4().hex[:6]}"
            first = pool.submit(sec.gen, sec.a, key, rid, "system")
            wait_for(lambda: sec.r.zcard(slots) == 1, 10, what="the first request holds a slot")
            dup = sec.gen(sec.b, key, rid=rid, priority="system")
            assert dup.status_code == 409 and dup.json()["error"]["code"] == "duplicate_request", dup.text
            # the duplicate's own slot goes back (within the 100 ms release flush); the first's stays
            wait_for(lambda: sec.r.zcard(slots) == 1, 10, what="the duplicate's slot given back")
            assert sec.r.zrange(slots, 0, -1)[0].startswith(f"conc~{rid}".encode())
            second = pool.submit(sec.gen, sec.a, key, None, "system")
            wait_for(lambda: sec.r.zcard(slots) == 2, 10, what="the second request holds a slot")
            third = sec.gen(sec.b, key, priority="system")  # two of two are running: refused
            assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limited", third.text
            assert "2 concurrent requests" in third.json()["error"]["message"]
            assert first.result(30).status_code == 200 and second.result(30).status_code == 200
    finally:
        for addr in prefill:
            worker_call(addr, "reset")


def test_the_limit_and_the_round_trip_are_one_command_and_a_refusal_writes_nothing(
    shared_embedded_redis: str,
) -> None:
    """The gate script on a real Redis: the tenant's check and the record, decode hold and
    hand-off it carries cost ONE command; refused, none of them applies (only the bucket's refill
    is written) and the verdict comes back alone."""

    async def go() -> None:
        r = aioredis.from_url(shared_embedded_redis)
        prefix = f"t-gate-{uuid.uuid4().hex[:6]}"
        k = Keys(prefix)
        store = StateStore(r, k)
        lim = Limiter(store, prefix)

        queue_keys = [k.queue("p"), k.queued_ms("p"), k.ledger("p")]

        def handoff_args(rid: str) -> list[Any]:
            return [100, "1.5", '{"rid":"' + rid + '"}', b"\x01\x00\x00\x00", "1"]

        def trip(rid: str) -> list[list[Any]]:
            return [
                ["SADD", k.origin_requests("o"), rid],
                ["EVALSHA", store.sha("create_request"), 1, k.request(rid), "o", "input_tokens", 5],
                ["EVALSHA", store.sha("reserve"), 1, k.reservations("d"), rid, 10, 100],
                ["EVALSHA", store.sha("handoff"), 3, *queue_keys, *handoff_args(rid)],
            ]

        try:
            await r.script_load(GATE)  # as after the first call: a NOSCRIPT costs a load and a rerun
            n0 = store.commands_total
            v, res = await lim.run("t", Limits(rps=1), "a", 8, 60_000, trip("a"))
            assert v.allowed and store.commands_total - n0 == 1
            assert res[:3] == [1, 1, 1] and float(res[3][1]) == 1.5  # each command's own reply
            before = {x: await r.dump(x) for x in await r.keys(f"{prefix}:*") if b":rl" not in x}
            n0 = store.commands_total
            v, res = await lim.run("t", Limits(rps=1), "b", 8, 60_000, trip("b"))
            assert store.commands_total - n0 == 1
            assert not v.allowed and v.reason == "requests" and res == []
            after = {x: await r.dump(x) for x in await r.keys(f"{prefix}:*") if b":rl" not in x}
            assert after == before  # no record, hold, live-set entry or hand-off for "b"
            assert await r.xlen(k.queue("p")) == 1 and not await r.exists(k.request("b"))
        finally:
            await r.delete(*await r.keys(f"{prefix}:*"))
            await r.aclose()

    asyncio.run(go())


def test_concurrency_slots_are_cluster_wide_and_released(shared_embedded_redis: str) -> None:
    """The limiter's script on a real Redis: a tenant's concurrent limit holds across callers, a
    slot is given back on release, and a hold whose request died expires at its deadline."""

    async def go() -> None:
        r = aioredis.from_url(shared_embedded_redis)
        prefix = f"t-lim-{uuid.uuid4().hex[:6]}"
        lim = Limiter(StateStore(r, Keys(prefix)), prefix)
        one = Limits(max_concurrent=1)
        try:
            assert (await lim.admit("t", one, "r1", 10, 60_000)).allowed
            v = await lim.admit("t", one, "r2", 10, 60_000)
            assert not v.allowed and v.reason == "concurrent" and v.retry_after_ms >= 1000
            assert (await lim.admit("u", one, "r3", 10, 60_000)).allowed  # another tenant
            lim.release("t", "r1")  # given back by the next admission itself: no command of its own
            assert (await lim.admit("t", one, "r2", 10, 150)).allowed  # a hold with a 150 ms deadline
            await asyncio.sleep(0.3)  # ...that nobody releases (its origin died)
            assert (await lim.admit("t", one, "r4", 10, 60_000)).allowed
            assert await r.zrange(inflight_key(prefix, "t"), 0, -1) == [b"r4"]
            lim.release("t", "r4")  # no admission follows: the flush gives it back
            await asyncio.sleep(lim.RELEASE_DELAY_S * 3)
            assert await r.zcard(inflight_key(prefix, "t")) == 0
        finally:
            await r.aclose()

    asyncio.run(go())
