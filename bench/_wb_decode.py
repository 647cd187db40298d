"""The workers benchmark's (c) decode delivery: concurrent decode streams read to their finish,
delivered token rate against the engine's modelled rate (see bench/workers_bench.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _harness import pct, r2
from _wb_ops import ClockMap, CoreMeter

from app.rpc.worker_client import WorkerClient
from workers.engine.tokens import output_tokens

DELIVERY_TARGET = 0.90


@dataclass
class StreamLog:
    request_id: str
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each tokens event
    counts: list[int] = field(default_factory=list)
    t_first_ms: float = float("inf")
    t_last_ms: float = float("-inf")
    last_t_last_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    gaps: int = 0  # chunks whose first_index did not follow the previous chunk
    finish_reason: str = ""
    generated: int = 0
    error: str = ""
    truncated: bool = False  # stopped reading at the wall budget; the engine work was cancelled


def _loop_time(mono: float) -> float:
    """asyncio's loop clock for a time.monotonic() instant (they are the same clock on Linux, but
    the loop does not promise it)."""
    return asyncio.get_running_loop().time() + (mono - time.monotonic())


async def decode_stream(
    client: WorkerClient, epoch: str, rid: str, input_tokens: int, new_tokens: int, stop_at: float
) -> StreamLog:
    """Read one decode stream to its finish, or until `stop_at` (time.monotonic()): a worker that
    cannot keep up would otherwise make one repetition last minutes."""
    log = StreamLog(rid)
    expect = 1
    try:
        async with (
            asyncio.timeout_at(_loop_time(stop_at)),
            contextlib.aclosing(client.decode(rid, epoch, input_tokens, new_tokens)) as events,
        ):
            async for ev in events:
                if ev.event != "tokens":
                    log.finish_reason, log.generated, log.error = ev.finish_reason, ev.generated, ev.error
                    break
                log.arrivals.append(time.monotonic())
                log.counts.append(len(ev.tokens))
                log.last_t_last_ms.append(ev.t_last_ms)
                if ev.first_index != expect:
                    log.gaps += 1
                expect = ev.first_index + len(ev.tokens)
                log.tokens.extend(ev.tokens)
                log.t_first_ms = min(log.t_first_ms, ev.t_first_ms)
                log.t_last_ms = max(log.t_last_ms, ev.t_last_ms)
    except TimeoutError:
        log.truncated = True
    if log.truncated:  # closing the stream does not stop the engine (docs/worker-protocol.md)
        await client.cancel(rid)
    return log


async def decode_delivery(
    client: WorkerClient,
    epoch: str,
    *,
    streams: int,
    input_tokens: int,
    new_tokens: int,
    reps: int,
    chunk_interval_ms: float,
    seed: int,
    budget_s: float,
    meter: CoreMeter,
) -> dict[str, Any]:
    """`streams` concurrent decode streams, `reps` times. Delivered rate uses the wall span from
    the first to the last tokens event received; the modelled rate the span from the earliest
    t_first_ms to the latest t_last_ms, so both count the same tokens over comparable spans.
    A repetition that outlives `budget_s` is cut there (flagged `truncated`); the ratio then
    covers the tokens received, which is still delivered vs produced."""
    per_rep = []
    all_gaps_ms: list[float] = []
    all_counts: list[int] = []
    lags_ms: list[float] = []
    bad: list[str] = []
    mismatched = 0
    truncated = 0
    clock = await ClockMap.calibrate(client)
    for rep in range(reps):
        tag = uuid.uuid4().hex[:8]
        cpu0 = meter.start()
        t0 = time.monotonic()
        logs = await asyncio.gather(
            *(
                decode_stream(
                    client, epoch, f"dec{streams}-{tag}-{i}", input_tokens, new_tokens, t0 + budget_s
                )
                for i in range(streams)
            )
        )
        t_end = time.monotonic()
        cpu = meter.cores(cpu0)
        cut = sum(lg.truncated for lg in logs)
        truncated += cut
        if cut:
            await asyncio.sleep(2.0)  # let the worker drain responses still queued for the cut streams
        tokens = sum(len(lg.tokens) for lg in logs)
        arrivals = [a for lg in logs for a in lg.arrivals]
        wall_span = max(arrivals) - min(arrivals)
        delivered = tokens / wall_span
        if not cut:
            model_span_s = (max(lg.t_last_ms for lg in logs) - min(lg.t_first_ms for lg in logs)) / 1000.0
            modelled = tokens / model_span_s
            method = "span"
        else:
            # Cut streams received different prefixes, so the global modelled span no longer
            # matches the tokens counted; the engine's production rate is the sum of each
            # stream's own modelled rate (they all run concurrently).
            spans = [
                (len(lg.tokens) - 1, lg.t_last_ms - lg.t_first_ms)  # tokens after the first one
                for lg in logs
                if len(lg.tokens) > 1
            ]
            modelled = sum(1000.0 * n / ms for n, ms in spans if ms > 0)
            model_span_s = None
            method = "per-stream rate"
        modelled_wall = modelled / clock.time_scale  # tokens per wall second the engine produces
        per_rep.append(
            {
                "rep": rep,
                "tokens": tokens,
                "wall_span_s": round(wall_span, 3),
                "modelled_span_s": None if model_span_s is None else round(model_span_s, 3),
                "end_to_end_s": round(t_end - t0, 3),
                "delivered_tokens_per_s": round(delivered, 1),
                "modelled_tokens_per_s": round(modelled, 1),
                "ratio": round(delivered / modelled_wall, 4),
                "ratio_method": method,
                "truncated_streams": cut,
                **cpu,
            }
        )
        for lg in logs:
            all_gaps_ms.extend(float(x) * 1000 for x in np.diff(lg.arrivals))
            all_counts.extend(lg.counts)
            lags_ms.extend(
                (a - clock.wall(t)) * 1000 for a, t in zip(lg.arrivals, lg.last_t_last_ms, strict=True)
            )
            if not lg.truncated and (
                lg.finish_reason != "length"
                or lg.generated != new_tokens
                or len(lg.tokens) != new_tokens
                or lg.gaps
            ):
                bad.append(
                    f"{lg.request_id}: {lg.finish_reason} generated={lg.generated} "
                    f"received={len(lg.tokens)} gaps={lg.gaps} {lg.error}".strip()
                )
            # tokens are a pure function of (seed, request id, index): a cheap end-to-end check
            if lg.tokens != output_tokens(seed, lg.request_id, 1, len(lg.tokens)):
                mismatched += 1
    ratios = [p["ratio"] for p in per_rep]
    st = await client.status()
    ratio = float(np.median(ratios))
    return {
        "streams": streams,
        "input_tokens": input_tokens,
        "max_new_tokens": new_tokens,
        "reps": reps,
        "delivered_tokens_per_s": round(float(np.median([p["delivered_tokens_per_s"] for p in per_rep])), 1),
        "modelled_tokens_per_s": round(float(np.median([p["modelled_tokens_per_s"] for p in per_rep])), 1),
        "ratio": round(ratio, 4),
        "ratio_min": round(min(ratios), 4),
        "chunk_interval_cfg_ms": chunk_interval_ms,
        "chunk_interval_p50_ms": r2(pct(all_gaps_ms, 50)),
        "chunk_interval_p99_ms": r2(pct(all_gaps_ms, 99)),
        "tokens_per_chunk_p50": r2(pct(all_counts, 50)),
        "delivery_lag_p50_ms": r2(pct(lags_ms, 50)),
        "delivery_lag_p99_ms": r2(pct(lags_ms, 99)),
        "clock_sync_rtt_ms": r2(clock.rtt_ms),
        "worker_avg_step_ms": r2(st.get("avg_step_ms", float("nan"))),
        "worker_max_lag_ms": r2(st.get("max_lag_ms", float("nan"))),
        "bad_streams": len(bad),
        "truncated_streams": truncated,
        "client_cores": r2(float(np.median([p["client_cores"] for p in per_rep]))),
        "worker_cores": r2(float(np.median([p["worker_cores"] for p in per_rep]))),
        "budget_s": budget_s,
        "bad_examples": bad[:3],
        "token_mismatch_streams": mismatched,
        "per_rep": per_rep,
        "target": DELIVERY_TARGET,
        "meets_target": bool(ratio >= DELIVERY_TARGET),
    }
