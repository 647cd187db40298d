"""Where one request's wall time goes on the gateway (issue #20's per-stage breakdown, by the clock
rather than by CPU samples): bench/gateway_overhead.py's sequential phase (1 replica, 1 prefill + 1
decode zero-time worker, `direct` schedule, 1,000-token prompts, 4 new tokens) with
bench/_timeline_hook on the gateway's PYTHONPATH, which marks HTTP in / out, each lean-client Redis
round trip, the owner's send and reply, the gRPC prefill and decode events and the terminal write.
Requests are cut at their HTTP marks; those with the run's commonest sequence of marks (the plain
path: no idle poll or background write in between) give the median of every step, and the steps
are summed by kind.

    .venv/bin/python bench/request_timeline.py [--requests 300] [--output DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "bench" / "_timeline_hook"


def requests_of(events: list[tuple[float, str]]) -> list[list[tuple[float, str]]]:
    out: list[list[tuple[float, str]]] = []
    cur: list[tuple[float, str]] | None = None
    for t, label in events:
        if label == "HTTP_IN":
            cur = [(t, label)]
            out.append(cur)
        elif cur is not None:
            cur.append((t, label))
            if label == "HTTP_OUT":
                cur = None
    return [r for r in out if r[-1][1] == "HTTP_OUT"]


def kind(prev: str, label: str) -> str:
    """The step from mark `prev` to mark `label`, by what the gateway waits on in it."""
    if prev.startswith("redis[") and prev.endswith(">"):
        return "Redis round trips (wall, incl. the scripts' time)"
    in_call = prev.startswith("grpc_") and (prev.endswith(">") or ":" in prev)
    if in_call and not label.startswith("owner_reply"):
        return "gRPC prefill + decode (as the direct path makes them)"
    if prev == "HTTP_IN":
        return "HTTP body read, parse, validation, routing, admission"
    if label.startswith("response_body") or label == "HTTP_OUT":
        return "response: encode and send"
    return "between stages (task switches, bookkeeping)"


def analyse(events: list[tuple[float, str]], skip: int = 20) -> dict[str, Any]:
    reqs = requests_of(events)
    seqs = collections.Counter(tuple(label for _, label in r) for r in reqs)
    seq, n = seqs.most_common(1)[0]
    rows = [r for r in reqs if tuple(label for _, label in r) == seq][skip:]
    steps = []
    by_kind: dict[str, float] = collections.defaultdict(float)
    for i in range(1, len(seq)):
        ms = statistics.median((r[i][0] - r[i - 1][0]) * 1000 for r in rows)
        steps.append({"from": seq[i - 1], "to": seq[i], "ms": round(ms, 3)})
        by_kind[kind(seq[i - 1], seq[i])] += ms
    total = statistics.median((r[-1][0] - r[0][0]) * 1000 for r in rows)
    return {
        "requests": len(reqs),
        "with_plain_sequence": n,
        "used": len(rows),
        "total_ms": round(total, 3),
        "steps": steps,
        "by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
    }


def table(res: dict[str, Any], direct_p50: float | None) -> str:
    lines = [
        f"{res['used']} requests of {res['requests']} (the plain path's {res['with_plain_sequence']}, "
        "the first 20 left out), medians:",
        "",
        "| step | ms |",
        "|---|---:|",
    ]
    lines += [f"| {s['from']} → {s['to']} | {s['ms']:.3f} |" for s in res["steps"]]
    lines += [f"| **total (HTTP in → out)** | **{res['total_ms']:.3f}** |", "", "| kind | ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res["by_kind"].items()]
    if direct_p50 is not None:
        lines += [
            "",
            f"The direct path (the same two gRPC calls, from the load generator): p50 {direct_p50:.3f} ms.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--output", type=Path, default=Path("bench-out/request_timeline"))
    a = p.parse_args(argv)
    a.output.mkdir(parents=True, exist_ok=True)
    marks = a.output / "marks"
    marks.mkdir(exist_ok=True)
    for f in marks.glob("*.json"):
        f.unlink()
    env = dict(os.environ, TIMELINE_DIR=str(marks))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HOOK), env.get("PYTHONPATH", "")) if x)
    cmd = [
        sys.executable, "bench/gateway_overhead.py", "--replicas", "1", "--prefill", "1", "--decode", "1",
        "--no-open-loop", "--concurrency", "1", "--e2e-n", str(a.requests), "--output", str(a.output / "run"),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    dumps = [json.loads(f.read_text()) for f in marks.glob("*.json")]
    events = max(dumps, key=len) if dumps else []  # the gateway's (no other process marks requests)
    if not events:
        print("no marks written: was the gateway started with the hook?", file=sys.stderr)
        return 1
    res = analyse([(t, label) for t, label in events])
    run = json.loads((a.output / "run" / "results.json").read_text())
    direct = (run.get("e2e") or {}).get("direct_p50_ms")
    res["direct_p50_ms"] = direct
    res["gateway_p50_ms"] = (run.get("e2e") or {}).get("gateway_p50_ms")
    (a.output / "timeline.json").write_text(json.dumps(res, indent=2) + "\n")
    md = table(res, direct)
    (a.output / "timeline.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
