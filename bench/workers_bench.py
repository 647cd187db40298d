"""Micro-benchmarks of the simulated workers through real Triton (docs/worker-protocol.md).

Why this exists: the workers add real software latency (gRPC, Triton, PyTriton's stub hop, the
engine thread) on top of the *modelled* GPU time, and the gateway's scheduling is only as good as
the assumption that this extra cost is small. Three questions are answered, each against a target:

(a) prefill throughput: how many batches/s one prefill worker can take when the modelled GPU costs
    nothing (`--formula 0`), i.e. the ceiling the software path puts on a prefill worker;
(b) prefill path overhead: with a 50 ms modelled batch, how many wall ms the path adds on top
    (send -> `final` minus end_ms - start_ms); target <= 10 ms;
(c) decode delivery: with the default `llama3.1-8b-h100` profile at time scale 1, whether tokens
    reach the client as fast as the model produces them at 16 and 64 streams; target >= 90 %.

The bench starts its own workers (subprocesses of `flexlb worker`, as tests/conftest.py does),
binds them to 127.0.0.1 only, and always stops them (SIGTERM, then wait) even on error.

    .venv/bin/python bench/workers_bench.py [--quick] [--output DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from app.rpc.worker_client import WorkerClient
from workers.engine.tokens import output_tokens

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "out"
VOCAB = 128_000  # Llama-3 vocabulary is 128,256 ids; any int32 works, this keeps prompts plausible
OVERHEAD_TARGET_MS = 10.0
DELIVERY_TARGET = 0.90
console = Console()


# ---- workers ------------------------------------------------------------------------------------
@dataclass
class Worker:
    """A `flexlb worker` subprocess we started; `stop()` is the only way it is ended."""

    role: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    log_path: Path
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    @property
    def epoch(self) -> str:
        return str(self.ready["epoch"])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait: the worker tears down Triton and its stubs itself (~4 s). SIGKILL only
        if it ignores that, since a killed worker can orphan its tritonserver."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                console.print(f"[red]{self.role} worker {self.proc.pid} ignored SIGTERM; killing it")
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _pump_lines(proc: subprocess.Popen[str], out: queue.Queue[str]) -> None:
    """Drain the worker's stdout on a thread: readline() alone cannot time out, and an undrained
    pipe could block the worker once it fills."""
    assert proc.stdout is not None
    for line in proc.stdout:
        out.put(line)


def start_worker(role: str, args: Sequence[str], log_dir: Path, timeout: float = 120.0) -> Worker:
    """Start `flexlb worker` on 127.0.0.1 and wait (bounded) for its `worker_ready` JSON line."""
    log_path = log_dir / f"{role}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:6]}.log"
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--role",
        role,
        "--host",
        "127.0.0.1",
        "--bind",
        "127.0.0.1",
        "--log-level",
        "WARNING",
        *args,
    ]
    with open(log_path, "w") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump_lines, args=(proc, lines), daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            if isinstance(ev, dict) and ev.get("event") == "worker_ready":
                return Worker(role, proc, ev, log_path, lines)
    w = Worker(role, proc, {}, log_path, lines)
    w.stop()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{role} worker did not become ready (rc={proc.returncode}); log tail:\n{tail}")


def start_workers(specs: Sequence[tuple[str, list[str]]], log_dir: Path, attempts: int = 2) -> list[Worker]:
    """Start all workers in parallel (each takes ~6 s). A start can fail spuriously when another
    process races for a port or the box is busy, so each one is retried once."""

    def one(spec: tuple[str, list[str]]) -> Worker:
        last: Exception | None = None
        for _ in range(attempts):
            try:
                return start_worker(spec[0], spec[1], log_dir)
            except RuntimeError as exc:
                last = exc
                console.print(f"[yellow]{spec[0]} worker failed to start, retrying: {str(exc)[:200]}")
        assert last is not None
        raise last

    with ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(one, s) for s in specs]
        started: list[Worker] = []
        errors: list[BaseException] = []
        for f in futs:
            try:
                started.append(f.result())
            except BaseException as exc:
                errors.append(exc)
    if errors:
        for w in started:
            w.stop()
        raise errors[0]
    return started


# ---- statistics ---------------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def r2(x: float) -> float:
    return round(float(x), 2)


@dataclass
class ClockMap:
    """Maps a worker's modelled clock onto this process's time.monotonic().

    Both processes read CLOCK_MONOTONIC, and the worker's modelled clock is
    `model0 + (monotonic - wall0) * 1000 / time_scale`, so one `status` round trip pins the
    offset to within half its RTT (the smallest of a few tries is used). Lets the bench split
    wall overhead into "before the engine saw it" and "after the engine finished it".
    """

    mono_ref: float
    model_ref_ms: float
    time_scale: float
    rtt_ms: float

    @classmethod
    async def calibrate(cls, client: WorkerClient, tries: int = 7) -> ClockMap:
        best: ClockMap | None = None
        for _ in range(tries):
            t0 = time.monotonic()
            st = await client.status()
            t1 = time.monotonic()
            cand = cls((t0 + t1) / 2, float(st["now_ms"]), float(st["time_scale"]), (t1 - t0) * 1000)
            if best is None or cand.rtt_ms < best.rtt_ms:
                best = cand
        assert best is not None
        return best

    def wall(self, model_ms: float) -> float:
        """time.monotonic() seconds at which the worker's modelled clock read `model_ms`."""
        return self.mono_ref + (model_ms - self.model_ref_ms) * self.time_scale / 1000.0


