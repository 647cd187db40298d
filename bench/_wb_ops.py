"""The workers benchmark's prefill measurements, (a) throughput and (b) path overhead, and the
clock and CPU meters every section shares (see bench/workers_bench.py; (c) decode delivery is
bench/_wb_decode.py)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from _harness import CpuMeter, console, pct, r2

from app.protocol.blocks import block_keys, namespace_seed
from app.rpc.worker_client import PromptKeys, WorkerClient
from app.state.handoff import pack_keys, unpack_keys

VOCAB = 128_000  # Llama-3 vocabulary is 128,256 ids; any int32 works, this keeps prompts plausible
OVERHEAD_TARGET_MS = 10.0


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
            st = brief_status(await client.status(timeout=5.0))
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


def brief_status(st: dict[str, Any]) -> dict[str, Any]:
    """The status fields a run report keeps (the full status is long and mostly counters)."""
    keep = (
        "role",
        "profile",
        "time_scale",
        "lag_ms",
        "max_lag_ms",
        "batches_done",
        "max_live_batches",
        "tokens_total",
        "avg_step_ms",
        "kv_free_tokens",
        "kv_released",
    )
    return {k: st[k] for k in keep if k in st}
