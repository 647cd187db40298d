"""Batching benchmark on a virtual clock: `direct` vs `fixed_window` vs `slo`.

Drives the gateway's real batcher decisions (`app/scheduling/batcher.py`) and the workers' real
prefill engine core (`workers/engine/prefill.py`) with Poisson arrivals, one prefill worker, no
I/O and no wall clock, so the numbers are exact modelled times and reproducible from the seed.

    .venv/bin/python bench/batching_bench.py [--requests 4000] [--seed 1] [--output bench/out]

For each engine model (upstream's fitted formula shape and the `llama3.1-8b-h100` roofline) and
each load (30% and 90% of `direct`'s capacity, capacity = 1 / mean batch-of-one time), it reports
TTFT p50/p99 (prefill completion − arrival, modelled ms), goodput at an SLO of 2 × `direct`'s
unloaded TTFT p50, mean batch size and flush reasons. Targets (issue): at 30% load the TTFT p50
of the batching algorithms is within 5% of `direct`; at 90% load `fixed_window`'s goodput is
≥ 1.3 × `direct`'s on the fitted formula.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from app.scheduling.batcher import Batcher, BatcherConfig, Pending
from app.scheduling.formula import UPSTREAM_FITTED_FORMULA, BatchItem
from workers.engine.effects import BatchDone, PrefillResult
from workers.engine.prefill import PrefillEngine, PrefillRequest
from workers.engine.profiles import EngineProfile, formula_profile, get_profile

BLOCK = 64


def prompt_lengths(n: int, rng: random.Random) -> list[int]:
    """Log-normal prompt lengths, median ~1,500 tokens, clipped to [64, 16K]."""
    return [max(64, min(16_384, int(rng.lognormvariate(7.3, 0.8)))) for _ in range(n)]


def simulate(
    profile: EngineProfile, cfg: BatcherConfig, lengths: list[int], rate_per_ms: float, seed: int
) -> dict:
    rng = random.Random(seed)
    eng = PrefillEngine(profile, block_size=BLOCK, kv_capacity_tokens=50_000_000, kv_handle_ttl_ms=0.001)
    batcher = Batcher(cfg, lambda items: profile.prefill_batch_ms(items))
    arrivals: list[tuple[float, int]] = []
    t = 0.0
    for i in range(len(lengths)):
        t += rng.expovariate(rate_per_ms)
        arrivals.append((t, i))
    arrival_at = {f"r{i}": a for a, i in arrivals}
    ttft: dict[str, float] = {}
    sizes: list[int] = []
    reasons: Counter[str] = Counter()
    timers: list[float] = []
    ai = 0
    now = 0.0
    n_batches = 0
    while len(ttft) < len(lengths):
        cands = []
        if ai < len(arrivals):
            cands.append(arrivals[ai][0])
        ne = eng.next_event_time()
        if ne is not None:
            cands.append(ne)
        while timers and timers[0] <= now:
            heapq.heappop(timers)
        if timers:
            cands.append(timers[0])
        if not cands:
            break
        now = max(now, min(cands))
        for eff in eng.advance_to(now):
            if isinstance(eff, PrefillResult):
                ttft[eff.request_id] = eff.end_ms - arrival_at[eff.request_id]
            elif isinstance(eff, BatchDone):
                batcher.batch_finished()
        while ai < len(arrivals) and arrivals[ai][0] <= now:
            a, i = arrivals[ai]
            n = lengths[i]
            batcher.add(Pending(f"r{i}", n, 0, a, profile.prefill_batch_ms([BatchItem(n, 0)]), None))
            ai += 1
        while True:
            d = batcher.decide(now)
            for p, _code in d.failed:
                ttft[p.id] = float("inf")
            if not d.items:
                if d.wake_at_ms is not None:
                    heapq.heappush(timers, d.wake_at_ms)
                break
            batcher.batch_started()
            n_batches += 1
            sizes.append(len(d.items))
            reasons[d.reason] += 1
            reqs = [
                PrefillRequest(
                    p.id, p.input_tokens, tuple(rng.getrandbits(63) for _ in range(p.input_tokens // BLOCK))
                )
                for p in d.items
            ]
            eng.submit(f"b{n_batches}", reqs, now)
    vals = sorted(ttft.values())
    span_ms = max(arrival_at.values())
    return {
        "ttft_p50_ms": statistics.median(vals),
        "ttft_p99_ms": vals[int(0.99 * (len(vals) - 1))],
        "mean_batch_size": statistics.mean(sizes),
        "flush_reasons": dict(reasons),
        "ttft": vals,
        "span_ms": span_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", default="bench/out")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lengths = prompt_lengths(args.requests, rng)
    models = {
        "upstream_fitted": formula_profile(UPSTREAM_FITTED_FORMULA),
        "llama3.1-8b-h100": get_profile("llama3.1-8b-h100"),
    }
    algos = {
        "direct": BatcherConfig(mode="direct", max_inflight_batches=1),
        "fixed_window": BatcherConfig(),
        "slo": BatcherConfig(algorithm="slo"),
    }
    out: dict[str, Any] = {"requests": args.requests, "seed": args.seed, "models": {}}
    for mname, prof in models.items():
        mean_t1 = statistics.mean(prof.prefill_batch_ms([BatchItem(n, 0)]) for n in lengths)
        cap = 1.0 / mean_t1  # direct's capacity, requests per ms
        unloaded = simulate(prof, algos["direct"], lengths[:500], cap * 0.01, args.seed)["ttft_p50_ms"]
        slo = 2 * unloaded
        res: dict[str, Any] = {"direct_capacity_rps": cap * 1000, "slo_ttft_ms": slo, "loads": {}}
        for load in (0.3, 0.9):
            row = {}
            for aname, cfg in algos.items():
                if aname == "slo":
                    cfg = BatcherConfig(algorithm="slo", slo_ttft_ms=slo)
                r = simulate(prof, cfg, lengths, cap * load, args.seed)
                good = sum(1 for v in r.pop("ttft") if v <= slo)
                r["goodput_rps"] = good / (r.pop("span_ms") / 1000)
                row[aname] = r
            for aname in ("fixed_window", "slo"):
                row[aname]["ttft_p50_vs_direct"] = row[aname]["ttft_p50_ms"] / row["direct"]["ttft_p50_ms"]
                row[aname]["goodput_vs_direct"] = row[aname]["goodput_rps"] / max(
                    row["direct"]["goodput_rps"], 1e-9
                )
            res["loads"][f"{int(load * 100)}%"] = row
        out["models"][mname] = res
    outdir = Path(args.output)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "batching.json").write_text(json.dumps(out, indent=2))
    for mname, res in out["models"].items():
        cap, slo = res["direct_capacity_rps"], res["slo_ttft_ms"]
        print(f"\n{mname}: direct capacity {cap:.2f} req/s, SLO {slo:.0f} ms")
        print(
            f"{'load':>5} {'algorithm':>13} {'p50 ms':>9} {'p99 ms':>10} {'goodput':>8} {'x direct':>8} "
            f"{'batch':>6}  flushes"
        )
        for load, row in res["loads"].items():
            for aname, r in row.items():
                p50, p99, good = r["ttft_p50_ms"], r["ttft_p99_ms"], r["goodput_rps"]
                ratio, size = r.get("goodput_vs_direct", 1.0), r["mean_batch_size"]
                print(
                    f"{load:>5} {aname:>13} {p50:9.1f} {p99:10.1f} {good:8.2f} {ratio:8.2f} {size:6.2f}  "
                    f"{r['flush_reasons']}"
                )
    print(f"\nwrote {outdir / 'batching.json'}")


if __name__ == "__main__":
    main()