# ---- (a) prefill throughput ---------------------------------------------------------------------
@dataclass
class BatchOutcome:
    wall_ms: float
    n_ok: int
    n_bad: int
    cached_tokens: int
    modelled_ms: float
    t_sent: float
    t_accepted: float
    t_final: float
    start_ms: float
    end_ms: float
    error: str = ""


class PromptSource:
    """Distinct random prompts for every request, so no request can hit the prefix cache."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def batch(self, tag: str, size: int, length: int) -> list[tuple[str, np.ndarray]]:
        ids = self.rng.integers(0, VOCAB, size * length, dtype=np.int32)
        out = []
        for i in range(size):
            self.n += 1
            out.append((f"{tag}-{self.n}", ids[i * length : (i + 1) * length]))
        return out


async def run_batch(client: WorkerClient, epoch: str, reqs: list[tuple[str, np.ndarray]]) -> BatchOutcome:
    """One prefill batch, send to `final`; the modelled span is min(start_ms)..max(end_ms)."""
    t_sent = time.monotonic()
    t_acc = t_fin = float("nan")
    ok = bad = cached = 0
    starts: list[float] = []
    ends: list[float] = []
    err = ""
    async for ev in client.prefill(uuid.uuid4().hex, epoch, reqs):
        if ev.event == "accepted":
            t_acc = time.monotonic()
        elif ev.event == "results":
            for r in ev.results:
                if r["status"] == "ok":
                    ok += 1
                else:
                    bad += 1
                    err = err or f"{r['status']}: {r['error']}"
                cached += int(r["cached_tokens"])
                starts.append(float(r["start_ms"]))
                ends.append(float(r["end_ms"]))
        elif ev.event == "final":
            t_fin = time.monotonic()
        elif ev.event == "error":
            t_fin = time.monotonic()
            err = ev.error
    if not starts:
        starts = ends = [float("nan")]
    return BatchOutcome(
        (t_fin - t_sent) * 1000,
        ok,
        bad,
        cached,
        max(ends) - min(starts),
        t_sent,
        t_acc,
        t_fin,
        min(starts),
        max(ends),
        err,
    )


async def _batch_loop(
    client: WorkerClient,
    epoch: str,
    src: PromptSource,
    shape: tuple[str, int, int],
    deadline: float,
    outcomes: list[BatchOutcome],
) -> None:
    """One of the concurrent streams of (a): a new batch as soon as the previous one is final."""
    while time.monotonic() < deadline:
        outcomes.append(await run_batch(client, epoch, src.batch(*shape)))


async def prefill_throughput(
    client: WorkerClient,
    epoch: str,
    sizes: Sequence[int],
    lengths: Sequence[int],
    *,
    duration_s: float,
    concurrency: int,
    warmup_batches: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Back-to-back batches on `concurrency` streams for `duration_s` per (batch size, prompt
    length); counts batches that *finish*, so in-flight work at the deadline is waited for."""
    src = PromptSource(seed)
    rows = []
    for length in lengths:
        for size in sizes:
            tag = f"tp{size}x{length}"
            for _ in range(warmup_batches):  # first calls pay channel set-up and allocations
                await run_batch(client, epoch, src.batch(tag, size, length))
            outcomes: list[BatchOutcome] = []
            t0 = time.monotonic()
            deadline = t0 + duration_s

            await asyncio.gather(
                *(
                    _batch_loop(client, epoch, src, (tag, size, length), deadline, outcomes)
                    for _ in range(concurrency)
                )
            )
            elapsed = max(o.t_final for o in outcomes) - t0
            lat = [o.wall_ms for o in outcomes]
            n = len(outcomes)
            rows.append(
                {
                    "batch_size": size,
                    "prompt_tokens": length,
                    "concurrency": concurrency,
                    "batches": n,
                    "elapsed_s": r2(elapsed),
                    "batches_per_s": r2(n / elapsed),
                    "requests_per_s": r2(n * size / elapsed),
                    "prompt_tokens_per_s": round(n * size * length / elapsed),
                    "latency_p50_ms": r2(pct(lat, 50)),
                    "latency_p99_ms": r2(pct(lat, 99)),
                    "not_ok": sum(o.n_bad for o in outcomes),
                    "cached_tokens": sum(o.cached_tokens for o in outcomes),
                    "first_error": next((o.error for o in outcomes if o.error), ""),
                }
            )
            console.print(
                f"  prefill {size:>2} x {length:>5}: {rows[-1]['batches_per_s']:8.1f} batches/s, "
                f"p50 {rows[-1]['latency_p50_ms']:.1f} ms"
            )
    return rows


