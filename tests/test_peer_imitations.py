"""The peer router imitations are registry plugins and built-in policies like every strategy
(one place to add one), and behave as the routers they imitate."""

from __future__ import annotations

import random
from typing import Any

from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, compile_formula
from app.scheduling.plugins import registry
from app.scheduling.policy import Policy, PolicyBook
from app.scheduling.routing import PrefillQuery, WorkerView
from app.sim.cli import parse_policies
from app.sim.cluster import ClusterSim
from app.sim.config import SimConfig, batcher_config
from app.traces import synthetic_trace

PEERS = ("sglang_cache_aware", "vllm_cache_aware", "llmd_precise", "dynamo_kv")
FORMULA = compile_formula(DEFAULT_PREFILL_FORMULA)


def workers(n: int = 4, **kw: object) -> list[WorkerView]:
    return [
        WorkerView(f"p{i}", "prefill", kv_total_tokens=100_000, kv_free_tokens=100_000, **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]


BOOK = PolicyBook(peers=True)


def make_prefill_policy(name: str, **kw: object) -> Policy:
    return BOOK.build("prefill", name, FORMULA, **kw)


def test_registered_as_pickers_and_policies() -> None:
    book = BOOK
    for name in PEERS:
        assert name in registry.names("picker", "prefill")
        assert name in book.names("prefill")
        assert name not in PolicyBook().names("prefill")  # the live gateway's book
        pol = make_prefill_policy(name)
        assert pol.peer
    assert not make_prefill_policy("cost").peer
    # Published defaults are parameters, overridable like any plugin's.
    assert registry.get("picker", "vllm_cache_aware").params["cache_threshold"] == 0.5
    assert make_prefill_policy("sglang_cache_aware", balance_abs=8).picker.balance_abs == 8
    assert [s.name for s in parse_policies(",".join(PEERS), "window", book)] == list(PEERS)


def test_cache_aware_follows_its_own_tree_and_balances_in_flight() -> None:
    # The algorithm with a tree (sglang-router 0.3.2's P/D mode never sets one up, see below).
    pol = make_prefill_policy("sglang_cache_aware", uses_tree=True)
    rng = random.Random(1)
    keys = (11, 12, 13, 14)
    q = PrefillQuery(4 * 64 + 10, {}, 64, keys)
    first = pol.choose(q, workers(), rng).worker_id
    # Its tree (not the engines' caches: no hits here) brings the same prefix back.
    assert {pol.choose(q, workers(), rng).worker_id for _ in range(5)} == {first}
    # Until its own in-flight count there is imbalanced beyond 64 and 1.5x: then the least loaded.
    for _ in range(70):
        pol.picker._routed(first, q)  # type: ignore[attr-defined]
        pol.picker.inflight[first] = pol.picker.inflight.get(first, 0) + 1  # type: ignore[attr-defined]
    assert pol.choose(q, workers(), rng).worker_id != first
    # `finished` takes finished prefills off the count.
    n = pol.picker.inflight[first]  # type: ignore[attr-defined]
    pol.finished(first, q)
    assert pol.picker.inflight[first] == n - 1  # type: ignore[attr-defined]


def test_cache_aware_below_the_threshold_goes_least_loaded_not_to_the_smallest_tree() -> None:
    """As measured against the live routers (docs/benchmarks.md, peer imitations against the live
    routers): vllm-router sends a prompt matching at most `cache_threshold` of its characters to
    the least-loaded worker, the first of a tie, so on an idle cluster every new prefix lands on
    the first worker — not to the smallest tree (which would alternate here)."""
    new = [PrefillQuery(10 * 64, {}, 64, tuple(range(100 * i, 100 * i + 10))) for i in range(40)]
    vllm = make_prefill_policy("vllm_cache_aware")
    rng = random.Random(3)
    picks = []
    for q in new:
        w = vllm.choose(q, workers(2), rng).worker_id
        picks.append(w)
        vllm.finished(w, q)  # sequential: nothing in flight at the next one
    assert set(picks) == {"p0"}
    # The match rate is over the prompt's characters (tokens here), its unhashed tail included:
    # 1 of 3 full blocks plus a 63-token tail is 64 / 255 = 0.25, below 0.3 (1 / 3 blocks was not).
    away = 0
    for seed in range(20):
        pol, r = make_prefill_policy("vllm_cache_aware", cache_threshold=0.3), random.Random(seed)
        home = pol.choose(PrefillQuery(64, {}, 64, (1,)), workers(2), r).worker_id
        pol.finished(home, PrefillQuery(64, {}, 64, (1,)))
        pol.picker.inflight["p0"] = 1  # type: ignore[attr-defined]  # p1 least loaded from here
        assert pol.choose(PrefillQuery(64 + 10, {}, 64, (1,)), workers(2), r).worker_id == home
        away += pol.choose(PrefillQuery(3 * 64 + 63, {}, 64, (1, 7, 8)), workers(2), r).worker_id != "p1"
    assert away == 0, away


def test_vllm_takes_the_least_loaded_of_the_best_matching_workers() -> None:
    """vllm-router's `select_prepared`: above the threshold, the least loaded among the workers
    with the best match rate (the first of a tie), not a draw among them."""
    pol = make_prefill_policy("vllm_cache_aware")
    rng = random.Random(0)
    q = PrefillQuery(4 * 64, {}, 64, (1, 2, 3, 4))
    for w in ("p0", "p1"):  # both hold the prefix; p0 is busier
        pol.picker._routed(w, q)  # type: ignore[attr-defined]
    pol.picker.inflight.update({"p0": 3, "p1": 1})  # type: ignore[attr-defined]
    assert pol.choose(q, workers(3), rng).worker_id == "p1"
    pol.picker.inflight.update({"p0": 0, "p1": 0, "p2": 0})  # type: ignore[attr-defined]
    assert pol.choose(q, workers(3), rng).worker_id == "p0"  # a tie: the first of the holders


def test_sglang_in_pd_mode_has_no_tree_and_draws_a_worker() -> None:
    """sglang-router 0.3.2's P/D router never initialises its prefill policy's tree, so every
    request takes the "no tree found, using random worker selection" branch (its debug log, on
    every request of the probe in docs/benchmarks.md): a repeated prompt does not come back."""
    sg = make_prefill_policy("sglang_cache_aware")
    rng = random.Random(5)
    q = PrefillQuery(16 * 64, {}, 64, tuple(range(16)))
    picks = []
    for _ in range(60):
        w = sg.choose(q, workers(2), rng).worker_id
        picks.append(w)
        sg.finished(w, q)
    assert 15 <= picks.count("p0") <= 45, picks
    assert not sg.picker.trees  # type: ignore[attr-defined]  # nothing recorded
    # The balance rule still runs first: past 64 in flight and 1.5x, the least loaded.
    sg.picker.inflight.update({"p0": 70, "p1": 0})  # type: ignore[attr-defined]
    assert all(sg.choose(q, workers(2), rng).worker_id == "p1" for _ in range(5))  # 70 - 5 > 64


def test_dynamo_counts_its_in_flight_prefill_blocks() -> None:
    pol = make_prefill_policy("dynamo_kv")
    rng = random.Random(0)
    q = PrefillQuery(640, {}, 64)
    picks = [pol.choose(q, workers(3), rng).worker_id for _ in range(3)]
    assert sorted(picks) == ["p0", "p1", "p2"]  # each pick adds 10 blocks where it went
    for w in picks:
        pol.finished(w, q)
    assert all(v == 0 for v in pol.picker.inflight_blocks.values())  # type: ignore[attr-defined]


def test_llmd_prefers_the_shorter_queue_and_the_prefix() -> None:
    pol = make_prefill_policy("llmd_precise")
    ws = [
        WorkerView("a", "prefill", kv_total_tokens=100_000, kv_free_tokens=100_000, queue_len=5),
        WorkerView("b", "prefill", kv_total_tokens=100_000, kv_free_tokens=100_000, queue_len=0),
    ]
    assert pol.choose(PrefillQuery(1000, {}, 64), ws, random.Random(0)).worker_id == "b"
    # 15 of 15 full blocks held on a: prefix 3 x 0.96 outweighs queue 2 x 1.
    assert pol.choose(PrefillQuery(1000, {"a": 15}, 64), ws, random.Random(0)).worker_id == "a"


def test_simulator_runs_them_by_name_without_admission() -> None:
    t = synthetic_trace(
        300, 300.0, prefix_groups=6, prefix_blocks=4, unique_blocks=2, block_size=64, output_len=4, seed=5
    )
    for name in PEERS:
        sim = ClusterSim(
            t, SimConfig(prefill=3, decode=2, seed=1, replicas=2), name, batcher_config("window", 3000)
        )
        recs = sim.run().records
        assert all(r.error is None for r in recs), name
        assert not sim.rejections
        # every routed prefill was taken off the in-flight counts again
        for rep in sim.replicas:
            assert not any(rep.pstrat.picker.inflight.values()), name  # type: ignore[attr-defined]


class _PeakReserved(ClusterSim):
    """`ClusterSim` noting the most decode KV the gateway held reserved on any worker after each
    arrival (where the origin reserves)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.peak_reserved = 0

    def _arrival(self, i: int) -> None:
        super()._arrival(i)
        self.peak_reserved = max(self.peak_reserved, *self.reserved)


def test_peer_imitations_reserve_no_decode_kv_and_their_engines_preempt() -> None:
    """The routers imitated reserve nothing on decode workers: they pick one by their own policy
    and the engine (vLLM, SGLang) admits on the KV a sequence uses, preempting (recompute) when it
    runs out. So under decode pressure that makes FlexLB's own gateway refuse (its reservation of
    prompt + max_new_tokens), the imitations refuse nothing and their engines preempt instead."""
    # 80 prompts of 16K tokens and 8K outputs in 4 s on 2 decode workers of 450K tokens: the
    # reservations (24K each) fill the decode KV after 36 requests; the prompts alone do not.
    t = synthetic_trace(
        80, 20.0, prefix_groups=1, prefix_blocks=0, unique_blocks=4, block_size=4096, output_len=8000, seed=3
    )
    cfg = SimConfig(prefill=4, decode=2, seed=1, slo_ttft_ms=60_000)
    own = _PeakReserved(t, cfg, "cost", batcher_config("window", 60_000))
    own.run()
    assert (
        own.rejections.get("decode_no_kv_headroom", 0) + own.rejections.get("decode_reserve_refused", 0) > 0
    )
    assert own.peak_reserved > 400_000
    assert {e.admission for e in own.deng} == {"reserve"}  # FlexLB's own policies: unchanged
    for name in PEERS:
        sim = _PeakReserved(t, cfg, name, batcher_config("window", 60_000))
        out = sim.run()
        assert not sim.rejections, (name, sim.rejections)
        assert all(r.error is None for r in out.records), name
        assert sim.peak_reserved == 0, name
        assert {e.admission for e in sim.deng} == {"expected"}, name
        assert out.extra["decode_preemptions"] > 0, name
        # both decode workers used, and every decode pick taken off the router's in-flight counts
        assert {r.decode_worker for r in out.records} == set(sim.dids), name
        assert not any(sim.replicas[0].pstrat.picker.inflight.values()), name  # type: ignore[attr-defined]
