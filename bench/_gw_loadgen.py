"""The gateway-overhead benchmark's load generator, in its own process (see bench/gateway_overhead.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import uvloop
from lean_http import HttpError, LeanClient  # bench/ is sys.path[0] when run as a script

TOKEN_LO, TOKEN_HI = 32, 127  # printable bytes: valid ids for the default byte tokenizer
REQUEST_TIMEOUT_S = 30.0
# Open loop: at most this many requests in flight from the client. A request due while the cap is
# reached is not sent and counts as `client_cap_skipped` (the system is already overloaded by then);
# without a cap an overloaded run piles thousands of requests (and connections) onto the gateways
# and the load generator's own bookkeeping.
OPEN_LOOP_MAX_INFLIGHT = 256


# The request dialects: FlexLB's native `/v1/generate` (token ids in, `output_ids` out) and the
# OpenAI `/v1/completions` that the peer routers take in P/D mode (the same printable-byte prompt as
# text: the facades' byte tokenizer makes it the same number of tokens; `usage` counts the output).
API_PATH = {"flexlb": "/v1/generate", "completions": "/v1/completions"}
PEER_MODEL = "flexlb-sim"  # the facades' default `--model`


def _peer_doc(rng: np.random.Generator, n_tokens: int, max_new: int) -> dict[str, Any]:
    text = bytes(rng.integers(TOKEN_LO, TOKEN_HI, n_tokens).astype(np.uint8).tolist()).decode()
    return {"model": PEER_MODEL, "prompt": text, "max_tokens": max_new, "stream": False}


def _body(rng: np.random.Generator, n_tokens: int, max_new: int, api: str = "flexlb") -> bytes:
    if api == "completions":
        return json.dumps(_peer_doc(rng, n_tokens, max_new)).encode()
    ids = rng.integers(TOKEN_LO, TOKEN_HI, n_tokens)
    return b'{"input_ids":[' + ",".join(map(str, ids.tolist())).encode() + b'],"max_new_tokens":%d}' % max_new


def _n_out(o: dict[str, Any], api: str) -> int:
    """Tokens generated, as the answer states them."""
    if api == "completions":
        return int((o.get("usage") or {}).get("completion_tokens", -1))
    return len(o.get("output_ids", ()))


class _Clients:
    """One `LeanClient` pool per gateway URL, `n` connections each; httpx cost the box a quarter
    of its CPU at 100 req/s (see bench/lean_http.py)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pools: dict[str, LeanClient] = {}

    def pool(self, url: str) -> LeanClient:
        c = self.pools.get(url)
        if c is None:
            c = self.pools[url] = LeanClient(url, self.n, REQUEST_TIMEOUT_S)
        return c

    async def __aenter__(self) -> _Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.pools.values():
            await c.aclose()


def _client(n: int) -> _Clients:
    return _Clients(n)


async def _one(client: _Clients, url: str, body: bytes, max_new: int, api: str = "flexlb") -> str:
    """One call in the `api` dialect; the outcome code ('ok' or the error code)."""
    try:
        status, raw = await client.pool(url).post(API_PATH[api], body)
    except HttpError as exc:
        return f"transport:{type(exc).__name__}"
    try:
        o = json.loads(raw)
    except ValueError:
        return "bad_json" if status == 200 else f"http_{status}"
    if status == 200:
        return "ok" if _n_out(o, api) == max_new else "bad_output"
    try:
        return str(o["error"]["code"])
    except (KeyError, TypeError):
        return f"http_{status}"


