"""The client API end to end (DESIGN §3, §7, §8): two gateway replicas (subprocesses) sharing one
real Redis, the session's real Triton workers, no mocks.

Most tests share one module-scoped pair of replicas whose replica ids are chosen so that rendezvous
hashing gives each replica one of the two prefill workers; both replicas start before the workers
are registered (leases are sticky). Tests that reconfigure workers use `workers_reset`, tests that
change the runtime config put it back. The last test scans the whole cluster prefix for anything
the suite left behind.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from app.cluster.rendezvous import assign
from app.scheduling.formula import DEFAULT_PREFILL_FORMULA
from app.state.keys import Keys
from app.tokens.chat import render_chat
from app.tokens.detok import IncrementalDetokenizer
from app.tokens.tokenizer import ByteTokenizer

from .conftest import worker_call
from .gateways import ADMIN_TOKEN, Gateway, start_gateway, wait_for

MODEL = "flexlb-sim"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TERMINAL = {"completed", "failed", "cancelled", "timed_out", "owner_lost"}


# ---- the cluster under test ------------------------------------------------------------------
@dataclass
class Cluster:
    a: Gateway
    b: Gateway
    keys: Keys
    r: redis.Redis
    prefill: list[str]  # worker ids
    decode: str
    address: dict[str, str]  # worker id → gRPC address

    def other(self, gw: Gateway) -> Gateway:
        return self.b if gw is self.a else self.a

    def owner(self, wid: str) -> str | None:
        lease = self.r.get(self.keys.owner_lease(wid))
        return lease.decode().split("|")[0] if lease else None


def split(wids: list[str], accept: Callable[[dict[str, str], str, str], bool]) -> tuple[str, str]:
    """Two replica ids for which rendezvous hashing gives an ownership `accept` likes."""
    for i in range(10_000):
        a, b = f"gw-a{i}", f"gw-b{i}"
        if accept(assign(wids, [a, b]), a, b):
            return a, b
    raise AssertionError("no suitable replica ids")


def start_pair(
    tmp: Path, redis_url: str, cluster: str, wids: list[str], ids: tuple[str, str]
) -> tuple[Gateway, Gateway]:
    """Both replicas live first, then the workers registered: each takes what rendezvous gives it."""
    gws: list[Gateway] = []
    try:
        with ThreadPoolExecutor(2) as ex:  # both at once: a replica's start-up is mostly imports
            futs = [ex.submit(start_gateway, tmp, redis_url, cluster, FLEXLB_REPLICA_ID=rid) for rid in ids]
        gws = [f.result() for f in futs if f.exception() is None]
        for f in futs:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        a, b = gws
        wait_for(
            lambda: len(a.get("/admin/leases", admin=True).json()["live_replicas"]) == 2, 60, what="2 live"
        )
        assert a.post("/admin/workers", admin=True, json={"workers": ",".join(wids)}).status_code == 200
        expected = assign(wids, list(ids))
        keys = Keys(cluster)
        r = redis.Redis.from_url(redis_url)

        def owned() -> bool:
            leases = {w: r.get(keys.owner_lease(w)) for w in wids}
            return all(v is not None and v.decode().split("|")[0] == expected[w] for w, v in leases.items())

        wait_for(owned, 60, what="leases as rendezvous assigns them")
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="both replicas ready")
        return a, b
    except BaseException:
        for g in gws:
            g.kill()
        raise


def stop_all(*gws: Gateway) -> None:
    with ThreadPoolExecutor(len(gws)) as ex:
        list(ex.map(lambda g: g.stop(), gws))


@pytest.fixture(scope="module")
def pair(worker_pool, shared_embedded_redis, tmp_path_factory) -> Iterator[Cluster]:
    prefill = [f"prefill@{w.address}" for w in worker_pool["prefill"]]
    decode = f"decode@{worker_pool['decode'][0].address}"
    ids = split([*prefill, decode], lambda own, a, b: {own[p] for p in prefill} == {a, b})
    cluster = f"t-api-{uuid.uuid4().hex[:6]}"
    a, b = start_pair(tmp_path_factory.mktemp("api"), shared_embedded_redis, cluster, [*prefill, decode], ids)
    address = {f"{w.role}@{w.address}": w.address for ws in worker_pool.values() for w in ws}
    c = Cluster(a, b, Keys(cluster), redis.Redis.from_url(shared_embedded_redis), prefill, decode, address)
    yield c
    stop_all(a, b)
    c.r.close()


@pytest.fixture(autouse=True)
def _pair_follows_the_pool(request: pytest.FixtureRequest, _pool_worker_crash_is_an_error: None) -> None:
    """conftest replaces a pool worker that died (and fails the test it died in) with a new one on a
    new port: register that one with the module's pair (and drop the dead one) before the test
    uses it."""
    if "pair" not in request.fixturenames:
        return
    c: Cluster = request.getfixturevalue("pair")
    pool = request.getfixturevalue("worker_pool")
    current = {f"{w.role}@{w.address}": w.address for ws in pool.values() for w in ws}
    if set(current) == set(c.address):
        return
    for wid in set(c.address) - set(current):
        httpx.delete(f"{c.a.url}/admin/workers/{wid}", headers=ADMIN, timeout=5)
    added = ",".join(sorted(set(current) - set(c.address)))
    assert c.a.post("/admin/workers", admin=True, json={"workers": added}).status_code == 200
    c.address = current
    c.prefill = sorted(w for w in current if w.startswith("prefill@"))
    c.decode = next(w for w in current if w.startswith("decode@"))
    wait_for(lambda: all(c.owner(w) for w in current), 60, what="the replacement worker owned")
    wait_for(lambda: c.a.readyz()["ready"] and c.b.readyz()["ready"], 60, what="both replicas ready")


# ---- helpers ---------------------------------------------------------------------------------
def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def generate(gw: Gateway, timeout: float = 30.0, **body: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/generate", json=body, timeout=timeout)


def ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def assert_typed(resp: httpx.Response, status: int, code: str) -> None:
    """DESIGN §8: the status and the OpenAI-style body `{"error": {"message", "type", "code"}}`."""
    assert resp.status_code == status, (status, resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err


def printable(text: str) -> bool:
    return all(32 <= ord(ch) < 127 for ch in text)


def set_config(c: Cluster, **patch: str) -> None:
    """PUT the runtime config and wait until both replicas applied that version (/readyz says)."""
    resp = httpx.put(c.a.url + "/admin/config", json=patch, headers=ADMIN, timeout=5)
    assert resp.status_code == 200, resp.text
    version = int(resp.json()["config"]["version"])
    wait_for(
        lambda: all(g.readyz()["config_version"] >= version for g in (c.a, c.b)),
        30,
        what=f"config v{version} applied on both replicas",
    )


def configure_prefill(c: Cluster, **options: Any) -> None:
    for wid in c.prefill:
        assert worker_call(c.address[wid], "configure", **options).get("ok"), options


def engine_holds(c: Cluster, rid: str) -> list[str]:
    """Where the engines still hold `rid`: a queued or running prefill, pinned KV, a live decode."""
    where = []
    for wid in c.prefill:
        st = worker_call(c.address[wid], "status")
        where += [f"{wid}:{b['phase']}" for b in st["live"] if rid in b["request_ids"]]
        if rid in st["pinned"]:
            where.append(f"{wid}:pinned")
    st = worker_call(c.address[c.decode], "status")
    where += [f"{c.decode}:{phase}" for phase, ids in st["live"].items() if rid in ids]
    return where


def prefill_phase(c: Cluster, rid: str) -> str | None:
    for w in engine_holds(c, rid):
        if w.startswith("prefill@") and not w.endswith(":pinned"):
            return w.rsplit(":", 1)[1]
    return None


def state(gw: Gateway, rid: str) -> str | None:
    resp = gw.get(f"/v1/requests/{rid}")
    return resp.json()["state"] if resp.status_code == 200 else None


class RawCall:
    """An HTTP/1.1 request on a plain socket, so a test can hang up mid-request like a client."""

    def __init__(self, gw: Gateway, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        self.sock = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
        self.sock.sendall(head.encode() + data)
        self.buf = b""
        self.eof = False

    def read_until(self, done: Callable[[bytes], bool], timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while not done(self.buf) and not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no answer within {timeout}s; got {self.buf[-400:]!r}")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            self.eof = not chunk
            self.buf += chunk
        return self.buf

    def response(self, timeout: float) -> tuple[int, bytes]:
        """Status and raw body (chunked for streams), read to the end of the connection."""
        self.read_until(lambda _: False, timeout)
        self.sock.close()
        head, _, body = self.buf.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    def hang_up(self) -> None:
        self.sock.close()


# ---- OpenAI compatibility ----------------------------------------------------------------------
def test_openai_sdk_completions_chat_and_streaming_via_both_replicas(pair: Cluster) -> None:
    prompt = "Héllo, wörld — a prompt with multi-byte text ✓"
    n_prompt = len(prompt.encode())
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Qu'est-ce qu'un cache de préfixes ?"},
    ]
    n_chat = len(render_chat(messages, add_generation_prompt=True).encode())
    for gw in (pair.a, pair.b):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert MODEL in [m.id for m in client.models.list().data]

        cmpl = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
        text = cmpl.choices[0].text
        assert len(text) == 12 and printable(text), text
        assert cmpl.choices[0].finish_reason == "length"
        assert cmpl.usage is not None
        assert (cmpl.usage.prompt_tokens, cmpl.usage.completion_tokens) == (n_prompt, 12)
        assert cmpl.usage.total_tokens == n_prompt + 12

        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)  # type: ignore[arg-type]
        content = chat.choices[0].message.content or ""
        assert chat.choices[0].message.role == "assistant"
        assert len(content) == 7 and printable(content), content
        assert chat.usage is not None
        assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (n_chat, 7)

        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=9, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert len(text) == 9 and printable(text), text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 9)

        cstream = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        cchunks = list(cstream)
        content = "".join(ch.choices[0].delta.content or "" for ch in cchunks if ch.choices)
        assert len(content) == 5 and printable(content), content
        usage = cchunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (n_chat, 5)

        # typed errors surface as the SDK's own exception classes
        with pytest.raises(openai.NotFoundError) as nf:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as br:
            client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
        assert br.value.code == "invalid_request"


# ---- detokenisation and the chat template ------------------------------------------------------
def test_utf8_split_across_chunks_is_reassembled() -> None:
    """The simulated engines only emit printable ASCII, so a split character cannot reach the API
    from them: the detokenizer the API streams through is checked on a multi-byte text split at
    every pair of positions (three chunks), plus one id at a time."""
    text = "aé€😀中文 z"
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) > len(text)  # really multi-byte
    for i in range(len(ids) + 1):
        for j in range(i, len(ids) + 1):
            d = IncrementalDetokenizer(tok)
            parts = [d.feed(ids[:i]), d.feed(ids[i:j]), d.feed(ids[j:]), d.flush()]
            assert "".join(parts) == text, (i, j, parts)
            assert not any("\ufffd" in p for p in parts), (i, j, parts)
    d = IncrementalDetokenizer(tok)
    assert "".join([*(d.feed([t]) for t in ids), d.flush()]) == text


def test_streamed_text_equals_the_stored_text(pair: Cluster) -> None:
    """The native stream's per-chunk `text` (the incremental detokenizer) adds up to the text of
    the final outcome, on both replicas."""
    for gw in (pair.a, pair.b):
        texts: list[str] = []
        final: dict[str, Any] = {}
        body = {"prompt": "stream me", "max_new_tokens": 40, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/generate", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("done"):
                    final = ev
                else:
                    texts.append(ev["text"])
        assert final and len(final["output_ids"]) == 40
        assert "".join(texts) + final["text_tail"] == final["text"]
        assert final["text"] == bytes(final["output_ids"]).decode()


def test_http_metrics_keep_the_method_label_bounded(pair: Cluster) -> None:
    """A client can send any token as an HTTP method; the HTTP metrics must not grow a series for
    each one. httptools already refuses unknown methods (400) before the app; behind a parser that
    accepts them (h11), the outermost middleware counts them as `OTHER`."""
    import asyncio

    from app.gateway.app import _BoundedMethod

    odd = f"M{uuid.uuid4().hex[:8].upper()}"
    resp = httpx.request(odd, pair.a.url + "/v1/models", timeout=5)
    assert resp.status_code in (400, 404, 405)
    assert odd not in pair.a.get("/metrics").text

    seen: list[str] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        seen.append(scope["method"])

    mw = _BoundedMethod(inner)
    for method in (odd, "GET", "DELETE"):
        asyncio.run(mw({"type": "http", "method": method}, None, None))
    assert seen == ["OTHER", "GET", "DELETE"]


def test_prefill_only_request_leaves_no_pinned_kv(pair: Cluster) -> None:
    """`max_tokens: 1` never touches decode, so nothing would fetch (and unpin) its KV: the origin
    releases the handle itself instead of leaving it pinned until the handle expires."""
    rid = f"one-{uuid.uuid4().hex[:8]}"
    body = {"prompt": "prefill only " * 20, "max_new_tokens": 1, "request_id": rid}
    resp = httpx.post(pair.a.url + "/v1/generate", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["decode_worker"] == "", resp.text
    wait_for(lambda: not engine_holds(pair, rid), 5, what="prefill KV released")


def test_chat_turns_keep_a_prefix_and_reuse_the_cache(pair: Cluster, workers_reset) -> None:
    """The template renders turn n as a prefix of turn n+1, so through the real API every turn's
    prompt is longer and its cached tokens grow (cost routing sends it to the cache holder). The
    workers model the gateway's own formula, so predicted and actual prefill times agree, and the
    system prompt is long enough (~2K tokens) that a hit beats the near-tie margin (20 ms)."""
    configure_prefill(pair, formula=DEFAULT_PREFILL_FORMULA)
    client = openai.OpenAI(base_url=pair.a.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful assistant for cache experiments. " * 40},
        {"role": "user", "content": "Explain prefix caching in one line."},
    ]
    prompts: list[int] = []
    cached: list[int] = []
    for turn in range(3):
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)  # type: ignore[arg-type]
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        assert resp.usage.prompt_tokens == len(render_chat(messages, add_generation_prompt=True).encode())
        prompts.append(resp.usage.prompt_tokens)
        cached.append(resp.usage.prompt_tokens_details.cached_tokens or 0)
        reply = resp.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"And what about turn {turn + 2}?"},
        ]
    assert prompts[0] < prompts[1] < prompts[2], prompts
    assert cached[0] < cached[1] < cached[2], cached
    for n in (1, 2):  # every full block of the previous turn's prompt is reused
        assert cached[n] >= prompts[n - 1] // 64 * 64, (prompts, cached)
        assert cached[n] < prompts[n]


# ---- routing -----------------------------------------------------------------------------------
def test_cost_routes_to_the_cache_holder_round_robin_alternates_owners_anywhere(
    pair: Cluster, workers_reset
) -> None:
    # The workers model the gateway's own formula: a worker that finishes far sooner than predicted
    # would look busy (owed time) until its owner's next snapshot and blur the cost comparison.
    configure_prefill(pair, formula=DEFAULT_PREFILL_FORMULA)
    rng = random.Random(7)
    for origin in (pair.a, pair.b):
        ids = [rng.randrange(32, 127) for _ in range(4096)]
        first = ok(generate(origin, input_ids=ids, max_new_tokens=2))
        holder = first["prefill_worker"]
        assert first["cached_tokens"] == 0
        # Right after the first completes: only the origin's speculative entry knows where it went.
        second = ok(generate(origin, input_ids=[*ids, *b"-two"], max_new_tokens=2))
        assert second["prefill_worker"] == holder
        assert second["cached_tokens"] >= 4096 - 64, second
        # The other replica learns it from the owner's cache diffs and routes there as well.
        other = pair.other(origin)
        wait_for(
            lambda other=other, ids=ids, holder=holder: (
                other.post("/admin/cache/match", admin=True, json={"input_ids": ids}).json()["match"][holder]
                >= 63
            ),
            5,
            what="the other replica's mirror holds the prefix",
        )
        third = ok(generate(other, input_ids=[*ids, *b"-three"], max_new_tokens=2))
        assert third["prefill_worker"] == holder
        assert third["cached_tokens"] >= 4096 - 64, third

    set_config(pair, prefill_strategy="round_robin")
    try:
        ids = [rng.randrange(32, 127) for _ in range(1024)]
        for origin in (pair.a, pair.b):
            outs = [ok(generate(origin, input_ids=ids, max_new_tokens=3)) for _ in range(4)]
            picks = [o["prefill_worker"] for o in outs]
            assert all(x != y for x, y in itertools.pairwise(picks)), picks  # cache or not
            assert set(picks) == set(pair.prefill)
            assert all(len(o["output_ids"]) == 3 for o in outs)
            # one of the two workers is owned by each replica, so this origin's requests ran on a
            # worker owned by the other replica too, and completed
            assert {pair.owner(w) for w in picks} == {pair.a.replica_id, pair.b.replica_id}
            for o in outs:
                assert state(pair.other(origin), o["request_id"]) == "completed"
    finally:
        set_config(pair, prefill_strategy="cost")


# ---- bad input ---------------------------------------------------------------------------------
# Excluded from the "nothing changed" snapshot, because they change on their own: owner
# snapshots (`:snap`, rewritten every poll), cache diff streams and their snapshots (`:cache`,
# `:cache_snap`, published every poll, for decode workers too), membership (`members`, `:member`,
# heartbeats) and leases (`lease:*`, `:owner`, renewed). Hand-off queues are compared by length,
# last id and pending count, since every blocked XREADGROUP of the owner touches the consumer's
# seen-time. Everything a request writes (`:req`, `:resv`, `:queue`, `:queued_ms`, `:ledger`,
# `:tomb`, `:live`, `:replies`) is compared in full.
EXCLUDED_SUFFIXES = (":snap", ":cache", ":cache_snap", ":member", ":members", ":owner")


def redis_state(c: Cluster) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw in c.r.scan_iter(match=f"{c.keys.prefix}:*", count=1000):
        key = raw.decode()
        if key.endswith(EXCLUDED_SUFFIXES) or ":lease:" in key:
            continue
        kind = c.r.type(key).decode()
        if kind == "string":
            out[key] = c.r.get(key)
        elif kind == "hash":
            out[key] = c.r.hgetall(key)
        elif kind == "set":
            out[key] = c.r.smembers(key)
        elif kind == "zset":
            out[key] = c.r.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            info = c.r.xinfo_stream(key)
            groups = c.r.xinfo_groups(key)
            out[key] = (info["length"], info["last-generated-id"], [g["pending"] for g in groups])
    return out


def test_bad_inputs_are_typed_4xx_and_change_nothing_in_redis(pair: Cluster) -> None:
    a, b = pair.a, pair.b
    cases: list[tuple[Gateway, str, Any, dict[str, str], int, str]] = [
        (a, "/v1/completions", b'{"model": "flexlb-sim", "prompt": "x"', {}, 400, "invalid_request"),
        (b, "/v1/chat/completions", b"not json at all", {}, 400, "invalid_request"),
        (a, "/v1/completions", [1, 2], {}, 400, "invalid_request"),
        (
            a,
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": "5"},
            {},
            400,
            "invalid_request",
        ),
        (
            b,
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 2.5},
            {},
            400,
            "invalid_request",
        ),
        (a, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, {}, 400, "invalid_request"),
        (b, "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, {}, 400, "invalid_request"),
        (a, "/v1/chat/completions", {"model": MODEL, "messages": []}, {}, 400, "invalid_request"),
        (
            b,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
            {},
            400,
            "invalid_request",
        ),
        (a, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, {}, 400, "invalid_request"),
        (b, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, {}, 400, "invalid_request"),
        (
            a,
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 10**9},
            {},
            400,
            "invalid_request",
        ),
        (
            b,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            {},
            400,
            "invalid_request",
        ),
        (a, "/v1/generate", {"prompt": "x", "max_new_tokens": -3}, {}, 400, "invalid_request"),
        (a, "/v1/completions", {"model": MODEL, "prompt": ""}, {}, 400, "invalid_request"),
        (b, "/v1/generate", {"prompt": ""}, {}, 400, "invalid_request"),
        (a, "/v1/generate", {"input_ids": []}, {}, 400, "invalid_request"),
        (b, "/v1/generate", {}, {}, 400, "invalid_request"),
        (a, "/v1/completions", {"model": MODEL, "prompt": [1, -3]}, {}, 400, "invalid_request"),
        (b, "/v1/generate", {"input_ids": [1, 256]}, {}, 400, "invalid_request"),
        (a, "/v1/generate", {"prompt": "x", "timeout_ms": 0}, {}, 400, "invalid_request"),
        (b, "/v1/generate", {"prompt": "x", "request_id": "has space"}, {}, 400, "invalid_request"),
        (
            a,
            "/v1/completions",
            {"model": MODEL, "prompt": "x"},
            {"x-request-id": "a{b}"},
            400,
            "invalid_request",
        ),
        (b, "/v1/generate", {"prompt": "x", "unknown": 1}, {}, 400, "invalid_request"),
        (a, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, {}, 400, "invalid_request"),
        (a, "/v1/completions", {"model": "gpt-4", "prompt": "x"}, {}, 404, "model_not_found"),
        (
            b,
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
            {},
            404,
            "model_not_found",
        ),
        (b, "/v1/generate", {"prompt": "x", "model": "gpt-4"}, {}, 404, "model_not_found"),
    ]
    before = redis_state(pair)
    for gw, path, body, headers, status, code in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = httpx.post(
            gw.url + path,
            content=content,
            headers={"content-type": "application/json", **headers},
            timeout=10,
        )
        assert_typed(resp, status, code)
    after = redis_state(pair)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, changed


def test_duplicate_of_a_live_request_is_409_on_either_replica(pair: Cluster, workers_reset) -> None:
    configure_prefill(pair, formula="4000")  # live long enough for every duplicate, even on a busy host
    rid = uid("dup")
    result: dict[str, httpx.Response] = {}
    th = threading.Thread(
        target=lambda: result.setdefault(
            "r", generate(pair.a, prompt="original", max_new_tokens=3, request_id=rid)
        )
    )
    th.start()
    wait_for(lambda: prefill_phase(pair, rid) == "running", 5, what="original in prefill")
    for gw in (pair.a, pair.b):  # the origin itself and the other replica
        assert_typed(
            generate(gw, prompt="impostor", max_new_tokens=9, request_id=rid), 409, "duplicate_request"
        )
        resp = httpx.post(
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": "impostor", "max_tokens": 2},
            headers={"x-request-id": rid},
            timeout=10,
        )
        assert_typed(resp, 409, "duplicate_request")
    th.join(15)
    # the original is untouched by its duplicates, even the one on its own replica
    out = ok(result["r"])
    assert len(out["output_ids"]) == 3
    rec = pair.b.get(f"/v1/requests/{rid}").json()
    assert rec["state"] == "completed" and rec["origin"] == pair.a.replica_id


def test_retry_of_a_finished_request_returns_the_stored_outcome(pair: Cluster) -> None:
    rid = uid("retry")
    first = ok(generate(pair.a, prompt="remember me", max_new_tokens=6, request_id=rid))
    t = first["timings"]
    assert 0 <= t["queue_ms"] <= t["first_token_ms"] <= t["total_ms"], t
    again = ok(generate(pair.b, prompt="something else", max_new_tokens=2, request_id=rid))
    for k in ("output_ids", "prefill_worker", "decode_worker", "batch_id", "text"):
        assert again[k] == first[k], k
    body = {"prompt": "x", "max_new_tokens": 6, "request_id": rid, "stream": True}
    with httpx.stream("POST", pair.b.url + "/v1/generate", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    assert events[-1]["done"] and events[-1]["output_ids"] == first["output_ids"]
    cmpl = httpx.post(
        pair.b.url + "/v1/completions",
        json={"model": MODEL, "prompt": "y", "max_tokens": 6},
        headers={"x-request-id": rid},
        timeout=10,
    )
    assert ok(cmpl)["choices"][0]["text"] == first["text"]
    rec = pair.b.get(f"/v1/requests/{rid}").json()
    assert rec["state"] == "completed" and rec["outcome"]["output_ids"] == first["output_ids"]


# ---- cancel ------------------------------------------------------------------------------------
def cancel(c: Cluster, call: RawCall, rid: str, how: str) -> None:
    if how == "disconnect":
        call.hang_up()
        return
    resp = httpx.delete(c.b.url + f"/v1/requests/{rid}", timeout=5)  # every call here went to A
    assert resp.status_code == 202 and resp.json()["cancelled"], resp.text


def wait_clear(problems: Callable[[], list[str]], timeout: float) -> None:
    """Bounded poll until `problems()` lists nothing; fails with what was still listed."""
    deadline = time.monotonic() + timeout
    while left := problems():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s still: {left}")
        time.sleep(0.05)


def assert_gone(c: Cluster, rid: str) -> None:
    """The engines show no work for `rid`, nothing stays reserved, and the lifecycle ended cancelled."""

    def problems() -> list[str]:
        left = engine_holds(c, rid)
        if c.r.hexists(c.keys.reservations(c.decode), rid):
            left.append("decode KV reserved")
        if (st := state(c.b, rid)) != "cancelled":
            left.append(f"lifecycle {st}")
        return left

    wait_clear(problems, 5)


@pytest.mark.parametrize("how", ["delete_on_other_replica", "disconnect"])
def test_cancel_in_queue_in_prefill_and_in_decode(pair: Cluster, workers_reset, how: str) -> None:
    a = pair.a
    set_config(pair, prefill_strategy="round_robin")  # a's picks: worker 1, worker 2, worker 1, ...
    # Blocker 1 runs until it is cancelled (30 s modelled), blocker 2 on the other worker ends by
    # itself (8 s): a fixed 4 s blocker 1 had finished before its cancel at load ~20.
    configure_prefill(pair, formula="30000")
    try:
        b1, b2, victim = uid("blocker1"), uid("blocker2"), uid("queued")
        calls = {}
        for rid in (b1, b2, victim):
            calls[rid] = RawCall(a, "/v1/generate", {"prompt": rid, "max_new_tokens": 4, "request_id": rid})
            want = "queued" if rid == victim else "running"
            wait_for(lambda rid=rid, want=want: prefill_phase(pair, rid) == want, 30, what=f"{rid} {want}")
            if rid == b1:
                w1 = engine_holds(pair, b1)[0].rsplit(":", 1)[0]
                for wid in pair.prefill:
                    if wid != w1:
                        assert worker_call(pair.address[wid], "configure", formula="8000").get("ok")

        # in queue: behind blocker 1 on the same worker
        cancel(pair, calls[victim], victim, how)
        assert_gone(pair, victim)
        # in prefill: blocker 1 is running on the engine
        assert prefill_phase(pair, b1) == "running"
        cancel(pair, calls[b1], b1, how)
        assert_gone(pair, b1)
        if how != "disconnect":
            for rid in (victim, b1):
                status, body = calls[rid].response(5)
                assert status == 499 and json.loads(body)["error"]["code"] == "cancelled", body
        # the neighbour was not disturbed
        status, body = calls[b2].response(30)
        assert status == 200 and len(json.loads(body)["output_ids"]) == 4

        # in decode: a long generation streaming tokens (decode at time scale 1)
        configure_prefill(pair, formula="1")
        d = uid("decoding")
        call = RawCall(
            a, "/v1/generate", {"prompt": d, "max_new_tokens": 3000, "stream": True, "request_id": d}
        )
        call.read_until(lambda buf: buf.count(b"data: ") >= 3, 10)
        assert f"{pair.decode}:running" in engine_holds(pair, d)
        cancel(pair, call, d, how)
        assert_gone(pair, d)
        if how != "disconnect":  # the stream ends with a typed SSE error event, not a silent close
            status, body = call.response(5)
            assert status == 200 and b'"code":"cancelled"' in body and b"data: [DONE]" in body, body[-300:]
        assert int(pair.r.hget(pair.keys.reservations(pair.decode), "_total") or 0) == 0
    finally:
        set_config(pair, prefill_strategy="cost")


# ---- a dead owner ------------------------------------------------------------------------------
def test_owner_killed_mid_request_completes_and_leaves_nothing(
    worker_pool, workers_reset, shared_embedded_redis, tmp_path
) -> None:
    """Client on A, the prefill worker's owner is B, and B is SIGKILLed while the slow prefill runs.
    The request completes or ends with a typed error by its deadline; it never hangs."""
    p0 = worker_pool["prefill"][0]
    wid, dec = f"prefill@{p0.address}", f"decode@{worker_pool['decode'][0].address}"
    ids = split([wid, dec], lambda own, a, b: own[wid] == b)
    cluster = f"t-api-kill-{uuid.uuid4().hex[:6]}"
    a, b = start_pair(tmp_path, shared_embedded_redis, cluster, [wid, dec], ids)
    keys, r = Keys(cluster), redis.Redis.from_url(shared_embedded_redis)
    try:
        assert worker_call(p0.address, "configure", formula="3000")["ok"]
        rid, timeout_ms = uid("orphan"), 8000
        result: dict[str, Any] = {}

        def call() -> None:
            t0 = time.monotonic()
            result["resp"] = generate(
                a,
                timeout=timeout_ms / 1000 + 30,
                prompt="slow",
                max_new_tokens=4,
                request_id=rid,
                timeout_ms=timeout_ms,
            )
            result["s"] = time.monotonic() - t0

        th = threading.Thread(target=call, daemon=True)
        th.start()

        def running() -> bool:
            return any(rid in x["request_ids"] for x in worker_call(p0.address, "status")["live"])

        wait_for(running, 5, what="the prefill running on B's worker")
        b.kill()
        th.join(timeout_ms / 1000 + 10)
        assert not th.is_alive(), "the request hung past its deadline"
        assert result["s"] <= timeout_ms / 1000 + 4, result["s"]
        resp = result["resp"]
        # Full survival (issue 14): the new owner adopts the running prefill and delivers it.
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["output_ids"]) == 4
        wait_for(
            lambda: (r.get(keys.owner_lease(wid)) or b"").startswith(a.replica_id.encode()),
            10,
            what="lease moved",
        )
        end = a.get(f"/v1/requests/{rid}").json()["state"]
        assert end == "completed", end
        assert not r.hexists(keys.reservations(dec), rid)
        assert int(r.hget(keys.reservations(dec), "_total") or 0) == 0

        def engine_clear() -> bool:
            st = worker_call(p0.address, "status")
            held = any(rid in x["request_ids"] for x in st["live"]) or rid in st["pinned"]
            dlive = worker_call(worker_pool["decode"][0].address, "status")["live"]
            return not held and not any(rid in ids for ids in dlive.values())

        wait_for(engine_clear, 8, what="no engine work left for the request")
        # the dead owner's hand-off entry did not stay pending: the new owner settled it
        assert_no_residue(r, keys, 5)
    finally:
        b.kill()
        a.stop()
        r.close()


# ---- after the load ------------------------------------------------------------------------------
def residue(r: redis.Redis, keys: Keys) -> list[str]:
    """Anything the request path left behind under the cluster prefix: a lifecycle not terminal, a
    decode reservation, a ledger entry, an origin's live-set member, a hand-off entry."""
    left = []
    for raw in r.scan_iter(match=f"{keys.prefix}:*", count=1000):
        key = raw.decode()
        if key.endswith(":req"):
            st = (r.hget(key, "state") or b"").decode()
            if st not in TERMINAL:
                left.append(f"{key} state={st}")
        elif key.endswith((":resv", ":ledger")) and r.hlen(key):
            left.append(f"{key} {r.hgetall(key)}")
        elif key.endswith(":live") and r.scard(key):
            left.append(f"{key} {r.smembers(key)}")
        elif key.endswith(":queue"):
            pending = sum(g["pending"] for g in r.xinfo_groups(key))
            if r.xlen(key) or pending:
                left.append(f"{key} len={r.xlen(key)} pending={pending}")
    return left


