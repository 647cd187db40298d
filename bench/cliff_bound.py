"""bench/cliff.py against the full-block pooled-LRU bound: ``--ceiling`` (how much prefill work
cache reuse can save, the bound's and each policy's) and ``--lost`` (where a policy's routed hits
fall short of the bound, by cause)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from app.protocol.blocks import hit_blocks_cap
from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig, batcher_config
from app.sim.run import PolicySpec, prepare_trace, run_simulation
from app.traces import Trace
from app.traces.bounds import _lru_hits
from bench.cliff_specs import spec_flags, specs
from bench.cliff_workloads import workloads


def ceiling(tr: Trace, cfg: SimConfig, pols: list[PolicySpec]) -> dict[str, float]:
    """How much prefill work cache reuse can save: Σ predict(L, hit) ÷ Σ predict(L, 0) with the
    hits of the full-block pooled-LRU bound (``bound``, all requests: no router over this memory
    does better) and with each policy's routed hits (``NAME``, its served requests), and
    ``NAME/bound``: the policy's work ÷ the bound's work on the same served requests.

    A policy's capacity ÷ another's cannot exceed the inverse ratio of their prefill work unless
    the other also balances its queues worse: with equal balance, a baseline's ``NAME/bound`` is
    the most any cache-aware routing can gain over it."""
    f = cfg.gateway_formula()
    bs = tr.block_size
    lru = _lru_hits(tr, cfg.prefill * cfg.engine_profile().kv_capacity_tokens)
    cold = [f.predict_one(r.input_len, 0) for r in tr.requests]
    bound = [
        f.predict_one(r.input_len, min(h * bs, r.input_len)) for h, r in zip(lru, tr.requests, strict=True)
    ]
    out = {"bound": sum(bound) / sum(cold)}
    for p in pols:
        flags = spec_flags(p.name)
        cfg_p = replace(cfg, **dict(flags)) if flags else cfg
        recs = run_simulation(tr, cfg_p, [p]).records[p.name]
        served = [i for i, r in enumerate(recs) if r.ttft_ms is not None]
        work = sum(f.predict_one(recs[i].input_tokens, recs[i].cached_tokens) for i in served)
        out[p.name] = work / sum(cold[i] for i in served) if served else float("nan")
        out[f"{p.name}/bound"] = work / sum(bound[i] for i in served) if served else float("nan")
    return out


def run_ceiling(args: argparse.Namespace) -> int:
    """``--ceiling``: the prefill-work table (see `ceiling`) per workload, replica count and load."""
    pols = specs(args.policies.split(","))
    lines = [
        "| workload | replicas | load | bound work | "
        + " | ".join(f"{p.name} work" for p in pols)
        + " | "
        + " | ".join(f"{p.name} ÷ bound (same requests)" for p in pols)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * (2 * len(pols)),
    ]
    for tname, trace in workloads(args.traces.split(","), args.max_requests).items():
        for nrep in (int(x) for x in args.replicas.split(",")):
            cfg = SimConfig(prefill=args.prefill, decode=args.decode, replicas=nrep)
            for load in (float(x) for x in args.loads.split(",")):
                tr, _ = prepare_trace(trace, cfg, load=load, copies=None, max_requests=None, slice_=None)
                c = ceiling(tr, cfg, pols)
                cells = [f"{c[p.name]:.3f}" for p in pols] + [f"{c[p.name + '/bound']:.3f}" for p in pols]
                lines.append(
                    f"| {tname} | {nrep} | {load:g} | {c['bound']:.3f} | " + " | ".join(cells) + " |"
                )
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


class _LostHits(ClusterSim):
    """`ClusterSim` that notes, at each routing, how many leading blocks every prefill engine
    really holds and what the routing replica's mirror said (for ``--lost``)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.seen: dict[int, tuple[list[int], dict[str, int]]] = {}

    def _arrival(self, i: int) -> None:
        r = self.trace.requests[i]
        keys = self.trace.full_block_keys(r)
        cap = hit_blocks_cap(r.input_len, self.bs)
        true = [min(e.cache.match_prefix(keys), cap) if keys else 0 for e in self.peng]
        rep = self.replicas[i % self.cfg.replicas]
        self.seen[i] = (true, dict(rep.prefill_query(r.input_len, keys, self.now).hit_blocks))
        super()._arrival(i)


def lost_hits(tr: Trace, cfg: SimConfig, policy: str) -> dict[str, float]:
    """Where a policy's routed hits fall short of the pooled-LRU bound, per served request, as
    shares of the bound's tokens: ``routed_away_known`` (a worker held more of the prompt at
    routing, the replica's mirror knew, the policy chose another), ``routed_away_unseen`` (held,
    the mirror did not know), ``nobody_held`` (no engine held it yet: its earlier prompt still in
    flight, or evicted), ``evicted_in_queue`` (the chosen worker held it at routing, not at start)."""
    lru = _lru_hits(tr, cfg.prefill * cfg.engine_profile().kv_capacity_tokens)
    sim = _LostHits(tr, cfg, policy, batcher_config("window", cfg.slo_ttft_ms))
    sim.run()
    bs = tr.block_size
    lost: dict[str, float] = dict.fromkeys(
        ("routed_away_known", "routed_away_unseen", "nobody_held", "evicted_in_queue", "other"), 0.0
    )
    bound = got = 0
    for r, h in zip(tr.requests, lru, strict=True):
        st = sim.reqs[r.index]
        if st.prefill < 0 or st.t_first is None:
            continue
        b = min(h * bs, r.input_len)
        bound += b
        got += st.cached
        if b <= st.cached:
            continue
        true, view = sim.seen[r.index]
        held, mine = max(true) * bs, true[st.prefill] * bs
        if held < b:
            k = "nobody_held"
        elif mine < held:
            known = max(view.values(), default=0) * bs >= held
            k = "routed_away_known" if known else "routed_away_unseen"
        elif st.cached < mine:
            k = "evicted_in_queue"
        else:
            k = "other"
        lost[k] += b - st.cached
    out = {k: v / bound for k, v in lost.items()} if bound else lost
    out["hit_of_bound"] = got / bound if bound else float("nan")
    return out


def run_lost(args: argparse.Namespace) -> int:
    """``--lost``: `lost_hits` of each policy per workload, replica count and load."""
    for tname, trace in workloads(args.traces.split(","), args.max_requests).items():
        for nrep in (int(x) for x in args.replicas.split(",")):
            for p in specs(args.policies.split(",")):
                flags = spec_flags(p.name)
                cfg = SimConfig(prefill=args.prefill, decode=args.decode, replicas=nrep)
                cfg = replace(cfg, **dict(flags)) if flags else cfg
                for load in (float(x) for x in args.loads.split(",")):
                    tr, _ = prepare_trace(trace, cfg, load=load, copies=None, max_requests=None, slice_=None)
                    d = lost_hits(tr, cfg, p.strategy)
                    parts = ", ".join(f"{k} {100 * v:.1f}" for k, v in d.items() if k != "hit_of_bound")
                    print(
                        f"{tname} r={nrep} load={load:g} {p.name}: hit/bound {d['hit_of_bound']:.3f};"
                        f" lost (% of bound): {parts}",
                        flush=True,
                    )
    return 0