async def lg_open_loop(
    urls: list[str], rate: float, duration: float, n_tokens: int, max_new: int, seed: int
) -> dict[str, Any]:
    """Requests at fixed instants t0 + i/rate, alternating replicas, each in its own task; latency
    counts from the scheduled instant (no coordinated omission). Bodies are made up front."""
    n = int(rate * duration)
    rng = np.random.default_rng(seed)
    bodies = [_body(rng, n_tokens, max_new) for _ in range(n)]
    loop = asyncio.get_running_loop()
    lat: list[float] = [float("nan")] * n
    codes: list[str] = [""] * n
    lags: list[float] = []
    inflight = 0
    async with _client(OPEN_LOOP_MAX_INFLIGHT) as client:

        async def go(i: int, at: float) -> None:
            nonlocal inflight
            inflight += 1
            try:
                codes[i] = await _one(client, urls[i % len(urls)], bodies[i], max_new)
                lat[i] = (loop.time() - at) * 1000
            finally:
                inflight -= 1

        tasks = []
        t0 = loop.time() + 0.1
        for i in range(n):
            at = t0 + i / rate
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append((loop.time() - at) * 1000)
            if inflight >= OPEN_LOOP_MAX_INFLIGHT:
                codes[i] = "client_cap_skipped"
                continue
            tasks.append(asyncio.create_task(go(i, at)))
        t_sent = loop.time()
        _, pending = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
        t_end = loop.time()
    return {
        "scheduled": n,
        "sent": len(tasks),
        "send_s": t_sent - t0,
        "wall_s": t_end - t0,
        "latency_ms": [x for x in lat if x == x],
        "codes": dict(Counter(c or "no_answer_in_time" for c in codes)),
        "send_lag_ms": lags,
    }


async def lg_closed_loop(
    urls: list[str],
    concurrency: int,
    duration: float,
    n_tokens: int,
    max_new: int,
    seed: int,
    api: str = "flexlb",
) -> dict[str, Any]:
    """`concurrency` clients, each sending its next request when the previous one answers,
    until `duration` has passed (in-flight requests are then awaited, bounded)."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    codes: Counter[str] = Counter()
    done_at: list[float] = []
    async with _client(max(16, 2 * concurrency)) as client:
        t0 = loop.time()
        stop_at = t0 + duration

        async def worker(k: int) -> None:
            rng = np.random.default_rng([seed, k])
            url = urls[k % len(urls)]
            while loop.time() < stop_at:
                body = _body(rng, n_tokens, max_new, api)
                t = loop.time()
                code = await _one(client, url, body, max_new, api)
                now = loop.time()
                codes[code] += 1
                if code == "ok":
                    lat.append((now - t) * 1000)
                done_at.append(now)

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration + REQUEST_TIMEOUT_S + 5)
        for t in pending:
            t.cancel()
    return {
        "concurrency": concurrency,
        "duration_s": duration,
        "elapsed_s": (max(done_at) - t0) if done_at else duration,
        "latency_ms": lat,
        "codes": dict(codes),
    }


@contextlib.asynccontextmanager
async def _worker_clients(
    prefill: list[tuple[str, str]], decode: list[tuple[str, str]]
) -> AsyncIterator[tuple[list[tuple[Any, str, str]], list[tuple[Any, str]]]]:
    """The product's clients for the direct path, (client, epoch, address) per prefill worker and
    (client, epoch) per decode worker, closed when the phase ends. A close that fails is reported,
    not raised: the phase's figures are already taken."""
    from app.rpc.worker_client import WorkerClient

    pcs = [(WorkerClient(a), e, a) for a, e in prefill]
    dcs = [(WorkerClient(a), e) for a, e in decode]
    try:
        yield pcs, dcs
    finally:
        for c in [p[0] for p in pcs] + [d[0] for d in dcs]:
            try:
                await c.close()
            except Exception as exc:  # any close failure is reported; the figures are taken
                print(f"loadgen: closing a worker client failed: {exc!r}", file=sys.stderr)


