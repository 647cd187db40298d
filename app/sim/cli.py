"""`flexlb simulate ARGS...`: argument parsing, progress and the stdout table (see app/sim/run.py)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from app.clihelp import ClickStyleParser
from app.config import Settings
from app.scheduling.batcher import BatcherConfig
from app.scheduling.policy import DECODE, PREFILL, PolicyBook
from app.sim.config import BATCHING, PROFILES, SimConfig
from app.sim.run import PolicySpec, prepare_trace, run_simulation, write_run
from app.traces import TraceError, load_trace, parse_slice

__all__ = ["build_parser", "main", "parse_policies"]


def parse_policies(spec: str, default_batching: str, book: PolicyBook | None = None) -> list[PolicySpec]:
    """``cost,round_robin@direct`` → specs. A name is a prefill policy of ``book`` (built-in and
    declared in FLEXLB_POLICIES); ``@batching`` overrides its batching, which is the policy's own
    when it declares one, else ``default_batching``."""
    book = book or PolicyBook(peers=True)
    known = book.names(PREFILL)
    out: list[PolicySpec] = []
    seen: set[str] = set()
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        strategy, _, batching = name.partition("@")
        if strategy not in known:
            raise ValueError(f"unknown policy {strategy!r}; known: {', '.join(known)}")
        batching = batching or book.get(PREFILL, strategy).batching or default_batching
        if batching not in BATCHING:
            raise ValueError(f"unknown batching {batching!r} in {name!r}; known: {', '.join(BATCHING)}")
        if name in seen:
            raise ValueError(f"policy {name!r} given twice")
        seen.add(name)
        out.append(PolicySpec(name, strategy, batching))
    if not out:
        raise ValueError("no policy given")
    return out


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = ClickStyleParser(
        prog="flexlb simulate",
        description=(
            "Discrete-event cluster simulation on a virtual clock: the gateway's real routing policies, "
            "batcher decisions and predictor drive the workers' real engine core. Trace block ids are "
            "the KV block keys. Writes results.json, summary.md, records.jsonl.gz and PNG plots."
        ),
    )
    ap.add_argument(
        "--trace", required=True, help="trace file (.jsonl or .jsonl.gz): flexlb, mooncake, synthetic"
    )
    ap.add_argument("--format", default="auto", help="auto (by fields), flexlb, mooncake or synthetic")
    ap.add_argument("--prefill", type=_positive_int, default=8, help="prefill workers")
    ap.add_argument("--decode", type=_positive_int, default=8, help="decode workers")
    ap.add_argument(
        "--policy",
        default="cost,prefix,least_load,round_robin",
        help=(
            "comma-separated prefill policies (built-in: "
            + ", ".join(PolicyBook(peers=True).names(PREFILL))
            + "; "
            "more in FLEXLB_POLICIES), each optionally NAME@BATCHING "
            "(default: cost,prefix,least_load,round_robin)"
        ),
    )
    ap.add_argument("--batching", default="window", choices=BATCHING, help="owner batching mode (window)")
    ap.add_argument("--replicas", type=_positive_int, default=1, help="gateway replicas")
    ap.add_argument(
        "--load",
        type=_positive_float,
        default=None,
        help="offered load as a fraction of the estimated prefill capacity (default: the trace's own times)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    ap.add_argument("--slice", default=None, help="A:B — requests A..B-1 of the trace, before replication")
    ap.add_argument("--copies", type=_positive_int, default=None, help="trace copies (default prefill // 8)")
    ap.add_argument("--max-requests", type=_positive_int, default=None, help="keep the first N arrivals")
    ap.add_argument("--profile", default="llama3.1-8b-h100", choices=PROFILES, help="engine timing model")
    ap.add_argument("--formula", default=None, help="gateway prefill-time formula (default: the profile's)")
    ap.add_argument(
        "--kv-capacity-tokens", type=_positive_int, default=None, help="prefill workers' KV (prefix cache)"
    )
    ap.add_argument("--slo-ttft-ms", type=_positive_float, default=3000.0, help="TTFT SLO for goodput")
    ap.add_argument("--decode-strategy", default=None, help="decode policy (default: FLEXLB_DECODE_STRATEGY)")
    ap.add_argument("--poll-interval-ms", type=_positive_float, default=None, help="owner poll interval")
    ap.add_argument("--handoff-latency-ms", type=float, default=1.0, help="origin → owner batcher")
    ap.add_argument("--reply-latency-ms", type=float, default=1.0, help="owner → origin reply")
    ap.add_argument(
        "--kv-handle-ttl-ms",
        type=_positive_float,
        default=30_000.0,
        help="how long a prefilled KV stays pinned when no decode fetches it (worker default 30000)",
    )
    ap.add_argument("--batch-max-size", type=_positive_int, default=None, help="batcher max_size")
    ap.add_argument("--batch-wait-ms", type=float, default=None, help="batcher wait_ms")
    ap.add_argument(
        "--max-inflight-batches", type=_positive_int, default=None, help="batcher in-flight limit"
    )
    ap.add_argument("--candidates", type=_positive_int, default=16, help="shortlist size for large fleets")
    ap.add_argument("--output", default=None, help="output folder (default sim_out/<trace>)")
    ap.add_argument("--quiet", action="store_true", help="no progress or table on stdout")
    ap.add_argument("--wide", action="store_true", help="print every column, however wide the terminal")
    return ap


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        book = PolicyBook(Settings().policies, peers=True)
        policies = parse_policies(args.policy, args.batching, book)
        slice_ = parse_slice(args.slice) if args.slice else None
    except ValueError as exc:
        ap.error(str(exc))
    base = BatcherConfig()
    over = {
        k: v
        for k, v in {
            "max_size": args.batch_max_size,
            "wait_ms": args.batch_wait_ms,
            "max_inflight_batches": args.max_inflight_batches,
        }.items()
        if v is not None
    }
    kw: dict[str, object] = {}
    if args.decode_strategy is not None:
        kw["decode_strategy"] = args.decode_strategy
    if args.poll_interval_ms is not None:
        kw["poll_interval_ms"] = args.poll_interval_ms
    try:
        from dataclasses import replace

        base = replace(base, **over)
        base.validate()
        cfg = SimConfig(
            prefill=args.prefill,
            decode=args.decode,
            replicas=args.replicas,
            seed=args.seed,
            profile=args.profile,
            formula=args.formula,
            kv_capacity_tokens=args.kv_capacity_tokens,
            slo_ttft_ms=args.slo_ttft_ms,
            handoff_latency_ms=args.handoff_latency_ms,
            reply_latency_ms=args.reply_latency_ms,
            kv_handle_ttl_ms=args.kv_handle_ttl_ms,
            candidates=args.candidates,
            batcher=base,
            **kw,  # type: ignore[arg-type]
        )
        cfg.validate()
        cfg.gateway_formula()
        cfg.policy_book().get(DECODE, cfg.decode_strategy)
    except (ValueError, TypeError) as exc:
        ap.error(str(exc))
    try:
        trace = load_trace(args.trace, args.format)
    except (OSError, TraceError) as exc:
        print(f"flexlb simulate: cannot read trace: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    trace, info = prepare_trace(
        trace, cfg, load=args.load, copies=args.copies, max_requests=args.max_requests, slice_=slice_
    )
    out_dir = Path(args.output) if args.output else Path("sim_out") / trace.name
    meta = {
        "command": "flexlb simulate " + shlex.join(argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load": args.load,
        **info,
    }
    if not args.quiet:
        print(
            f"{trace.name}: {len(trace):,} requests over {trace.span_ms / 1000:.1f} s "
            f"({trace.mean_rate_rps:.2f} req/s; estimated prefill capacity "
            f"{info['capacity_rps_estimate']:.2f} req/s), {cfg.prefill}P+{cfg.decode}D, "
            f"{cfg.replicas} replica(s)",
            flush=True,
        )

    def progress(name: str, k: int, n: int) -> None:
        if not args.quiet:
            print(f"[{k + 1}/{n}] simulating {name} ...", flush=True)

    run = run_simulation(trace, cfg, policies, base_batcher=base, meta=meta, progress=progress)
    run.meta["timing_s"]["total_s"] = round(time.perf_counter() - t0, 3)
    write_run(run, out_dir)
    if not args.quiet:
        from app.report import print_table

        print_table(run.policies, title=f"flexlb simulate — {trace.name}", wide=args.wide)
        print(f"wrote {out_dir}/results.json, summary.md, plots ({run.meta['timing_s']['total_s']:.1f} s)")
    return 0
