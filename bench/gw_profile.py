"""Per-stage breakdown of a gateway's py-spy profile (collapsed stacks, as
`bench/gateway_overhead.py --py-spy DIR` records them).

Each sample is charged to the first stage that one of its frames matches, walking from the
innermost frame outwards: a Redis command issued by the hand-off counts as Redis, a log line
written at the end of a request counts as logging. The shares are of the samples py-spy took
while the gateway's threads were running or runnable; `--cpu-ms` (the bench's measured gateway
CPU per request) turns them into milliseconds per request.

    .venv/bin/python bench/gw_profile.py DIR/closed32-*.txt [--cpu-ms 2.1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# (stage, substrings of a frame): the first frame from the leaf that matches any rule decides
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("logging", ("logging/", "_JsonFormatter", "app/logs.py", "Endings._log")),
    ("Redis (client + commands)", ("app/state/", "redis/", "hiredis")),
    ("tokenisation", ("app/tokens/",)),
    ("gRPC prefill", ("WorkerClient.prefill", "prefill_event")),
    ("gRPC decode", ("WorkerClient.decode", "_decode_tokens")),
    ("gRPC (call set-up, streams)", ("grpc/", "app/rpc/", "tritonclient/")),
    ("reply (origin reads the owner's answer)", ("app/request/channels.py",)),
    (
        "response (encode + send)",
        (
            "starlette/responses.py",
            "serialize_response",
            "jsonable_encoder",
            "RequestResponseCycle.send",
            "watched_send",
            "send_wrapper",
            "app/api/streaming.py",
            "orjson",
        ),
    ),
    (
        "HTTP parse + validation",
        (
            "httptools_impl.py",
            "h11_impl.py",
            "solve_dependencies",
            "fastapi/_compat",
            "fastapi/dependencies",
            "pydantic",
            "app/api/",
            "starlette/requests.py",
            "json/decoder.py",
            "app/gateway/validation.py",
            "errors.py",
        ),
    ),
    ("scheduling", ("app/scheduling/", "app/request/routing_inputs.py", "app/cache/")),
    (
        "hand-off + owner dispatch",
        (
            "app/dispatch/",
            "app/request/record_stage.py",
            "app/request/handoff_round_trip.py",
            "app/request/handoff_stage.py",
        ),
    ),
    ("request pipeline (other)", ("app/request/",)),
    (
        "ASGI middleware + routing",
        (
            "app/security/",
            "prometheus_fastapi_instrumentator",
            "starlette/middleware",
            "starlette/_exception_handler",
            "fastapi/routing.py",
            "starlette/routing.py",
            "fastapi/applications.py",
            "starlette/applications.py",
            "uvicorn/middleware",
            "fastapi/telemetry",
            "fastapi/middleware",
            "opentelemetry",
            "trace/__init__",
        ),
    ),
    ("metrics", ("prometheus_client/", "app/metrics.py")),
    (
        "background loops (membership, polls, leases)",
        ("app/cluster/", "app/gateway/", "replica.py"),
    ),
    ("other threads (native code only: gRPC's poller, most likely)", ("Thread.run",)),
]
OTHER = "event loop (uvloop's native I/O and callbacks) + other"


def stage_of(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        for stage, subs in RULES:
            if any(s in frame for s in subs):
                if stage.startswith("gRPC (") and "WorkerClient.prefill" in stack:
                    return "gRPC prefill"  # its stream's set-up and I/O count to the call
                if stage.startswith("gRPC (") and "WorkerClient.decode" in stack:
                    return "gRPC decode"
                return stage
    return OTHER


def breakdown(files: Sequence[Path]) -> tuple[int, collections.Counter[str]]:
    total = 0
    by: collections.Counter[str] = collections.Counter()
    for f in files:
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack:
                continue
            total += int(n)
            by[stage_of(stack)] += int(n)
    return total, by


def table(files: Sequence[Path], cpu_ms: float | None) -> str:
    total, by = breakdown(files)
    rows = [
        "| stage | share of samples |" + (" ms CPU / request |" if cpu_ms else ""),
        "|---|---:|",
    ]
    if cpu_ms:
        rows[1] += "---:|"
    for stage in [s for s, _ in RULES] + [OTHER]:
        share = by.get(stage, 0) / total if total else 0.0
        row = f"| {stage} | {share * 100:.1f} % |"
        if cpu_ms:
            row += f" {share * cpu_ms:.2f} |"
        rows.append(row)
    rows.append(f"| (samples) | {total} |" + (f" {cpu_ms:.2f} |" if cpu_ms else ""))
    return "\n".join(rows)


class Profiler:
    """`py-spy record` on every gateway process for one phase (collapsed stacks, one file per
    process and phase), when `--py-spy DIR` asks for it; see docs/benchmarks.md for the
    per-stage breakdown read from these files."""

    def __init__(self, out: Path | None, pids: list[int]) -> None:
        self.out = out
        self.pids = pids

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.out is None:
            yield
            return
        self.out.mkdir(parents=True, exist_ok=True)
        spies = [
            subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--nonblocking",
                    "--output",
                    str(self.out / f"{name}-{pid}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid in self.pids
        ]
        time.sleep(0.5)  # py-spy attaches before the phase starts
        try:
            yield
        finally:
            for sp in spies:
                sp.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            for sp in spies:
                try:
                    sp.wait(15)
                except Exception:
                    sp.kill()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--cpu-ms", type=float, default=None, help="gateway CPU ms per request")
    args = p.parse_args(argv)
    print(table(args.files, args.cpu_ms))


if __name__ == "__main__":
    main()
