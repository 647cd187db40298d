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
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from app.rpc.worker_client import WorkerClient
from workers.engine.tokens import output_tokens
from workers.server.spawn import ReadyLine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "out"
VOCAB = 128_000  # Llama-3 vocabulary is 128,256 ids; any int32 works, this keeps prompts plausible
OVERHEAD_TARGET_MS = 10.0
DELIVERY_TARGET = 0.90
console = Console(width=None if sys.stdout.isatty() else 160)


# ---- workers ------------------------------------------------------------------------------------
@dataclass
class Worker:
    """A `flexlb worker` subprocess we started; `stop()` is the only way it is ended."""

    role: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    log_path: Path

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


def start_worker(
    role: str, args: Sequence[str], log_dir: Path, env: dict[str, str], timeout: float = 120.0
) -> Worker:
    """Start `flexlb worker` on 127.0.0.1 and wait (bounded) for its `worker_ready` JSON line."""
    log_path = log_dir / f"{role}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:6]}.log"
    loopback = ["--host", "127.0.0.1", "--bind", "127.0.0.1"]
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--role",
        role,
        *loopback,
        "--log-level",
        "WARNING",
        *args,
    ]
    with open(log_path, "w") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **env}
        )
    reader = ReadyLine(proc)
    info = reader.wait(timeout)
    if info is not None:
        return Worker(role, proc, info, log_path)
    w = Worker(role, proc, {}, log_path)
    w.stop()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{role} worker did not become ready (rc={proc.returncode}); log tail:\n{tail}")


