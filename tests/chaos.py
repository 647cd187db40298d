"""Load and post-conditions for the chaos suite (tests/test_faults.py, issue 14 Deliver 5).

`Load` sends mixed streaming and non-streaming requests at a fixed rate to whichever gateways are
live, from its own thread and event loop, and classifies each end: `ok` (a full answer; a stream
that ended with its finish and `[DONE]`), `typed` (an HTTP error or SSE error event with a stable
code), `hung` (no end within the client's bound) or `lost` (the connection died without a typed
answer — acceptable only for a replica the case killed). `assert_clean` is the strict
post-condition of every case: nothing non-terminal, held, committed, queued, pending or owed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import redis

from app.state.keys import Keys

TERMINAL = {"completed", "failed", "cancelled", "timed_out", "owner_lost"}


@dataclass
class Result:
    gw: str
    stream: bool
    rid: str
    kind: str  # ok | typed | hung | lost
    code: str = ""
    t0: float = 0.0
    t1: float = 0.0


@dataclass
class Load:
    targets: Callable[[], list[str]]  # base URLs of the gateways to send to now
    rate: float = 20.0
    client_timeout_s: float = 25.0
    request_timeout_ms: int = 20_000
    max_new_tokens: tuple[int, ...] = (4, 8, 16)
    limit: int | None = None  # stop after sending this many
    # Every `fresh_every`-th request (a non-streaming one) leaves its id to the gateway: a fresh id
    # is recorded and handed off in one round trip, and in process when its origin owns the worker
    # (issue 20), the path client ids never take. Its id is read back from the answer.
    fresh_every: int = 4
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True, name="load")
        self._thread.start()
        return self

    def stop(self) -> list[Result]:
        """Stop sending and wait (bounded by the client timeout) for every request to end."""
        self._stop.set()
        return self.wait()

    def wait(self) -> list[Result]:
        """Wait for a `limit`ed load to send everything and for every request to end."""
        assert self._thread is not None
        self._thread.join(self.client_timeout_s + 10)
        assert not self._thread.is_alive(), "load thread did not finish"
        return self.results

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=self.client_timeout_s, limits=limits) as client:
            tasks: list[asyncio.Task[None]] = []
            i = 0
            next_at = time.monotonic()
            while not self._stop.is_set() and (self.limit is None or i < self.limit):
                urls = self.targets()
                if urls:
                    tasks.append(asyncio.create_task(self._one(client, urls[i % len(urls)], i)))
                    i += 1
                next_at += 1 / self.rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, url: str, i: int) -> None:
        stream = i % 2 == 1
        n = self.max_new_tokens[i % len(self.max_new_tokens)]
        rid = f"ld-{uuid.uuid4().hex[:12]}"
        body = {
            "prompt": f"shared chaos prefix {i % 5} " * 8 + str(i),
            "max_new_tokens": n,
            "request_id": rid,
            "timeout_ms": self.request_timeout_ms,
            "stream": stream,
        }
        fresh = i % self.fresh_every == 0 and not stream
        if fresh:
            del body["request_id"]
        res = Result(url, stream, rid, "lost", t0=time.monotonic())
        try:
            async with asyncio.timeout(self.client_timeout_s):
                if stream:
                    res.kind, res.code = await _stream(client, url, body)
                else:
                    resp = await client.post(url + "/v1/generate", json=body)
                    res.kind, res.code = _classify(resp.status_code, resp.content, n)
                    if fresh and res.kind == "ok":
                        res.rid = str(json.loads(resp.content)["request_id"])
        except TimeoutError:
            res.kind = "hung"
        except httpx.TransportError as exc:
            res.kind, res.code = "lost", type(exc).__name__
        res.t1 = time.monotonic()
        self.results.append(res)


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
    async with client.stream("POST", url + "/v1/generate", json=body) as resp:
        if resp.status_code != 200:
            return _classify(resp.status_code, await resp.aread(), 0)
        last: dict | None = None
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            last = json.loads(data)
        if last is not None and "error" in last:
            return "typed", str(last["error"].get("code", ""))
        if done and last is not None and last.get("done"):
            return "ok", ""
        return "lost", "stream ended without an end"


def _classify(status: int, content: bytes, n: int) -> tuple[str, str]:
    try:
        body = json.loads(content)
    except ValueError:
        return "lost", f"http {status} untyped"
    if status == 200:
        ok = n == 0 or len(body.get("output_ids", [])) == n
        return ("ok", "") if ok else ("typed", "short")
    code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
    return ("typed", str(code)) if code else ("lost", f"http {status} untyped")


def summary(results: list[Result]) -> dict[str, int]:
    c = Counter(r.kind for r in results)
    return {"sent": len(results), **{k: c.get(k, 0) for k in ("ok", "typed", "hung", "lost")}}


def problems(r: redis.Redis, keys: Keys, prefill: list[str]) -> list[str]:
    """Everything a case must leave at zero: non-terminal records, decode holds, ledger entries,
    live-set members of live replicas, queue entries (pending or not), queued_ms."""
    left = []
    for raw in r.scan_iter(match=f"{keys.prefix}:*", count=1000):
        key = raw.decode()
        if key.endswith(":req"):
            st = (r.hget(key, "state") or b"").decode()
            if st not in TERMINAL:
                left.append(f"{key} state={st}")
        elif key.endswith(":resv"):
            held = {k: v for k, v in r.hgetall(key).items() if k != b"_total"}
            total = int(r.hget(key, "_total") or 0)
            if held or total:
                left.append(f"{key} {held} total={total}")
        elif key.endswith(":ledger") and r.hlen(key):
            left.append(f"{key} {r.hgetall(key)}")
        elif key.endswith(":live") and r.scard(key):
            left.append(f"{key} {r.smembers(key)}")
        elif key.endswith(":queue"):
            pending = sum(g["pending"] for g in r.xinfo_groups(key))
            if r.xlen(key) or pending:
                left.append(f"{key} len={r.xlen(key)} pending={pending}")
    for wid in prefill:
        q = float(r.get(keys.queued_ms(wid)) or 0)
        if q > 0.01:
            left.append(f"{wid} queued_ms={q}")
    return left


def assert_clean(r: redis.Redis, keys: Keys, prefill: list[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while left := problems(r, keys, prefill):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s still: {left}")
        time.sleep(0.1)


def fresh_batch(urls: list[str], n: int = 20) -> list[Result]:
    """n new requests (mixed streaming) over `urls`; the caller requires every one to succeed."""
    return Load(lambda: urls, rate=40.0, limit=n).start().wait()