# ---- (b) prefill overhead -----------------------------------------------------------------------
async def prefill_overhead(
    client: WorkerClient,
    epoch: str,
    *,
    formula: str,
    size: int,
    length: int,
    batches: int,
    warmup: int,
    seed: int,
) -> dict[str, Any]:
    """Sequential batches (nothing queued, so start_ms is the engine's arrival time): added ms =
    send..final wall minus the modelled end_ms - start_ms, split at the engine via ClockMap."""
    await client.reset()  # drop (a)'s cache and history
    resp = await client.configure(formula=formula)
    if not resp.get("ok"):
        raise RuntimeError(f"configure formula={formula!r} refused: {resp}")
    clock = await ClockMap.calibrate(client)
    src = PromptSource(seed + 1)
    for _ in range(warmup):
        await run_batch(client, epoch, src.batch("ovw", size, length))
    outs = [await run_batch(client, epoch, src.batch("ov", size, length)) for _ in range(batches)]
    scale = clock.time_scale
    added = [o.wall_ms - o.modelled_ms * scale for o in outs]
    ingress = [(clock.wall(o.start_ms) - o.t_sent) * 1000 for o in outs]
    egress = [(o.t_final - clock.wall(o.end_ms)) * 1000 for o in outs]
    accepted = [(o.t_accepted - o.t_sent) * 1000 for o in outs]
    st = await client.status()
    return {
        "formula": formula,
        "batch_size": size,
        "prompt_tokens": length,
        "batches": len(outs),
        "modelled_ms_p50": r2(pct([o.modelled_ms for o in outs], 50)),
        "wall_ms_p50": r2(pct([o.wall_ms for o in outs], 50)),
        "added_ms_p50": r2(pct(added, 50)),
        "added_ms_p99": r2(pct(added, 99)),
        "added_ms_max": r2(max(added)),
        "send_to_accepted_ms_p50": r2(pct(accepted, 50)),
        "send_to_engine_start_ms_p50": r2(pct(ingress, 50)),
        "engine_end_to_final_ms_p50": r2(pct(egress, 50)),
        "clock_sync_rtt_ms": r2(clock.rtt_ms),
        "worker_max_lag_ms": r2(st.get("max_lag_ms", float("nan"))),
        "not_ok": sum(o.n_bad for o in outs),
        "target_ms": OVERHEAD_TARGET_MS,
        "meets_target": bool(pct(added, 50) <= OVERHEAD_TARGET_MS),
    }