def start_workers(
    specs: Sequence[tuple[str, list[str]]], log_dir: Path, env: dict[str, str], attempts: int = 2
) -> list[Worker]:
    """Start all workers in parallel (each takes ~6 s). A start can fail spuriously when another
    process races for a port or the box is busy, so each one is retried once."""

    def one(spec: tuple[str, list[str]]) -> Worker:
        last: Exception | None = None
        for _ in range(attempts):
            try:
                return start_worker(spec[0], spec[1], log_dir, env)
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
    offset to within half its RTT (the smallest of a few tries is used). Used for the decode
    delivery lag (arrival minus the modelled time of a chunk's last token), where the lag is far
    larger than that error; `clock_sync_rtt_ms` is reported next to it. Too coarse to split the
    ~20 ms prefill overhead, which (b) therefore splits with client-side instants only.
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


class CpuMeter:
    """CPU cores used by this client and by one worker's process tree (worker, tritonserver, stubs).

    On a 2-core box the client competes with the worker it measures; reporting both shows when a
    figure is the box's ceiling rather than the worker's."""

    def __init__(self, worker_pid: int) -> None:
        self.me = psutil.Process()
        self.worker = psutil.Process(worker_pid)

    def _cpu(self) -> tuple[float, float, float]:
        def tree(p: psutil.Process) -> float:
            total = 0.0
            for q in [p, *p.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = q.cpu_times()
                    total += t.user + t.system
            return total

        mine = self.me.cpu_times()
        return time.monotonic(), mine.user + mine.system, tree(self.worker)

    def start(self) -> tuple[float, float, float]:
        return self._cpu()

    def cores(self, since: tuple[float, float, float]) -> dict[str, float]:
        now = self._cpu()
        wall = max(now[0] - since[0], 1e-9)
        return {
            "client_cores": r2((now[1] - since[1]) / wall),
            "worker_cores": r2((now[2] - since[2]) / wall),
        }


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
    t_results: float
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


BATCH_TIMEOUT_S = 60.0


async def run_batch(client: WorkerClient, epoch: str, reqs: list[tuple[str, np.ndarray]]) -> BatchOutcome:
    """One prefill batch, send to `final`; the modelled span is min(start_ms)..max(end_ms).
    Bounded by BATCH_TIMEOUT_S: a wedged worker must fail the section, not hang the bench."""
    try:
        async with asyncio.timeout(BATCH_TIMEOUT_S):
            return await _run_batch(client, epoch, reqs)
    except TimeoutError:
        try:  # say whether the worker itself is stuck or only this stream
            st = _brief_status(await client.status(timeout=5.0))
            st["live"] = (await client.status(timeout=5.0)).get("live")
        except Exception as exc:
            st = {"status_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        raise RuntimeError(
            f"prefill batch got no `final` within {BATCH_TIMEOUT_S:g} s; worker: {st}"
        ) from None


async def _run_batch(client: WorkerClient, epoch: str, reqs: list[tuple[str, np.ndarray]]) -> BatchOutcome:
    t_sent = time.monotonic()
    t_acc = t_res = t_fin = float("nan")
    ok = bad = cached = 0
    starts: list[float] = []
    ends: list[float] = []
    err = ""
    async for ev in client.prefill(uuid.uuid4().hex, epoch, reqs):
        if ev.event == "accepted":
            t_acc = time.monotonic()
        elif ev.event == "results":
            t_res = t_res if t_res == t_res else time.monotonic()  # first results event (nan != nan)
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
        t_res,
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
    meter: CpuMeter,
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
            cpu0 = meter.start()
            t0 = time.monotonic()
            deadline = t0 + duration_s

            await asyncio.gather(
                *(
                    _batch_loop(client, epoch, src, (tag, size, length), deadline, outcomes)
                    for _ in range(concurrency)
                )
            )
            elapsed = max(o.t_final for o in outcomes) - t0
            cpu = meter.cores(cpu0)
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
                    **cpu,
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
    meter: CpuMeter,
) -> dict[str, Any]:
    """Sequential batches (nothing queued, so start_ms is the engine's arrival time): added ms =
    send..final wall minus the modelled end_ms - start_ms. The split uses client-side instants only:
    the worker's clock cannot be mapped onto ours more precisely than a status RTT (~5-50 ms here),
    which is larger than what is being measured."""
    await client.reset()  # drop (a)'s cache and history
    resp = await client.configure(formula=formula)
    if not resp.get("ok"):
        raise RuntimeError(f"configure formula={formula!r} refused: {resp}")
    src = PromptSource(seed + 1)
    for _ in range(warmup):
        await run_batch(client, epoch, src.batch("ovw", size, length))
    cpu0 = meter.start()
    outs = [await run_batch(client, epoch, src.batch("ov", size, length)) for _ in range(batches)]
    cpu = meter.cores(cpu0)
    st = await client.status()
    scale = float(st["time_scale"])
    added = [o.wall_ms - o.modelled_ms * scale for o in outs]
    accepted = [(o.t_accepted - o.t_sent) * 1000 for o in outs]
    middle = [(o.t_results - o.t_accepted) * 1000 - o.modelled_ms * scale for o in outs]
    tail = [(o.t_final - o.t_results) * 1000 for o in outs]
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
        "accepted_to_results_minus_modelled_ms_p50": r2(pct(middle, 50)),
        "results_to_final_ms_p50": r2(pct(tail, 50)),
        "worker_max_lag_ms": r2(st.get("max_lag_ms", float("nan"))),
        "not_ok": sum(o.n_bad for o in outs),
        **cpu,
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
    meter: CpuMeter,
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


# ---- report -------------------------------------------------------------------------------------
def _cores(d: dict[str, Any]) -> str:
    """CPU cores used by the worker's process tree / by this client while measuring."""
    return f"{d.get('worker_cores', float('nan')):.2f}/{d.get('client_cores', float('nan')):.2f}"


def render(results: dict[str, Any]) -> None:
    tp = results.get("prefill_throughput")
    if isinstance(tp, list):
        t = Table(
            title=f"(a) prefill throughput, formula 0, {results['config']['concurrency']} streams in flight"
        )
        for col in (
            "batch",
            "prompt",
            "batches/s",
            "requests/s",
            "p50 ms",
            "p99 ms",
            "not ok",
            "cached",
            "cores w/c",
        ):
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
                _cores(r),
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
            "accepted->results -modelled",
            "results->final",
            "cores w/c",
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
            f"{ov['accepted_to_results_minus_modelled_ms_p50']:.2f}",
            f"{ov['results_to_final_ms_p50']:.2f}",
            _cores(ov),
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
            "cut",
            "cores w/c",
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
                f"{d['truncated_streams']}/{d['streams'] * d['reps']}",
                _cores(d),
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
            f"Added wall ms over the modelled {ov['modelled_ms_p50']:.0f} ms: "
            f"median **{ov['added_ms_p50']:.2f}**, "
            f"p99 {ov['added_ms_p99']:.2f} (target <= {OVERHEAD_TARGET_MS:g} ms: "
            f"{'met' if ov['meets_target'] else 'NOT met'}). Medians: send to `accepted` "
            f"{ov['send_to_accepted_ms_p50']:.2f} ms, `accepted` to `results` beyond the modelled time "
            f"{ov['accepted_to_results_minus_modelled_ms_p50']:.2f} ms, `results` to `final` "
            f"{ov['results_to_final_ms_p50']:.2f} ms.",
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
    decode_budget_s: float  # wall cap per decode repetition (a slow worker is cut, not waited for)
    new_tokens: int
    sizes: tuple[int, ...] = (1, 8, 32)
    lengths: tuple[int, ...] = (1024, 8192)


QUICK = Plan(1.5, warmup_batches=1, overhead_batches=15, decode_reps=1, decode_budget_s=6.0, new_tokens=128)
FULL = Plan(6.0, warmup_batches=3, overhead_batches=150, decode_reps=3, decode_budget_s=20.0, new_tokens=256)


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
                        meter=CpuMeter(prefill.proc.pid),
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
                        meter=CpuMeter(prefill.proc.pid),
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
                            new_tokens=args.new_tokens or plan.new_tokens,
                            reps=plan.decode_reps,
                            chunk_interval_ms=args.chunk_interval_ms,
                            seed=0,
                            budget_s=plan.decode_budget_s,
                            meter=CpuMeter(decode.proc.pid),
                        )
                    )
                    console.print(f"  decode {n:>3} streams: ratio {out[-1]['ratio']:.1%}")
                return out

            await section("decode_delivery", decode_all)
            with contextlib.suppress(Exception):
                results["decode_worker_status"] = _brief_status(await dc.status())
        finally:
            await dc.close()


