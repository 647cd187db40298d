"""`flexlb bench`: replay a trace slice (or synthetic Poisson load) against a running gateway and
write results.json, summary.md and plots (app/report), named after the gateway's policy."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import platform
import secrets
import sys
from pathlib import Path
from typing import Any

import httpx
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.clihelp import ClickStyleParser
from app.loadgen.gateway import AdminClient, FacadeStatus, GatewayError, GatewayInfo, LagMonitor
from app.loadgen.plan import LimitReport, apply_limits, build_plan, clip_outputs, poisson_retime
from app.loadgen.prompts import BlockSizeError, PromptSynth, check_block_size
from app.loadgen.replay import ReplayConfig, ReplayStats, replay
from app.report import RequestRecord, percentile, print_table, summarize, write_results
from app.traces import (
    Trace,
    TraceError,
    load_trace,
    parse_slice,
    scale_time,
    slice_trace,
    synthetic_trace,
    trace_bounds,
)

#: Engines that woke later than this share of a typical TTFT (mean sampled lag / TTFT p50) did not
#: keep the modelled schedule, so the run measured the machine, not the policy.
MAX_LAG_RATIO = 0.05
_API_PATH = {"native": "/v1/generate", "completions": "/v1/completions"}


class BenchSettings(BaseSettings):
    """Environment defaults of the bench (FLEXLB_ prefix, shared with the gateway's own token)."""

    model_config = SettingsConfigDict(env_prefix="FLEXLB_", extra="ignore")
    admin_token: str | None = None
    api_key: str | None = None


def build_parser() -> argparse.ArgumentParser:
    p = ClickStyleParser(
        prog="flexlb bench",
        description="Replay a request trace (or synthetic Poisson load) against a running FlexLB gateway, "
        "open loop, and write results.json, summary.md and PNG plots.",
    )
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="trace file (.jsonl or .jsonl.gz)")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic requests, Poisson at --rate")
    p.add_argument("--format", default="auto", choices=["auto", "flexlb", "mooncake", "synthetic"])
    p.add_argument("--slice", default=None, metavar="A:B", help="replay requests A..B-1 of the trace")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--speed", type=float, default=1.0, help="arrival-time compression (2 = twice as fast)")
    t.add_argument("--rate", type=float, default=None, help="Poisson re-timing at R req/s (order kept)")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0, help="TTFT objective for goodput")
    p.add_argument("--output", type=Path, default=None, help="results folder (default bench/results/...)")
    p.add_argument("--concurrency-limit", type=int, default=256, help="most requests in flight")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request deadline")
    p.add_argument("--admin-token", default=None, help="gateway admin token (env FLEXLB_ADMIN_TOKEN)")
    p.add_argument("--api-key", default=None, help="tenant API key for FLEXLB_AUTH=keys (env FLEXLB_API_KEY)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="clip trace output lengths")
    p.add_argument(
        "--over-limit",
        default="clip",
        choices=["clip", "skip"],
        help="rows above the gateway's max_tokens / context limits: clip them to fit or leave them out "
        "(either way the summary names them)",
    )
    p.add_argument("--wide", action="store_true", help="print every column, however wide the terminal")
    p.add_argument("--seed", type=int, default=None, help="prompt salt and re-timing seed (default random)")
    p.add_argument("--model", default=None, help="model name to send (default: the gateway's)")
    p.add_argument("--lag-interval-s", type=float, default=1.0, help="engine-lag sampling interval")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    peer = p.add_argument_group("other routers (no FlexLB admin API: bench/compare_routers.sh)")
    peer.add_argument("--api", default="native", choices=["native", "completions"], help="client API")
    peer.add_argument("--peer-name", default=None, help="results name; skips the FlexLB admin API")
    peer.add_argument(
        "--facade-status", default=None, help="comma-separated facade URLs for block size, KV and lag"
    )
    peer.add_argument("--worker-block-size", type=int, default=64, help="peer mode: workers' block size")
    g = p.add_argument_group("synthetic load (--synthetic N)")
    g.add_argument("--prefix-groups", type=int, default=8, help="shared prefixes")
    g.add_argument("--prefix-blocks", type=int, default=16, help="blocks per shared prefix")
    g.add_argument("--unique-blocks", type=int, default=4, help="blocks unique to each request")
    g.add_argument("--block-size", type=int, default=None, help="synthetic block size (default: workers')")
    g.add_argument("--output-len", type=int, default=64, help="output tokens per synthetic request")
    return p


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.synthetic is not None and args.rate is None:
        parser.error("--synthetic needs --rate (requests per second)")
    if args.synthetic is not None and args.synthetic <= 0:
        parser.error("--synthetic must be > 0")
    if args.speed <= 0 or (args.rate is not None and args.rate <= 0):
        parser.error("--speed and --rate must be > 0")
    if args.concurrency_limit < 1 or args.timeout_s <= 0:
        parser.error("--concurrency-limit must be >= 1 and --timeout-s > 0")
    if args.max_output_tokens is not None and args.max_output_tokens < 1:
        parser.error("--max-output-tokens must be >= 1")
    if args.peer_name and not args.facade_status:
        parser.error("--peer-name needs --facade-status (the simulated workers' facade URLs)")


def prepare_trace(args: argparse.Namespace, info: GatewayInfo, seed: int) -> Trace:
    """The trace exactly as it will be replayed: loaded or generated, sliced, re-timed, clipped."""
    if args.synthetic is not None:
        bs = args.block_size or info.prefill[0].block_size or 64
        trace = synthetic_trace(
            args.synthetic,
            args.rate,
            prefix_groups=args.prefix_groups,
            prefix_blocks=args.prefix_blocks,
            unique_blocks=args.unique_blocks,
            block_size=bs,
            output_len=args.output_len,
            seed=seed,
        )
    else:
        trace = load_trace(args.trace, args.format)
        if args.slice:
            trace = slice_trace(trace, *parse_slice(args.slice))
        if args.rate is not None:
            trace = poisson_retime(trace, args.rate, seed)
        elif args.speed != 1.0:
            trace = scale_time(trace, args.speed)
    if args.max_output_tokens is not None:
        trace = clip_outputs(trace, args.max_output_tokens)
    return trace


def _redact_argv(argv: list[str]) -> list[str]:
    """The command line as results record it, without the admin token."""
    out = list(argv)
    for i, a in enumerate(out):
        for secret in ("--admin-token", "--api-key"):
            if a == secret and i + 1 < len(out):
                out[i + 1] = "***"
            elif a.startswith(secret + "="):
                out[i] = secret + "=***"
    return out


def lag_verdict(mean_lag_ms: float, ttft_p50_ms: float | None) -> tuple[float | None, bool]:
    """(mean lag / TTFT p50, valid). No TTFT (every request failed) cannot be judged: valid."""
    if not ttft_p50_ms or ttft_p50_ms <= 0:
        return None, True
    ratio = mean_lag_ms / ttft_p50_ms
    return ratio, ratio <= MAX_LAG_RATIO


def build_results(
    trace: Trace,
    info: GatewayInfo,
    records: list[RequestRecord],
    stats: ReplayStats,
    lag: LagMonitor,
    args: argparse.Namespace,
    seed: int,
    limit_report: LimitReport | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(policy metrics, meta) as results.json carries them."""
    metrics = summarize(records, slo_ttft_ms=args.slo_ttft_ms, duration_s=stats.wall_s)
    metrics.update(trace_bounds(trace, info.kv_capacity_tokens))
    mean_lag = lag.mean_lag_ms()
    ratio, lag_ok = lag_verdict(mean_lag, metrics.get("ttft_p50_ms"))
    metrics["engine_lag_mean_ms"] = mean_lag
    metrics["engine_lag_max_ms"] = lag.run_max_lag_ms()
    zero_rows = sum(1 for r in trace.requests if r.output_len == 0)
    notes: list[str] = []
    reasons: list[str] = []
    if zero_rows:
        notes.append(
            f"{zero_rows} of {len(trace.requests)} trace rows logged no output; they were replayed as "
            "max_tokens 1 (prefill only)."
        )
    if args.max_output_tokens is not None:
        notes.append(f"output lengths clipped to {args.max_output_tokens} tokens (--max-output-tokens).")
    if limit_report is not None:
        notes.extend(limit_report.notes())
    if not lag_ok:
        reasons.append(
            f"engines fell behind the modelled schedule: mean lag {mean_lag:.1f} ms is "
            f"{100 * (ratio or 0):.1f}% of TTFT p50 (limit {100 * MAX_LAG_RATIO:.0f}%)"
        )
    incidents = lag.worker_incidents()
    if incidents:
        reasons.append("workers failed mid-run: " + "; ".join(incidents))
    if stats.prompt_token_mismatches:
        reasons.append(
            f"{stats.prompt_token_mismatches} prompts were not tokenised to the trace's input length "
            f"(index, want, got: {stats.mismatch_examples}); is the gateway's tokenizer byte-level?"
        )
    scales = info.time_scales
    if scales != [1.0]:
        notes.append(
            f"workers run at time scale {scales}: latencies are wall-clock ms, not modelled ms; "
            "policy comparisons belong at time scale 1."
        )
    if stats.slot_waits:
        notes.append(
            f"{stats.slot_waits} sends waited for a concurrency slot (limit {args.concurrency_limit}): "
            "arrivals were not fully open-loop."
        )
    if reasons:
        notes.insert(0, "INVALID RUN: " + "; ".join(reasons))
    source = f"synthetic({args.synthetic} @ {args.rate} rps)" if args.synthetic else str(args.trace)
    meta: dict[str, Any] = {
        "title": f"flexlb bench: {trace.name} on {info.policy_name}",
        "tool": "bench",
        "valid": not reasons,
        "invalid_reasons": reasons,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
        "machine": f"{platform.node()} ({platform.machine()}, {platform.system()})",
        "command": "flexlb bench " + " ".join(_redact_argv(args.argv)),
        "url": info.url,
        "trace": source,
        "trace_format": trace.format,
        "trace_block_size": trace.block_size,
        "worker_block_size": info.prefill[0].block_size,
        "slice": args.slice,
        "speed": args.speed if args.rate is None else None,
        "rate_rps": args.rate,
        "requests": len(trace.requests),
        "span_s": round(trace.span_ms / 1000.0, 3),
        "slo_ttft_ms": args.slo_ttft_ms,
        "seed": seed,
        "zero_output_rows": zero_rows,
        "over_limit_rows": limit_report.affected if limit_report is not None else 0,
        "over_limit": limit_report.as_dict() if limit_report is not None else None,
        "prefill_strategy": info.prefill_strategy,
        "decode_strategy": info.decode_strategy,
        "schedule_mode": info.schedule_mode,
        "batch_algorithm": info.batch_algorithm,
        "prefill_workers": len(info.prefill),
        "decode_workers": len([w for w in info.workers if w.role == "decode"]),
        "kv_capacity_tokens": info.kv_capacity_tokens,
        "time_scale": scales[0] if len(scales) == 1 else scales,
        "engine_lag_ratio": ratio,
        "client_send_lag_p99_ms": percentile(stats.send_lag_ms, 99),
        "client_slot_waits": stats.slot_waits,
        "prompt_token_mismatches": stats.prompt_token_mismatches,
        "measurement": f"client-side, streamed {_API_PATH[args.api]}: TTFT = first token event - send",
        "notes": notes,
        "gateway_config": info.config,
    }
    return metrics, meta


async def run_bench(args: argparse.Namespace) -> int:
    token = args.admin_token or BenchSettings().admin_token
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    async with httpx.AsyncClient() as http:
        admin: AdminClient | FacadeStatus
        if args.peer_name:
            urls = [u for u in args.facade_status.split(",") if u]
            admin = FacadeStatus(http, urls, args.worker_block_size)
            info = await admin.info(args.url, args.peer_name)
        else:
            admin = AdminClient(http, args.url, token)
            info = await admin.info()
        trace, limit_report = apply_limits(prepare_trace(args, info, seed), info.limits, args.over_limit)
        if not trace.requests:
            raise GatewayError("nothing to replay: the slice is empty")
        check_block_size(trace.block_size, [w.block_size for w in info.prefill])
        plan = build_plan(trace)
        synth = PromptSynth(trace.block_size, salt=seed)
        cfg = ReplayConfig(
            url=args.url,
            run_id=f"bench-{seed:x}-{secrets.token_hex(3)}",
            timeout_s=args.timeout_s,
            concurrency_limit=args.concurrency_limit,
            model=args.model,
            api=args.api,
            api_key=args.api_key or BenchSettings().api_key,
        )
        lag = LagMonitor(admin, interval_s=args.lag_interval_s)
        await lag.start()
        stop = asyncio.Event()
        lag_task = asyncio.create_task(lag.run(stop))
        try:
            records, stats = await _replay_with_progress(cfg, plan, synth, not args.no_progress)
        finally:
            stop.set()
            await lag_task
    metrics, meta = build_results(trace, info, records, stats, lag, args, seed, limit_report)
    out = args.output or Path("bench/results") / f"bench-{dt.datetime.now():%Y%m%d-%H%M%S}"
    write_results(out, {info.policy_name: metrics}, {info.policy_name: records}, meta)
    print_table({info.policy_name: metrics}, title=meta["title"], wide=args.wide)
    for n in meta["notes"]:
        print(f"note: {n}")
    print(f"results: {out}/results.json")
    return 0


async def _replay_with_progress(
    cfg: ReplayConfig, plan: list[Any], synth: PromptSynth, show: bool
) -> tuple[list[RequestRecord], ReplayStats]:
    if not show:
        return await replay(cfg, plan, synth)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    errors = 0
    with Progress(
        TextColumn("[bold]replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    ) as prog:
        task = prog.add_task("replay", total=len(plan), status="")

        def done(r: RequestRecord) -> None:
            nonlocal errors
            errors += r.error is not None
            prog.update(task, advance=1, status=f"errors {errors}")

        return await replay(cfg, plan, synth, on_done=done)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)
    _validate(args, parser)
    try:
        return asyncio.run(run_bench(args))
    except (GatewayError, BlockSizeError, TraceError, ValueError, OSError) as exc:
        print(f"flexlb bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flexlb bench: interrupted", file=sys.stderr)
        return 130
