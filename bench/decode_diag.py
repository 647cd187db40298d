"""Where a policy's misses and TTFT go near the cliff (issue 15): rejections by reason, the served
requests' TTFT split into hand-off + prefill queue / prefill / reply, how long decode KV stays
reserved before the decode engine holds it, and the decode pool's state at each decode refusal.

A `ClusterSim` subclass that only observes (it changes no decision), so its runs are the runs of
`bench/cliff.py` / `flexlb simulate` with the same config:

    .venv/bin/python bench/decode_diag.py --trace chat_agents --loads 4,5,6 --policies cost,llmd_precise
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataclasses import replace

from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig
from app.sim.run import batcher_config, prepare_trace
from bench.cliff_specs import spec_flags, specs
from bench.cliff_workloads import workloads

DECODE_REFUSALS = ("decode_reserve_refused", "decode_no_kv_headroom")


class DiagSim(ClusterSim):
    """Notes per-request timestamps and, at every decode refusal, the decode pool's state."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        n = len(self.trace.requests)
        self.t_start: list[float | None] = [None] * n  # the prefill batch's engine start
        self.t_running: list[float | None] = [None] * n  # the decode engine runs it
        self.bid_members: dict[str, list[int]] = {}
        self.refusals: list[dict[str, float]] = []
        for d, eng in enumerate(self.deng):
            self._wrap_admit(d, eng)

    def _wrap_admit(self, d: int, eng: Any) -> None:
        orig = eng._admit

        def admit(rebased: bool = False) -> Any:
            before = set(eng._running)
            out = orig(rebased)
            for rid in eng._running:
                if rid not in before:
                    i = int(rid[1:])
                    if self.t_running[i] is None:
                        self.t_running[i] = eng.now
            return out

        eng._admit = admit

    def _dispatch(self, w: int, items: list[Any]) -> None:
        self.bid_members[f"b{self.n_batches + 1}"] = [p.payload for p in items]
        super()._dispatch(w, items)

    def _prefill_effects(self, w: int, effects: Any) -> None:
        for e in effects:
            if type(e).__name__ == "BatchStarted":
                for i in self.bid_members.get(e.batch_id, []):
                    if self.t_start[i] is None:
                        self.t_start[i] = e.t_ms
        super()._prefill_effects(w, effects)

    def _arrival(self, i: int) -> None:
        before = sum(self.rejections[r] for r in DECODE_REFUSALS)
        super()._arrival(i)
        if sum(self.rejections[r] for r in DECODE_REFUSALS) == before:
            return
        # The pool when refused: reserved, of it what requests not yet on the decode engine hold
        # (routed, in the prefill queue, prefilling, or in transfer), and the engine's own use.
        pre = [0] * len(self.deng)
        for st in self.reqs:
            if not st.done and st.reserved and st.t_first is None:
                pre[st.decode] += st.reserved
        cap = sum(e.capacity for e in self.deng)
        # Decode-side prefix sharing the engines do not model: of the running sequences' prompt
        # tokens, those in full blocks another running sequence on the same worker also holds.
        dup = 0
        for eng in self.deng:
            seen: set[Any] = set()
            for rid in eng._running:
                for k in self.trace.full_block_keys(self.trace.requests[int(rid[1:])]):
                    if k in seen:
                        dup += self.bs
                    else:
                        seen.add(k)
        tr = self.trace.requests[i]
        self.refusals.append(
            {
                "reserved": sum(self.reserved) / cap,
                "pre_decode": sum(pre) / cap,
                "engine_used": sum(
                    e.kv_view()["kv_total_tokens"] - e.kv_view()["kv_free_tokens"] for e in self.deng
                )
                / cap,
                "shared_dup": dup / cap,
                "need": (tr.input_len + self.out_est.reserve(max(1, tr.output_len))) / self.deng[0].capacity,
            }
        )


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def diagnose(sim: DiagSim, slo_ms: float) -> dict[str, Any]:
    queue, prefill, wait_dec, held_pre, ttft = [], [], [], [], []
    late = served = 0
    for i, (tr, st) in enumerate(zip(sim.trace.requests, sim.reqs, strict=True)):
        if st.error is not None or st.t_first is None:
            continue
        served += 1
        t = st.t_first - tr.arrival_ms
        ttft.append(t)
        late += t > slo_ms
        s = sim.t_start[i]
        if s is not None:
            queue.append(s - tr.arrival_ms)
            prefill.append(st.t_first - s)
        if tr.output_len > 1:
            held_pre.append(t)  # decode KV reserved at arrival, on the engine from t_first
            if sim.t_running[i] is not None:
                wait_dec.append(sim.t_running[i] - st.t_first)
    n = len(sim.trace.requests)
    ref = sim.refusals

    def m(xs: list[float]) -> dict[str, float]:
        return {
            "mean": round(statistics.fmean(xs), 1) if xs else 0.0,
            "p50": round(_pct(xs, 50), 1),
            "p99": round(_pct(xs, 99), 1),
        }

    return {
        "requests": n,
        "goodput_pct": round(100 * (served - late) / n, 2),
        "rejections": dict(sim.rejections),
        "served_late": late,
        "unfinished_or_failed": sum(1 for st in sim.reqs if st.error is not None)
        - sum(sim.rejections.values()),
        "ttft_ms": m(ttft),
        "arrival_to_prefill_start_ms": m(queue),
        "prefill_ms": m(prefill),
        "prefill_end_to_decode_running_ms": m(wait_dec),
        "reserved_before_decode_ms": m(held_pre),
        "at_decode_refusal": {k: round(statistics.fmean(r[k] for r in ref), 3) for k in ref[0]}
        if ref
        else {},
        "decode_preemptions": sum(e.preemptions for e in sim.deng),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="chat_agents")
    ap.add_argument("--loads", default="4,5,6")
    ap.add_argument("--policies", default="cost")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    trace = workloads([args.trace], args.max_requests)[args.trace]
    cfg = SimConfig(replicas=args.replicas, seed=args.seed)
    out: dict[str, Any] = {}
    for load in (float(x) for x in args.loads.split(",")):
        tr, _ = prepare_trace(trace, cfg, load=load, copies=None, max_requests=None, slice_=None)
        for spec in specs(args.policies.split(",")):
            flags = spec_flags(spec.name)
            c = replace(cfg, **dict(flags)) if flags else cfg
            sim = DiagSim(tr, c, spec.strategy, batcher_config(spec.batching, c.slo_ttft_ms, None))
            sim.run()
            out.setdefault(spec.name, {})[str(load)] = d = diagnose(sim, c.slo_ttft_ms)
            print(f"{spec.name} load {load}: {json.dumps(d)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