def _json_safe(x: Any) -> Any:
    """NaN (an empty percentile) is not JSON; write null instead."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


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
    p.add_argument(
        "--new-tokens", type=int, default=0, help="max_new_tokens per decode stream (256; quick 128)"
    )
    p.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the workers (diagnosis, e.g. PYTRITON_NO_TENSORSTORE=1)",
    )
    p.add_argument(
        "--chunk-interval-ms", type=float, default=20.0, help="decode worker chunk interval (wall)"
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.worker_env):
        p.error("--worker-env takes KEY=VALUE")
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
    worker_env = dict(kv.split("=", 1) for kv in args.worker_env)
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "quick": args.quick,
            "plan": plan.__dict__,
            "sections": sorted(args.sections),
            "concurrency": args.concurrency,
            "overhead_formula": args.overhead_formula,
            "decode_streams": args.decode_streams,
            "new_tokens": args.new_tokens or plan.new_tokens,
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
            "worker_env": worker_env,
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
        workers = start_workers(specs, log_dir, worker_env)
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
    (out_dir / "results.json").write_text(json.dumps(_json_safe(results), indent=2, allow_nan=False) + "\n")
    (out_dir / "summary.md").write_text(summary_md(results))
    render(results)
    console.print(f"wrote {out_dir / 'results.json'} and summary.md in {results['wall_s']} s")
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
