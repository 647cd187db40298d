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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import DEFAULT_OUT, Proc, console, json_safe, start_workers, stop_on_sigterm
from _wb_decode import decode_delivery
from _wb_ops import CoreMeter, brief_status, prefill_overhead, prefill_throughput
from _wb_paths import direct_paths
from _wb_report import render, summary_md

from app.rpc.worker_client import WorkerClient


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
    prefill: Proc | None,
    decode: Proc | None,
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
                        meter=CoreMeter(prefill.pid),
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
                        meter=CoreMeter(prefill.pid),
                    ),
                )
            with contextlib.suppress(Exception):
                results["prefill_worker_status"] = brief_status(await pc.status())
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
                            meter=CoreMeter(decode.pid),
                        )
                    )
                    console.print(f"  decode {n:>3} streams: ratio {out[-1]['ratio']:.1%}")
                return out

            await section("decode_delivery", decode_all)
            with contextlib.suppress(Exception):
                results["decode_worker_status"] = brief_status(await dc.status())
        finally:
            await dc.close()


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
        help="comma-separated subset of prefill,overhead,decode,paths (paths: not by default)",
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
    p.add_argument("--path-requests", type=int, default=300, help="(d) sequential requests per path")
    args = p.parse_args(argv)
    if any("=" not in kv for kv in args.worker_env):
        p.error("--worker-env takes KEY=VALUE")
    unknown = args.sections - {"prefill", "overhead", "decode", "paths"}
    if unknown:
        p.error(f"unknown sections: {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    out_dir: Path = args.output
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()
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
    workers: list[Proc] = []
    try:
        console.print(f"starting {', '.join(r for r, _ in specs)} worker(s)...")
        workers = start_workers(specs, log_dir, worker_env, attempts=2) if specs else []
        results["workers"] = {
            w.role: {k: w.info.get(k) for k in ("address", "epoch", "startup_s")} for w in workers
        }
        by_role = {w.role: w for w in workers}
        if specs:
            asyncio.run(run_all(args, plan, by_role.get("prefill"), by_role.get("decode"), results))
        if "paths" in args.sections:
            console.print("[bold]direct_paths[/bold]")
            try:
                results["direct_paths"] = direct_paths(log_dir, args.path_requests)
            except Exception as exc:  # keep the other sections' results
                results.setdefault("errors", {})["direct_paths"] = f"{type(exc).__name__}: {exc}"
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
    (out_dir / "results.json").write_text(json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    (out_dir / "summary.md").write_text(summary_md(results))
    render(results)
    console.print(f"wrote {out_dir / 'results.json'} and summary.md in {results['wall_s']} s")
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