async def _direct_one(
    pre: tuple[Any, str, str],
    dec: tuple[Any, str],
    rid: str,
    ids: np.ndarray,
    max_new: int,
) -> tuple[float, str]:
    """Prefill on one worker, then decode on another fetching that KV, as the gateway does: the
    decode starts at the prefill `results` event (the prefill stream's `final` is drained beside
    it), and it asks for max_new - 1 tokens (the first comes from prefill)."""
    pc, p_epoch, p_addr = pre
    dc, d_epoch = dec
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[str, str]] = loop.create_future()

    async def run_prefill() -> None:
        try:
            async for ev in pc.prefill(f"b-{rid}", p_epoch, [(rid, ids)], timeout=REQUEST_TIMEOUT_S):
                if ev.event == "results" and not got.done():
                    got.set_result((ev.results[0]["status"], ev.epoch))
                elif ev.event == "error" and not got.done():
                    got.set_result((f"prefill_error:{ev.error[:60]}", ""))
        except Exception as exc:
            if not got.done():
                got.set_result((f"prefill:{type(exc).__name__}: {str(exc)[-120:]}", ""))
        if not got.done():
            got.set_result(("prefill:no_result", ""))

    t0 = time.perf_counter()
    ptask = asyncio.create_task(run_prefill())
    status, kv_epoch = await got
    code = status
    if status == "ok":
        n = 0
        finish = ""
        try:
            async with contextlib.aclosing(
                dc.decode(
                    rid,
                    d_epoch,
                    len(ids),
                    max_new - 1,
                    kv_worker=p_addr,
                    kv_epoch=kv_epoch,
                    timeout=REQUEST_TIMEOUT_S,
                )
            ) as events:
                async for ev in events:
                    if ev.event == "tokens":
                        n += len(ev.tokens)
                    else:
                        finish = ev.finish_reason
                        break
            code = "ok" if finish == "length" and n == max_new - 1 else f"decode:{finish or 'none'}"
        except Exception as exc:
            code = f"decode:{type(exc).__name__}: {str(exc)[-120:]}"
    ms = (time.perf_counter() - t0) * 1000
    await ptask
    return ms, code


async def lg_e2e(
    urls: list[str],
    prefill: list[tuple[str, str]],
    decode: list[tuple[str, str]],
    n: int,
    n_tokens: int,
    max_new: int,
    seed: int,
) -> dict[str, Any]:
    """n sequential requests through the gateway interleaved with n straight to the workers (same
    prompt sizes, fresh random prompts each: no prefix-cache hits on either path)."""
    rng = np.random.default_rng(seed)
    gw_ms: list[float] = []
    dir_ms: list[float] = []
    gw_url: list[int] = []  # which of `urls` answered each of gw_ms (they alternate)
    gw_codes: Counter[str] = Counter()
    dir_codes: Counter[str] = Counter()
    dir_cpu_s = 0.0  # this process's CPU (all threads) while it made the direct calls: nothing else runs
    async with _worker_clients(prefill, decode) as (pcs, dcs), _client(8) as client:
        for i in range(n):
            body = _body(rng, n_tokens, max_new)
            t = time.perf_counter()
            code = await _one(client, urls[i % len(urls)], body, max_new)
            gw_codes[code] += 1
            if code == "ok":
                gw_ms.append((time.perf_counter() - t) * 1000)
                gw_url.append(i % len(urls))
            ids = rng.integers(TOKEN_LO, TOKEN_HI, n_tokens).astype(np.int32)
            rid = f"direct-{seed}-{i}-{uuid.uuid4().hex[:6]}"
            c0 = time.process_time()
            ms, code = await _direct_one(pcs[i % len(pcs)], dcs[i % len(dcs)], rid, ids, max_new)
            dir_cpu_s += time.process_time() - c0
            dir_codes[code] += 1
            if code == "ok":
                dir_ms.append(ms)
    return {
        "gateway_ms": gw_ms,
        "gateway_url": gw_url,
        "direct_ms": dir_ms,
        "gateway_codes": dict(gw_codes),
        "direct_codes": dict(dir_codes),
        "direct_client_cpu_ms": dir_cpu_s * 1000 / max(1, len(dir_ms)),
    }