# ---- (c) decode delivery ------------------------------------------------------------------------
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


async def decode_stream(
    client: WorkerClient, epoch: str, rid: str, input_tokens: int, new_tokens: int
) -> StreamLog:
    log = StreamLog(rid)
    expect = 1
    async for ev in client.decode(rid, epoch, input_tokens, new_tokens):
        if ev.event == "tokens":
            log.arrivals.append(time.monotonic())
            log.counts.append(len(ev.tokens))
            log.last_t_last_ms.append(ev.t_last_ms)
            if ev.first_index != expect:
                log.gaps += 1
            expect = ev.first_index + len(ev.tokens)
            log.tokens.extend(ev.tokens)
            log.t_first_ms = min(log.t_first_ms, ev.t_first_ms)
            log.t_last_ms = max(log.t_last_ms, ev.t_last_ms)
        else:
            log.finish_reason, log.generated, log.error = ev.finish_reason, ev.generated, ev.error
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
) -> dict[str, Any]:
    """`streams` concurrent decode streams, `reps` times. Delivered rate uses the wall span from
    the first to the last tokens event received; the modelled rate the span from the earliest
    t_first_ms to the latest t_last_ms, so both count the same tokens over comparable spans."""
    per_rep = []
    all_gaps_ms: list[float] = []
    all_counts: list[int] = []
    lags_ms: list[float] = []
    bad: list[str] = []
    mismatched = 0
    clock = await ClockMap.calibrate(client)
    for rep in range(reps):
        tag = uuid.uuid4().hex[:8]
        t0 = time.monotonic()
        logs = await asyncio.gather(
            *(
                decode_stream(client, epoch, f"dec{streams}-{tag}-{i}", input_tokens, new_tokens)
                for i in range(streams)
            )
        )
        t_end = time.monotonic()
        tokens = sum(len(lg.tokens) for lg in logs)
        arrivals = [a for lg in logs for a in lg.arrivals]
        wall_span = max(arrivals) - min(arrivals)
        model_span_s = (max(lg.t_last_ms for lg in logs) - min(lg.t_first_ms for lg in logs)) / 1000.0
        model_span_wall = model_span_s * clock.time_scale
        delivered = tokens / wall_span
        modelled = tokens / model_span_s
        per_rep.append(
            {
                "rep": rep,
                "tokens": tokens,
                "wall_span_s": round(wall_span, 3),
                "modelled_span_s": round(model_span_s, 3),
                "end_to_end_s": round(t_end - t0, 3),
                "delivered_tokens_per_s": round(delivered, 1),
                "modelled_tokens_per_s": round(modelled, 1),
                "ratio": round(model_span_wall / wall_span, 4),
            }
        )
        for lg in logs:
            all_gaps_ms.extend(float(x) * 1000 for x in np.diff(lg.arrivals))
            all_counts.extend(lg.counts)
            lags_ms.extend(
                (a - clock.wall(t)) * 1000 for a, t in zip(lg.arrivals, lg.last_t_last_ms, strict=True)
            )
            if (
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
        "bad_examples": bad[:3],
        "token_mismatch_streams": mismatched,
        "per_rep": per_rep,
        "target": DELIVERY_TARGET,
        "meets_target": bool(ratio >= DELIVERY_TARGET),
    }


