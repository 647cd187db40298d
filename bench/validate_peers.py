"""The peer imitations against the live routers, like with like (issue 15, Deliver 5).

One trace slice (sliced, time-scaled and output-clipped once, written to a file) goes through the
live sglang-router and vllm-router of `bench/compare_routers.sh` (2 prefill + 2 decode facades,
the same engine core and profile) and through `flexlb simulate` with the imitations
(`sglang_cache_aware`, `vllm_cache_aware` and the latter at vllm-router's command-line defaults,
which the live run uses), several seeds. For each it reports the engines' hit ratio (cached input
tokens / input tokens) and the hit its routing alone implies (each request's longest prefix among
the earlier requests routed to the same worker, as if no cache ever evicted): the second isolates
the routing decisions from what the engines then kept.

    nice -n 10 .venv/bin/python bench/validate_peers.py                 # live run + simulator
    nice -n 10 .venv/bin/python bench/validate_peers.py --live DIR      # reuse a live run's folder
    nice -n 10 .venv/bin/python bench/validate_peers.py --sim-only      # the simulator side alone
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import DEFAULT_OUT, ROOT, console

from app.traces.model import Trace, TraceRequest, load_trace, save_trace, scale_time, slice_trace

# vllm-router's command line sets SGLang's thresholds, not its library's (which the imitation keeps)
VLLM_CLI = {
    "vllm_cache_aware_cli": {
        "role": "prefill",
        "picker": {"name": "vllm_cache_aware", "cache_threshold": 0.3, "balance_abs": 64, "balance_rel": 1.5},
    }
}
LIVE = {"sglang-router": "sglang_cache_aware", "vllm-router": "vllm_cache_aware_cli"}


def prepare(args: argparse.Namespace, out: Path) -> Path:
    a, b = (int(x) for x in args.slice.split(":"))
    t = scale_time(slice_trace(load_trace(args.trace), a, b), args.speed)
    t = Trace(
        t.name,
        t.format,
        t.block_size,
        [
            TraceRequest(r.index, r.arrival_ms, r.input_len, min(r.output_len, args.max_out), r.block_hashes)
            for r in t.requests
        ],
    )
    path = out / "slice.jsonl.gz"
    save_trace(t, path)
    return path


def records(path: Path, policy: str | None = None) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        rs = [json.loads(line) for line in f]
    if policy is not None:
        rs = [r for r in rs if r["policy"] == policy]
    rs.sort(key=lambda r: int(str(r["request_id"]).rsplit("-", 1)[-1].lstrip("r")))
    return rs


def hits(trace: Trace, rs: list[dict[str, Any]]) -> tuple[float, float]:
    """(engine hit %, routing-implied hit %) of records ``rs`` in the trace's order."""
    assert len(rs) == len(trace.requests), (len(rs), len(trace.requests))
    held: dict[str, set[int]] = {}
    routed = cached = total = 0
    for r, q in zip(rs, trace.requests, strict=True):
        keys = trace.full_block_keys(q)
        tree = held.setdefault(str(r["prefill_worker"]), set())
        n = next((i for i, k in enumerate(keys) if k not in tree), len(keys))
        routed += n * trace.block_size
        cached += int(r["cached_tokens"] or 0)
        total += q.input_len
        tree.update(keys)
    return 100 * cached / total, 100 * routed / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT / "data/traces/trace_30min.jsonl.gz"))
    ap.add_argument("--slice", default="7000:7300")
    ap.add_argument("--speed", type=float, default=0.5)
    ap.add_argument("--max-out", type=int, default=256)
    # sglang_cache_aware draws a worker per request (sglang-router 0.3.2 in P/D mode has no tree):
    # its hit on this slice spans ~4 points over seeds, so 3 seeds' mean is not a steady reference.
    ap.add_argument("--seeds", type=int, default=10, help="simulator seeds")
    ap.add_argument(
        "--live", type=Path, help="a compare_routers.sh OUT folder of this slice (skips the live run)"
    )
    ap.add_argument(
        "--sim-only", action="store_true", help="only the simulator side (a change to the imitations)"
    )
    ap.add_argument("--output", type=Path, default=DEFAULT_OUT / "validate_peers")
    args = ap.parse_args()
    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    path = prepare(args, out)
    trace = load_trace(path)
    live = args.live
    if live is None and not args.sim_only:
        live = out / "live"
        env = {**os.environ, "TRACE": str(path), "SLICE": f"0:{len(trace.requests)}", "SPEED": "1"}
        env |= {"MAX_OUT": str(args.max_out), "SYSTEMS": "sglang vllm", "OUT": str(live)}
        subprocess.run(["bash", str(ROOT / "bench/compare_routers.sh")], env=env, check=True)
    env = {**os.environ, "FLEXLB_POLICIES": json.dumps(VLLM_CLI)}
    sim: dict[str, list[tuple[float, float]]] = {}
    names = ["sglang_cache_aware", "vllm_cache_aware", "vllm_cache_aware_cli"]
    for seed in range(args.seeds):
        so = out / f"sim-{seed}"
        cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "simulate",
            "--trace",
            str(path),
            "--prefill",
            "2",
            "--decode",
            "2",
        ]
        cmd += ["--policy", ",".join(names), "--copies", "1", "--slo-ttft-ms", "2000", "--seed", str(seed)]
        subprocess.run([*cmd, "--output", str(so), "--quiet"], env=env, check=True, cwd=ROOT)
        for n in names:
            sim.setdefault(n, []).append(hits(trace, records(so / "records.jsonl.gz", n)))
    rows = []
    for folder, imitation in {} if live is None else LIVE.items():
        eng, rt = hits(trace, records(live / folder / "records.jsonl.gz"))
        s_eng = sum(x[0] for x in sim[imitation]) / len(sim[imitation])
        s_rt = sum(x[1] for x in sim[imitation]) / len(sim[imitation])
        rows.append({"live": folder, "imitation": imitation, "live_hit": eng, "live_routing_hit": rt})
        rows[-1] |= {"imitation_hit": s_eng, "imitation_routing_hit": s_rt, "diff_hit": s_eng - eng}
    for n in names:
        if live is None or n not in LIVE.values():
            e = sum(x[0] for x in sim[n]) / len(sim[n])
            rt = sum(x[1] for x in sim[n]) / len(sim[n])
            span = f"{min(x[0] for x in sim[n]):.1f}-{max(x[0] for x in sim[n]):.1f}"
            rows.append({"live": "-", "imitation": n, "imitation_hit": e, "imitation_routing_hit": rt})
            rows[-1]["imitation_hit_span"] = span
    console.print(
        "| live router | imitation | live hit % | live routing-implied % | imitation hit % | its routing % |"
    )
    console.print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else "–" for k in ("live_hit", "live_routing_hit")]
        cells += [f"{r[k]:.1f}" if k in r else "–" for k in ("imitation_hit", "imitation_routing_hit")]
        console.print(f"| {r['live']} | {r['imitation']} | " + " | ".join(cells) + " |")
    (out / "validate_peers.json").write_text(
        json.dumps({"args": vars(args) | {"live": str(live)}, "rows": rows}, indent=2, default=str)
    )
    console.print(f"written {out / 'validate_peers.json'}")


if __name__ == "__main__":
    main()
