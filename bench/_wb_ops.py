"""The workers benchmark's measurements: (a) prefill throughput, (b) prefill path overhead, (c) decode
delivery (see bench/workers_bench.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _harness import CpuMeter, console, pct, r2

from app.protocol.blocks import block_keys, namespace_seed
from app.rpc.worker_client import PromptKeys, WorkerClient
from app.state.handoff import pack_keys, unpack_keys
from workers.engine.tokens import output_tokens

VOCAB = 128_000  # Llama-3 vocabulary is 128,256 ids; any int32 works, this keeps prompts plausible
OVERHEAD_TARGET_MS = 10.0
DELIVERY_TARGET = 0.90


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


class CoreMeter:
    """CPU cores used by this client and by one worker's process tree (worker, tritonserver, stubs).

    On a 2-core box the client competes with the worker it measures; reporting both shows when a
    figure is the box's ceiling rather than the worker's."""

    def __init__(self, worker_pid: int) -> None:
        self.me = CpuMeter([os.getpid()])
        self.worker = CpuMeter([worker_pid], tree=True)

    def start(self) -> tuple[float, float, float]:
        return time.monotonic(), self.me.seconds(), self.worker.seconds()

    def cores(self, since: tuple[float, float, float]) -> dict[str, float]:
        now = self.start()
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


async def run_batch(
    client: WorkerClient, epoch: str, reqs: list[tuple[str, np.ndarray]], keys: PromptKeys | None = None
) -> BatchOutcome:
    """One prefill batch, send to `final`; the modelled span is min(start_ms)..max(end_ms).
    Bounded by BATCH_TIMEOUT_S: a wedged worker must fail the section, not hang the bench."""
    try:
        async with asyncio.timeout(BATCH_TIMEOUT_S):
            return await _run_batch(client, epoch, reqs, keys)
    except TimeoutError:
        try:  # say whether the worker itself is stuck or only this stream
            st = _brief_status(await client.status(timeout=5.0))
            st["live"] = (await client.status(timeout=5.0)).get("live")
        except Exception as exc:
            st = {"status_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        raise RuntimeError(
            f"prefill batch got no `final` within {BATCH_TIMEOUT_S:g} s; worker: {st}"
        ) from None


async def _run_batch(
    client: WorkerClient, epoch: str, reqs: list[tuple[str, np.ndarray]], keys: PromptKeys | None
) -> BatchOutcome:
    t_sent = time.monotonic()
    t_acc = t_res = t_fin = float("nan")
    ok = bad = cached = 0
    starts: list[float] = []
    ends: list[float] = []
    err = ""
    async for ev in client.prefill(uuid.uuid4().hex, epoch, reqs, keys=keys):
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
    meter: CoreMeter,
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
    meter: CoreMeter,
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
    st = await client.status()
    bs = int(st["block_size"])

    space = namespace_seed("flexlb-sim", "byte", bs)

    def hashed(reqs: list[tuple[str, np.ndarray]]) -> PromptKeys:
        """The keys as the gateway's owner has them: hashed by routing at the origin, carried in
        the hand-off entry and unpacked from it (the worker's default key space)."""
        carried = [unpack_keys(pack_keys(space, block_keys(t, bs))) for _, t in reqs]
        return PromptKeys(space, [c[1] for c in carried if c is not None])

    # Three arms in turn, so a shared box's load hits them alike: the client hashes the prompts
    # into block keys (the gateway's owner before issue 20's carried keys, and still for an entry
    # without them), the keys come hashed (what the gateway's owner does: routing's keys travel
    # in the hand-off entry), token ids (the path before block keys: the worker decodes and hashes
    # 4 bytes a token).
    ids_client = WorkerClient(client.address, block_keys=False)
    cpu0 = meter.start()
    outs: list[BatchOutcome] = []
    given: list[BatchOutcome] = []
    by_ids: list[BatchOutcome] = []
    try:
        for i in range(batches):
            reqs = src.batch("ov", size, length)
            if i % 3 == 1:
                given.append(await run_batch(client, epoch, reqs, hashed(reqs)))
            elif i % 3 == 2:
                by_ids.append(await run_batch(ids_client, epoch, reqs))
            else:
                outs.append(await run_batch(client, epoch, reqs))
    finally:
        await ids_client.close()
    cpu = meter.cores(cpu0)
    st = await client.status()
    scale = float(st["time_scale"])
    added = [o.wall_ms - o.modelled_ms * scale for o in outs]
    added_given = [o.wall_ms - o.modelled_ms * scale for o in given]
    added_ids = [o.wall_ms - o.modelled_ms * scale for o in by_ids]
    accepted = [(o.t_accepted - o.t_sent) * 1000 for o in outs]
    middle = [(o.t_results - o.t_accepted) * 1000 - o.modelled_ms * scale for o in outs]
    tail = [(o.t_final - o.t_results) * 1000 for o in outs]
    return {
        "formula": formula,
        "batch_size": size,
        "prompt_tokens": length,
        "batches": len(outs) + len(given) + len(by_ids),
        "modelled_ms_p50": r2(pct([o.modelled_ms for o in outs], 50)),
        "wall_ms_p50": r2(pct([o.wall_ms for o in outs], 50)),
        "added_ms_p50": r2(pct(added, 50)),
        "added_ms_p99": r2(pct(added, 99)),
        "added_ms_max": r2(max(added)),
        "added_keys_given_ms_p50": r2(pct(added_given, 50)),
        "added_keys_given_ms_p99": r2(pct(added_given, 99)),
        "added_token_ids_ms_p50": r2(pct(added_ids, 50)),
        "added_token_ids_ms_p99": r2(pct(added_ids, 99)),
        "send_to_accepted_ms_p50": r2(pct(accepted, 50)),
        "accepted_to_results_minus_modelled_ms_p50": r2(pct(middle, 50)),
        "results_to_final_ms_p50": r2(pct(tail, 50)),
        "worker_max_lag_ms": r2(st.get("max_lag_ms", float("nan"))),
        "not_ok": sum(o.n_bad for o in outs),
        **cpu,
        "target_ms": OVERHEAD_TARGET_MS,
        # the gateway's path: the owner sends the keys the hand-off entry carries from routing
        "meets_target": bool(pct(added_given, 50) <= OVERHEAD_TARGET_MS),
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