# ---- report -------------------------------------------------------------------------------------
def render(results: dict[str, Any]) -> None:
    tp = results.get("prefill_throughput")
    if isinstance(tp, list):
        t = Table(
            title=f"(a) prefill throughput, formula 0, {results['config']['concurrency']} streams in flight"
        )
        for col in ("batch", "prompt", "batches/s", "requests/s", "p50 ms", "p99 ms", "not ok", "cached"):
            t.add_column(col, justify="right")
        for r in tp:
            t.add_row(
                str(r["batch_size"]),
                str(r["prompt_tokens"]),
                f"{r['batches_per_s']:.1f}",
                f"{r['requests_per_s']:.1f}",
                f"{r['latency_p50_ms']:.1f}",
                f"{r['latency_p99_ms']:.1f}",
                str(r["not_ok"]),
                str(r["cached_tokens"]),
            )
        console.print(t)
    ov = results.get("prefill_overhead")
    if isinstance(ov, dict) and "added_ms_p50" in ov:
        t = Table(
            title=f"(b) prefill path overhead, formula {ov['formula']}, batch {ov['batch_size']} x "
            f"{ov['prompt_tokens']}, sequential (target <= {OVERHEAD_TARGET_MS:g} ms)"
        )
        for col in (
            "batches",
            "modelled ms",
            "wall p50",
            "added p50",
            "added p99",
            "send->accepted",
            "send->start",
            "end->final",
            "ok",
        ):
            t.add_column(col, justify="right")
        t.add_row(
            str(ov["batches"]),
            f"{ov['modelled_ms_p50']:.1f}",
            f"{ov['wall_ms_p50']:.1f}",
            f"{ov['added_ms_p50']:.2f}",
            f"{ov['added_ms_p99']:.2f}",
            f"{ov['send_to_accepted_ms_p50']:.2f}",
            f"{ov['send_to_engine_start_ms_p50']:.2f}",
            f"{ov['engine_end_to_final_ms_p50']:.2f}",
            "yes" if ov["meets_target"] else "NO",
        )
        console.print(t)
    dec = results.get("decode_delivery")
    if isinstance(dec, list):
        t = Table(
            title=f"(c) decode delivery, llama3.1-8b-h100, time scale 1 (target >= {DELIVERY_TARGET:.0%})"
        )
        for col in (
            "streams",
            "delivered tok/s",
            "modelled tok/s",
            "ratio",
            "chunk cfg",
            "chunk p50",
            "chunk p99",
            "tok/chunk",
            "lag p50",
            "lag p99",
            "bad",
            "ok",
        ):
            t.add_column(col, justify="right")
        for d in dec:
            t.add_row(
                str(d["streams"]),
                f"{d['delivered_tokens_per_s']:.0f}",
                f"{d['modelled_tokens_per_s']:.0f}",
                f"{d['ratio']:.1%}",
                f"{d['chunk_interval_cfg_ms']:g}",
                f"{d['chunk_interval_p50_ms']:.1f}",
                f"{d['chunk_interval_p99_ms']:.1f}",
                f"{d['tokens_per_chunk_p50']:.0f}",
                f"{d['delivery_lag_p50_ms']:.1f}",
                f"{d['delivery_lag_p99_ms']:.1f}",
                str(d["bad_streams"] + d["token_mismatch_streams"]),
                "yes" if d["meets_target"] else "NO",
            )
        console.print(t)
    for k, v in results.get("errors", {}).items():
        console.print(f"[red]{k} failed: {v}")