async def lg_direct_closed(
    prefill: list[tuple[str, str]],
    decode: list[tuple[str, str]],
    concurrency: int,
    duration: float,
    n_tokens: int,
    max_new: int,
    seed: int,
) -> dict[str, Any]:
    """`concurrency` clients making the gateway's two gRPC calls straight to the workers
    (`_direct_one`) in a closed loop: the CPU those calls alone cost the product's client
    (`WorkerClient`, grpc.aio) per request, the floor under the gateway's own CPU per request."""
    loop = asyncio.get_running_loop()
    codes: Counter[str] = Counter()
    async with _worker_clients(prefill, decode) as (pcs, dcs):
        stop_at = loop.time() + duration
        c0, t0 = time.process_time(), loop.time()

        async def worker(k: int) -> None:
            rng = np.random.default_rng([seed, k])
            i = 0
            while loop.time() < stop_at:
                ids = rng.integers(TOKEN_LO, TOKEN_HI, n_tokens).astype(np.int32)
                rid = f"dclosed-{seed}-{k}-{i}-{uuid.uuid4().hex[:6]}"
                _, code = await _direct_one(pcs[k % len(pcs)], dcs[k % len(dcs)], rid, ids, max_new)
                codes[code] += 1
                i += 1

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration + REQUEST_TIMEOUT_S + 5)
        for t in pending:
            t.cancel()
        cpu_s, wall_s = time.process_time() - c0, loop.time() - t0
    n = sum(codes.values())
    return {
        "concurrency": concurrency,
        "rps": n / wall_s if wall_s else 0.0,
        "client_cpu_ms_per_req": cpu_s * 1000 / max(1, n),
        "codes": dict(codes),
    }


async def lg_sequential(
    urls: list[str], n: int, n_tokens: int, max_new: int, seed: int, api: str = "flexlb"
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    codes: Counter[str] = Counter()
    async with _client(8) as client:
        for i in range(n):
            body = _body(rng, n_tokens, max_new, api)
            codes[await _one(client, urls[i % len(urls)], body, max_new, api)] += 1
    return {"codes": dict(codes)}


LG_OPS = {
    "open_loop": lg_open_loop,
    "closed_loop": lg_closed_loop,
    "e2e": lg_e2e,
    "sequential": lg_sequential,
    "direct_closed": lg_direct_closed,
}


def _op(name: str) -> Any:
    """An op by name; the peer routers' (`peer_...`, bench/_ro_loadgen.py) are loaded on first use."""
    if name not in LG_OPS and name.startswith("peer_"):
        import _ro_loadgen  # imports this module: loaded late, so no import cycle at start

        LG_OPS.update(_ro_loadgen.OPS)
    return LG_OPS[name]


def _loadgen_main(conn: Any) -> None:
    """The load generator's process: one asyncio run per command received on the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        try:
            res = uvloop.run(_op(msg["op"])(**msg["args"]))
            conn.send({"ok": True, "result": res})
        except Exception as exc:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


class LoadGen:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_loadgen_main, args=(child,), name="loadgen", daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.conn.send({"op": op, "args": args})
        if not self.conn.poll(timeout):
            raise RuntimeError(f"load generator: {op} gave no answer within {timeout:g} s")
        reply = self.conn.recv()
        if not reply["ok"]:
            raise RuntimeError(f"load generator: {op} failed: {reply['error']}")
        return reply["result"]  # type: ignore[no-any-return]

    def warm(self, urls: list[str], n: int, seed: int, api: str = "flexlb") -> dict[str, int]:
        """`n` sequential requests of the benchmarks' shape (a warm-up); their outcome codes."""
        from _gw_cluster import MAX_NEW_TOKENS, PROMPT_TOKENS  # the parent's import, not the child's

        args = {"urls": urls, "n": n, "n_tokens": PROMPT_TOKENS, "max_new": MAX_NEW_TOKENS, "seed": seed}
        return dict(self.call("sequential", 120, **args, api=api)["codes"])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()  # SIGTERM to its pid
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