def assert_no_residue(r: redis.Redis, keys: Keys, timeout: float) -> None:
    """Bounded wait: owners settle and acknowledge just after the origin answered its client."""
    wait_clear(lambda: residue(r, keys), timeout)


def test_no_reservation_ledger_or_live_lifecycle_left_after_concurrent_load(pair: Cluster) -> None:
    """40 concurrent requests over both replicas and every endpoint; then nothing under the
    cluster prefix is reserved, committed, queued or non-terminal (this runs last in the module,
    so it also covers what the earlier tests' cancels and failures left)."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        gw = (pair.a, pair.b)[i % 2]
        n = 3 + i % 5
        kind = i % 4
        if kind == 0:
            resp = await client.post(
                gw.url + "/v1/completions", json={"model": MODEL, "prompt": f"load {i}", "max_tokens": n}
            )
            return int(resp.json()["usage"]["completion_tokens"]) if resp.status_code == 200 else -1
        if kind == 1:
            msgs = [{"role": "user", "content": f"load {i}"}]
            resp = await client.post(
                gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": n}
            )
            return int(resp.json()["usage"]["completion_tokens"]) if resp.status_code == 200 else -1
        if kind == 2:
            resp = await client.post(
                gw.url + "/v1/generate", json={"prompt": f"load {i}", "max_new_tokens": n}
            )
            return len(resp.json()["output_ids"]) if resp.status_code == 200 else -1
        body = {"prompt": f"load {i}", "max_new_tokens": n, "stream": True}
        async with client.stream("POST", gw.url + "/v1/generate", json=body) as resp:
            lines = [x async for x in resp.aiter_lines() if x.startswith("data: {")]
        return len(json.loads(lines[-1][6:])["output_ids"]) if resp.status_code == 200 else -1

    async def load() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    got = asyncio.run(load())
    assert got == [3 + i % 5 for i in range(40)]
    assert_no_residue(pair.r, pair.keys, 5)