def summary_md(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        "# Worker bench summary",
        "",
        f"{results['started_at']}, {'quick' if cfg['quick'] else 'full'} run, {cfg['cpus']} CPUs, "
        f"load average before/after {cfg['loadavg_before']} / {results.get('loadavg_after')}.",
        "",
    ]
    tp = results.get("prefill_throughput")
    if isinstance(tp, list):
        lines += [
            f"## (a) Prefill throughput (formula 0, {cfg['concurrency']} streams in flight)",
            "",
            "| batch | prompt | batches/s | requests/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch_size']} | {r['prompt_tokens']} | {r['batches_per_s']:.1f} | "
            f"{r['requests_per_s']:.1f} | {r['latency_p50_ms']:.1f} | {r['latency_p99_ms']:.1f} |"
            for r in tp
        ]
        lines.append("")
    ov = results.get("prefill_overhead")
    if isinstance(ov, dict) and "added_ms_p50" in ov:
        lines += [
            f"## (b) Prefill path overhead (formula {ov['formula']}, batch {ov['batch_size']} x "
            f"{ov['prompt_tokens']})",
            "",
            f"Added wall ms over the modelled {ov['modelled_ms_p50']:.0f} ms: median **{ov['added_ms_p50']:.2f}**, "
            f"p99 {ov['added_ms_p99']:.2f} (target <= {OVERHEAD_TARGET_MS:g} ms: "
            f"{'met' if ov['meets_target'] else 'NOT met'}). Send to engine start "
            f"{ov['send_to_engine_start_ms_p50']:.2f} ms, engine end to `final` "
            f"{ov['engine_end_to_final_ms_p50']:.2f} ms (medians).",
            "",
        ]
    dec = results.get("decode_delivery")
    if isinstance(dec, list):
        lines += [
            "## (c) Decode delivery (llama3.1-8b-h100, time scale 1)",
            "",
            "| streams | delivered tok/s | modelled tok/s | ratio | chunk p50 ms (cfg) | lag p50 ms |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {d['streams']} | {d['delivered_tokens_per_s']:.0f} | {d['modelled_tokens_per_s']:.0f} | "
            f"{d['ratio']:.1%} | {d['chunk_interval_p50_ms']:.1f} ({d['chunk_interval_cfg_ms']:g}) | "
            f"{d['delivery_lag_p50_ms']:.1f} |"
            for d in dec
        ]
        lines.append("")
    for k, v in results.get("errors", {}).items():
        lines.append(f"**{k} failed:** {v}")
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Sizes of one run; `--quick` keeps every section but shrinks it to finish in < 60 s."""

    duration_s: float
    warmup_batches: int
    overhead_batches: int
    decode_reps: int
    sizes: tuple[int, ...] = (1, 8, 32)
    lengths: tuple[int, ...] = (1024, 8192)


QUICK = Plan(duration_s=1.5, warmup_batches=1, overhead_batches=15, decode_reps=1)
FULL = Plan(duration_s=6.0, warmup_batches=3, overhead_batches=150, decode_reps=3)


async def run_all(
    args: argparse.Namespace,
    plan: Plan,
    prefill: Worker | None,
    decode: Worker | None,
    results: dict[str, Any],
) -> None:
    errors: dict[str, str] = results.setdefault("errors", {})

    async def section(name: str, fn: Callable[[], Any]) -> None:
        console.print(f"[bold]{name}[/bold]")
        try:
            results[name] = await fn()
        except Exception as exc:  # keep going: one broken section must not hide the others
            errors[name] = f"{type(exc).__name__}: {exc}"
            console.print(f"[red]{name}: {errors[name]}")

    if prefill is not None:
        pc = WorkerClient(prefill.address)
        try:
            if "prefill" in args.sections:
                await section(
                    "prefill_throughput",
                    lambda: prefill_throughput(
                        pc,
                        prefill.epoch,
                        plan.sizes,
                        plan.lengths,
                        duration_s=plan.duration_s,
                        concurrency=args.concurrency,
                        warmup_batches=plan.warmup_batches,
                        seed=args.seed,
                    ),
                )
            if "overhead" in args.sections:
                await section(
                    "prefill_overhead",
                    lambda: prefill_overhead(
                        pc,
                        prefill.epoch,
                        formula=args.overhead_formula,
                        size=8,
                        length=8192,
                        batches=plan.overhead_batches,
                        warmup=plan.warmup_batches,
                        seed=args.seed,
                    ),
                )
            with contextlib.suppress(Exception):
                results["prefill_worker_status"] = _brief_status(await pc.status())
        finally:
            await pc.close()
    if decode is not None:
        dc = WorkerClient(decode.address)
        try:

            async def decode_all() -> list[dict[str, Any]]:
                out = []
                for n in args.decode_streams:
                    out.append(
                        await decode_delivery(
                            dc,
                            decode.epoch,
                            streams=n,
                            input_tokens=1000,
                            new_tokens=args.new_tokens,
                            reps=plan.decode_reps,
                            chunk_interval_ms=args.chunk_interval_ms,
                            seed=0,
                        )
                    )
                    console.print(f"  decode {n:>3} streams: ratio {out[-1]['ratio']:.1%}")
                return out

            await section("decode_delivery", decode_all)
            with contextlib.suppress(Exception):
                results["decode_worker_status"] = _brief_status(await dc.status())
        finally:
            await dc.close()


def _brief_status(st: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "role",
        "profile",
        "time_scale",
        "lag_ms",
        "max_lag_ms",
        "batches_done",
        "tokens_total",
        "avg_step_ms",
        "kv_free_tokens",
        "kv_released",
    )
    return {k: st[k] for k in keep if k in st}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (< 60 s)")
    p.add_argument(
        "--output", type=Path, default=DEFAULT_OUT, help="directory for results.json and summary.md"
    )
    p.add_argument(
        "--sections",
        default="prefill,overhead,decode",
        type=lambda s: {x.strip() for x in s.split(",") if x.strip()},
        help="comma-separated subset of prefill,overhead,decode",
    )
    p.add_argument("--concurrency", type=int, default=4, help="prefill batches in flight in (a)")
    p.add_argument("--overhead-formula", default="50", help="modelled prefill batch ms formula for (b)")
    p.add_argument("--decode-streams", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens per decode stream")
    p.add_argument(
        "--chunk-interval-ms", type=float, default=20.0, help="decode worker chunk interval (wall)"
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    unknown = args.sections - {"prefill", "overhead", "decode"}
    if unknown:
        p.error(f"unknown sections: {sorted(unknown)}")
    return args


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    """Turn SIGTERM into an exception so the `finally` that stops the workers still runs."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    out_dir: Path = args.output
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm)
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "quick": args.quick,
            "plan": plan.__dict__,
            "sections": sorted(args.sections),
            "concurrency": args.concurrency,
            "overhead_formula": args.overhead_formula,
            "decode_streams": args.decode_streams,
            "new_tokens": args.new_tokens,
            "chunk_interval_ms": args.chunk_interval_ms,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            # (a)/(b) must not stall on KV: handles would otherwise pin ~262K tokens per 32 x 8K batch
            # for 30 modelled s, because no decode worker ever fetches them.
            "prefill_worker_args": [
                "--profile",
                "formula",
                "--formula",
                "0",
                "--kv-handle-ttl-ms",
                "1",
                "--kv-capacity-tokens",
                "2000000",
            ],
            "decode_worker_args": ["--chunk-interval-ms", str(args.chunk_interval_ms)],
        },
    }
    specs: list[tuple[str, list[str]]] = []
    if args.sections & {"prefill", "overhead"}:
        specs.append(("prefill", results["config"]["prefill_worker_args"]))
    if "decode" in args.sections:
        specs.append(("decode", results["config"]["decode_worker_args"]))
    t0 = time.monotonic()
    workers: list[Worker] = []
    try:
        console.print(f"starting {', '.join(r for r, _ in specs)} worker(s)...")
        workers = start_workers(specs, log_dir)
        results["workers"] = {
            w.role: {k: w.ready.get(k) for k in ("address", "epoch", "startup_s")} for w in workers
        }
        by_role = {w.role: w for w in workers}
        asyncio.run(run_all(args, plan, by_role.get("prefill"), by_role.get("decode"), results))
    except (Exception, KeyboardInterrupt) as exc:
        results.setdefault("errors", {})["run"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]bench aborted: {type(exc).__name__}: {exc}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping must not be interrupted
        for w in workers:
            results.setdefault("worker_exit", {})[w.role] = w.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = round(time.monotonic() - t0, 1)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "summary.md").write_text(summary_md(results))
    render(results)
    console.print(f"wrote {out_dir / 'results.json'} and summary.md in {results['wall_s']} s")
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
