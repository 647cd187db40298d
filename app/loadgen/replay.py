"""The open-loop replay: send each planned request at its due time, measure it from the client.

Measurement (decided here, documented in docs/benchmarks.md): every request uses the native
`POST /v1/generate` with `stream: true`, also single-token ones, so all requests are timed the
same way. TTFT = first SSE event (the prefill's token) − send; TPOT = (last token event − first)
/ (completion tokens − 1); e2e = final event − send. Times start at the actual send, not the due
time; how late sends went out (client lag, and waits for a concurrency slot) is reported beside
the results, so a client that cannot keep up is visible instead of being billed to the gateway.
The final event carries the gateway's own view (chosen workers, cached tokens, batch size, prompt
tokens), which the records keep and the prompt-length check uses.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.loadgen.plan import PlannedRequest
from app.loadgen.prompts import PromptSynth
from app.report import RequestRecord


@dataclass
class ReplayStats:
    """Client-side facts of a run that are not per-request latencies."""

    send_lag_ms: list[float] = field(default_factory=list)  # actual send − due time
    slot_waits: int = 0  # sends that waited for a concurrency slot
    prompt_token_mismatches: int = 0  # gateway's prompt_tokens != trace input_len
    mismatch_examples: list[tuple[int, int, int]] = field(default_factory=list)  # (index, want, got)
    wall_s: float = 0.0


@dataclass
class ReplayConfig:
    url: str
    run_id: str
    timeout_s: float = 600.0
    concurrency_limit: int = 256
    model: str | None = None
    api: str = "native"  # native: FlexLB /v1/generate; completions: OpenAI /v1/completions (peers)
    api_key: str | None = None  # a tenant's key when the gateway runs FLEXLB_AUTH=keys


def _error_code(resp_body: bytes, status: int) -> str:
    try:
        err = json.loads(resp_body)["error"]
        return str(err.get("code") or f"http_{status}")
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


def _from_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI usage chunk in the shape of the native final event. The simulated workers'
    facade adds which workers served the request (`flexlb_workers`); other servers do not."""
    details = usage.get("prompt_tokens_details") or {}
    workers = usage.get("flexlb_workers") or {}
    return {
        "usage": usage,
        "cached_tokens": details.get("cached_tokens") or 0,
        "prefill_worker": workers.get("prefill"),
        "decode_worker": workers.get("decode"),
    }


async def send_one(
    client: httpx.AsyncClient,
    cfg: ReplayConfig,
    p: PlannedRequest,
    prompt: str,
    stats: ReplayStats,
) -> RequestRecord:
    """One streamed request → one record (never raises: failures become the record's error code)."""
    rid = f"{cfg.run_id}-{p.index}"
    openai = cfg.api == "completions"
    body: dict[str, Any]
    if openai:
        body = {
            "model": cfg.model or "flexlb-sim",
            "prompt": prompt,
            "max_tokens": p.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        path = "/v1/completions"
    else:
        body = {
            "prompt": prompt,
            "max_new_tokens": p.max_tokens,
            "stream": True,
            "request_id": rid,
            "timeout_ms": int(cfg.timeout_s * 1000),
        }
        if cfg.model:
            body["model"] = cfg.model
        path = "/v1/generate"
    rec = RequestRecord(rid, p.due_ms, p.input_len, 0, None, None, None)
    t0 = time.perf_counter()
    t_first: float | None = None
    t_last: float | None = None
    n_tokens = 0
    final: dict[str, Any] | None = None
    try:
        headers = {"x-request-id": rid}
        if cfg.api_key:
            headers["authorization"] = f"Bearer {cfg.api_key}"
        async with client.stream("POST", cfg.url.rstrip("/") + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = _error_code(await resp.aread(), resp.status_code)
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                now = time.perf_counter()
                if "error" in ev:
                    rec.error = str(ev["error"].get("code") or "stream_error")
                    return rec
                if openai:
                    if ev.get("usage"):
                        final = _from_usage(ev["usage"])
                    got = sum(len(c.get("text") or "") for c in ev.get("choices") or [])
                else:
                    if ev.get("done"):
                        final = ev
                        continue
                    got = len(ev.get("token_ids") or [])
                if got:
                    if t_first is None:
                        t_first = now
                    t_last = now
                    n_tokens += got
    except httpx.TimeoutException:
        rec.error = "client_timeout"
        return rec
    except httpx.HTTPError as exc:
        rec.error = f"transport_{type(exc).__name__}"
        return rec
    except ValueError:
        rec.error = "bad_stream"
        return rec
    t_end = time.perf_counter()
    if final is None or t_first is None:
        rec.error = "incomplete_stream"
        return rec
    usage = final.get("usage") or {}
    out_tokens = int(usage.get("completion_tokens", n_tokens))
    prompt_tokens = int(usage.get("prompt_tokens", -1))
    if prompt_tokens != p.input_len:
        stats.prompt_token_mismatches += 1
        if len(stats.mismatch_examples) < 5:
            stats.mismatch_examples.append((p.index, p.input_len, prompt_tokens))
    rec.output_tokens = out_tokens
    rec.ttft_ms = (t_first - t0) * 1000.0
    rec.e2e_ms = (t_end - t0) * 1000.0
    if out_tokens > 1 and t_last is not None:
        rec.tpot_ms = (t_last - t_first) * 1000.0 / (out_tokens - 1)
    rec.cached_tokens = int(final.get("cached_tokens") or 0)
    rec.prefill_worker = final.get("prefill_worker") or None
    rec.decode_worker = final.get("decode_worker") or None
    bs = final.get("batch_size")
    rec.batch_size = int(bs) if bs else None
    return rec


async def replay(
    cfg: ReplayConfig,
    plan: list[PlannedRequest],
    synth: PromptSynth,
    on_done: Callable[[RequestRecord], None] | None = None,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[RequestRecord], ReplayStats]:
    """Send every planned request at `run start + due_ms`; return records in plan order.

    A request whose due time comes while `concurrency_limit` requests are in flight waits for a
    slot (counted in `slot_waits`); the limit exists so a misbehaving gateway cannot make the
    client open thousands of sockets, and should be set above the expected in-flight count.
    """
    stats = ReplayStats()
    sem = asyncio.Semaphore(cfg.concurrency_limit)
    own = client is None
    if client is None:
        limits = httpx.Limits(
            max_connections=cfg.concurrency_limit, max_keepalive_connections=cfg.concurrency_limit
        )
        timeout = httpx.Timeout(cfg.timeout_s + 10.0, connect=10.0)
        client = httpx.AsyncClient(limits=limits, timeout=timeout)
    records: list[RequestRecord | None] = [None] * len(plan)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def run(i: int, p: PlannedRequest, prompt: str) -> None:
        try:
            r = await send_one(client, cfg, p, prompt, stats)
        finally:
            sem.release()
        records[i] = r
        if on_done is not None:
            on_done(r)

    tasks: list[asyncio.Task[None]] = []
    try:
        for i, p in enumerate(plan):
            prompt = p.prompt(synth)  # built before the due time, off the measured path
            delay = start + p.due_ms / 1000.0 - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem.locked():
                stats.slot_waits += 1
            await sem.acquire()
            stats.send_lag_ms.append(max(0.0, (loop.time() - start) * 1000.0 - p.due_ms))
            tasks.append(asyncio.create_task(run(i, p, prompt)))
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        if own:
            await client.aclose()
    stats.wall_s = loop.time() - start
    return [r for r in records if r is not None], stats
