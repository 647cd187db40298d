"""Scheduling at the cliff (issue 15): goodput, TTFT and rejections around and past capacity.

For each workload (the shipped traces and a synthetic one), load, replica count and policy, one
`flexlb simulate` run (the real routing, batching, admission and engine code on a virtual clock);
prints one markdown table per workload and writes every figure to --output (JSON).

    nice -n 10 .venv/bin/python bench/cliff.py --max-requests 2000 --output bench_out/cliff

Goodput % = requests whose TTFT met the SLO / all requests (a rejection counts as a miss).
Capacity = the highest load of the sweep at which goodput ≥ 90 %.
hit/bound = routed hit ratio / the full-block pooled-LRU bound (token-weighted).
Rejections by reason: what the origin refused before any engine saw the request.

The workloads are in bench/cliff_workloads.py, the policy names and their suffixes in
bench/cliff_specs.py, the tables in bench/cliff_render.py, ``--ceiling`` and ``--lost`` in
bench/cliff_bound.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.sim.config import SimConfig
from app.sim.run import PolicySpec, prepare_trace, run_simulation
from app.traces import Trace
from bench.cliff_bound import run_ceiling, run_lost
from bench.cliff_render import render
from bench.cliff_specs import spec_flags, specs
from bench.cliff_workloads import workloads

LOADS = (0.5, 0.7, 1.0, 1.2, 1.5, 2.0)
POLICIES = (
    "cost",  # the default: cost routing, window batching, SLO admission, fresh pick, shared entries
    "cost@direct",
    "cost-fresh-shared",  # the default before the fresh pick and shared speculative entries
    "cost-shared",  # without the speculative entries shared through the owner
    "cost-fresh",  # without Policy.second_look on fresh load
    "prefix",
    "least_load",
    "round_robin",
    "sglang_cache_aware",
    "vllm_cache_aware",
    "llmd_precise",
    "dynamo_kv",
)


def run_specs(
    tr: Trace, cfg: SimConfig, todo: list[PolicySpec], tpot_slo_ms: float | None = None
) -> dict[str, dict[str, Any]]:
    """Each spec's summary; those with suffixes in runs of their own with those flags on. With
    ``tpot_slo_ms``, also ``goodput_tpot_ratio``: the share of requests whose TTFT met the SLO and
    whose TPOT (a single-token answer has none) stayed within ``tpot_slo_ms``: goodput counts TTFT
    only, so a decode side that admits everything and preempts shows its cost only there."""
    out: dict[str, dict[str, Any]] = {}
    for flags in sorted({spec_flags(p.name) for p in todo}):
        group = [p for p in todo if spec_flags(p.name) == flags]
        cfg_g = replace(cfg, **dict(flags)) if flags else cfg
        res = run_simulation(tr, cfg_g, group)
        for p in group:
            m = dict(res.policies[p.name])
            if tpot_slo_ms is not None:
                recs = res.records[p.name]
                good = sum(
                    1
                    for r in recs
                    if r.error is None
                    and r.ttft_ms is not None
                    and r.ttft_ms <= cfg_g.slo_ttft_ms
                    and (r.tpot_ms is None or r.tpot_ms <= tpot_slo_ms)
                )
                m["goodput_tpot_ratio"] = good / len(recs) if recs else 0.0
            out[p.name] = m
    return {p.name: out[p.name] for p in todo}


def row(m: dict[str, Any]) -> dict[str, Any]:
    bound = m.get("hit_ratio_pooled_lru") or 0.0
    return {
        "goodput_pct": round(100 * m["goodput_ratio"], 2),
        "goodput_rps": round(m["goodput_rps"], 3),
        "ttft_p50_ms": m["ttft_p50_ms"],
        "ttft_p99_ms": m["ttft_p99_ms"],
        "hit_routed": round(m["hit_ratio_routed"], 4),
        "hit_bound": round(bound, 4),
        "hit_of_bound": round(m["hit_ratio_routed"] / bound, 3) if bound else None,
        "rejections": m.get("rejections", {}),
        "errors": m.get("errors", {}),
        "mean_batch": m.get("mean_batch_size"),
        "tpot_p99_ms": m.get("tpot_p99_ms"),
        "e2e_p99_ms": m.get("e2e_p99_ms"),
        "decode_preemptions": m.get("decode_preemptions", 0),
        **(
            {"goodput_tpot_pct": round(100 * m["goodput_tpot_ratio"], 2)} if "goodput_tpot_ratio" in m else {}
        ),
    }


def mean_row(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seeds averaged: numbers by their mean, rejection and error counts summed / seeds."""
    if len(rs) == 1:
        return rs[0]
    out: dict[str, Any] = {"seeds": len(rs)}
    for k, v in rs[0].items():
        if isinstance(v, dict):
            keys = {kk for r in rs for kk in r[k]}
            out[k] = {kk: round(sum(r[k].get(kk, 0) for r in rs) / len(rs), 1) for kk in sorted(keys)}
        elif isinstance(v, int | float) and all(isinstance(r[k], int | float) for r in rs):
            out[k] = round(sum(r[k] for r in rs) / len(rs), 4)
        else:
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="conversation_trace,trace_30min,synthetic,chat_agents")
    ap.add_argument("--loads", default=",".join(str(x) for x in LOADS))
    ap.add_argument("--replicas", default="1,4")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--max-requests", type=int, default=None, help="first N requests of each workload")
    ap.add_argument("--output", default="bench_out/cliff")
    ap.add_argument(
        "--fresh-pick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cost: power of two on fresh load (default: the live setting, on)",
    )
    ap.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=None,
        help="also goodput_tpot_pct in the JSON: TTFT within the SLO and TPOT within this",
    )
    ap.add_argument("--seeds", type=int, default=2, help="seeds for the --repeat policies (averaged)")
    ap.add_argument("--repeat", default="cost,cost@direct", help="policies run with every seed")
    ap.add_argument("--render", default=None, help="only render this cliff.json as markdown")
    ap.add_argument("--ceiling", action="store_true", help="only the prefill-work ceiling table")
    ap.add_argument("--lost", action="store_true", help="only where routed hits fall short of the bound")
    args = ap.parse_args(argv)
    if args.ceiling:
        return run_ceiling(args)
    if args.lost:
        return run_lost(args)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    loads = [float(x) for x in args.loads.split(",")]
    reps = [int(x) for x in args.replicas.split(",")]
    pols = specs(args.policies.split(","))
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for tname, trace in workloads(args.traces.split(","), args.max_requests).items():
        for nrep in reps:
            cfg = SimConfig(prefill=args.prefill, decode=args.decode, replicas=nrep)
            if args.fresh_pick is not None:
                cfg = replace(cfg, fresh_pick=args.fresh_pick)
            for load in loads:
                tr, _info = prepare_trace(trace, cfg, load=load, copies=None, max_requests=None, slice_=None)
                rows: dict[str, list[dict[str, Any]]] = {}
                for seed in range(args.seeds):
                    # Extra seeds only for the policies named in --repeat: the pair whose difference
                    # the 1-point target is about; one seed's noise is ~±1.5 points.
                    todo = pols if seed == 0 else [p for p in pols if p.name in args.repeat.split(",")]
                    if not todo:
                        continue
                    for pname, m in run_specs(tr, replace(cfg, seed=seed), todo, args.tpot_slo_ms).items():
                        rows.setdefault(pname, []).append(row(m))
                for pname, rs in rows.items():
                    out = results.setdefault(tname, {}).setdefault(str(nrep), {}).setdefault(pname, {})
                    out[str(load)] = mean_row(rs)
                print(f"{tname} r={nrep} load={load}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
                # written as it goes: a long sweep cut short still leaves its rows
                (out_dir / "cliff.json").write_text(json.dumps(results, indent=1))
    md = render(results)
    (out_dir / "cliff.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
