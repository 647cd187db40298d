"""Imitations of peer routers, for the simulator's comparisons (issue 15, Deliver 5).

Each is named after what it imitates and keeps that router's published defaults. They run inside
`ClusterSim` per gateway replica (each peer router instance only knows its own decisions, as a
deployment of several router replicas would), on the same views and cache knowledge the FlexLB
strategies get, plus what these routers track themselves: the request's block keys and their own
count of requests in flight per worker.

- ``sglang_cache_aware``: SGLang router's `cache_aware` policy. An approximate radix tree per
  worker built from the router's own routing decisions (not the engines' caches). If the load is
  imbalanced (max − min in-flight > `balance_abs_threshold` and max > `balance_rel_threshold` ×
  min) the request goes to the least-loaded worker; otherwise to the worker with the longest
  prefix match when the match rate exceeds `cache_threshold`, else to the worker whose tree is
  smallest. Defaults 0.3 / 64 / 1.5.
- ``vllm_cache_aware``: vLLM router's `cache_aware`, the same algorithm with its library
  defaults 0.5 / 32 / 1.1.
- ``llmd_precise``: llm-d's scheduler profile with the precise prefix-cache scorer (KV events:
  here the cache mirror's hits), the queue scorer and the KV-cache-utilisation scorer, weights
  3:2:2; the highest weighted score wins.
- ``dynamo_kv``: Dynamo's KV router cost, `overlap_weight × prefill_blocks + decode_blocks`
  (prefill blocks: blocks the prompt must compute there plus the router's own in-flight prefill
  blocks on it; decode blocks: KV blocks active on the worker), lowest wins, overlap_weight 1.

Pure (no clock, no I/O): the simulator passes everything in.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.scheduling.formula import Formula
from app.scheduling.routing import Choice, NoWorker, PrefillQuery, WorkerView, eligible_prefill

__all__ = ["PEERS", "PeerRouter", "make_peer"]


@dataclass
class PeerRouter:
    """State and decision of one peer imitation in one gateway replica."""

    name: str
    formula: Formula
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5
    max_tree_blocks: int = 1 << 20  # SGLang's default tree bound is ~2^26 chars: effectively none
    inflight: dict[str, int] = field(default_factory=dict)  # worker → our requests not yet prefilled
    inflight_blocks: dict[str, int] = field(default_factory=dict)
    trees: dict[str, OrderedDict[int, None]] = field(default_factory=dict)

    def choose(
        self,
        keys: Sequence[int],
        q: PrefillQuery,
        views: Sequence[WorkerView],
        rng: random.Random,
        waiting: dict[str, int] | None = None,
    ) -> Choice:
        ws, hits = eligible_prefill(q, views)
        if not ws:
            raise NoWorker("no prefill worker")
        if self.name in ("sglang_cache_aware", "vllm_cache_aware"):
            i = self._cache_aware(keys, q, ws, rng)
            hit = hits[i]  # what the engine really holds (the batcher's expectation)
        elif self.name == "llmd_precise":
            i = self._llmd(q, ws, hits, rng, waiting or {})
            hit = hits[i]
        else:  # dynamo_kv
            i = self._dynamo(q, ws, hits, rng)
            hit = hits[i]
        w = ws[i]
        self._routed(w.id, keys, q)
        return Choice(
            worker_id=w.id,
            hit_tokens=hit,
            predicted_ms=self.formula.predict_one(q.input_tokens, hit),
            reason=self.name,
        )

    def finished(self, wid: str, blocks: int) -> None:
        """The prefill we routed to `wid` finished: it no longer counts as in flight there."""
        self.inflight[wid] = max(0, self.inflight.get(wid, 0) - 1)
        self.inflight_blocks[wid] = max(0, self.inflight_blocks.get(wid, 0) - blocks)

    # ---- policies ----------------------------------------------------------------------------
    def _cache_aware(
        self, keys: Sequence[int], q: PrefillQuery, ws: list[WorkerView], rng: random.Random
    ) -> int:
        loads = [self.inflight.get(w.id, 0) for w in ws]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return _pick(rng, [i for i, x in enumerate(loads) if x == lo])
        matched = [self._tree_match(w.id, keys) for w in ws]
        best = max(matched)
        n = max(1, q.input_tokens // q.block_size)
        if keys and best / n > self.cache_threshold:
            return _pick(rng, [i for i, m in enumerate(matched) if m == best])
        sizes = [len(self.trees.get(w.id, ())) for w in ws]
        small = min(sizes)
        return _pick(rng, [i for i, s in enumerate(sizes) if s == small])

    def _llmd(
        self,
        q: PrefillQuery,
        ws: list[WorkerView],
        hits: list[int],
        rng: random.Random,
        waiting: dict[str, int],
    ) -> int:
        size = max(1, q.input_tokens)
        prefix = [h / size for h in hits]
        qs = [waiting.get(w.id, 0) for w in ws]
        qmax, qmin = max(qs), min(qs)
        queue = [1.0 if qmax == qmin else (qmax - x) / (qmax - qmin) for x in qs]
        kv = [
            1.0 - (w.kv_total_tokens - w.kv_free_tokens - w.kv_evictable_tokens) / w.kv_total_tokens
            if w.kv_total_tokens
            else 0.0
            for w in ws
        ]
        score = [3 * p + 2 * qu + 2 * k for p, qu, k in zip(prefix, queue, kv, strict=True)]
        best = max(score)
        return _pick(rng, [i for i, s in enumerate(score) if s >= best - 1e-9])

    def _dynamo(self, q: PrefillQuery, ws: list[WorkerView], hits: list[int], rng: random.Random) -> int:
        bs = q.block_size
        need = -(-q.input_tokens // bs)
        cost = []
        for w, h in zip(ws, hits, strict=True):
            prefill_blocks = need - h // bs + self.inflight_blocks.get(w.id, 0)
            active = max(0, w.kv_total_tokens - w.kv_free_tokens - w.kv_evictable_tokens) // bs
            cost.append(1.0 * prefill_blocks + active)
        best = min(cost)
        return _pick(rng, [i for i, c in enumerate(cost) if c <= best + 1e-9])

    # ---- the approximate tree ----------------------------------------------------------------
    def _tree_match(self, wid: str, keys: Sequence[int]) -> int:
        tree = self.trees.get(wid)
        if not tree:
            return 0
        n = 0
        for k in keys:
            if k not in tree:
                break
            n += 1
        return n

    def _routed(self, wid: str, keys: Sequence[int], q: PrefillQuery) -> None:
        self.inflight[wid] = self.inflight.get(wid, 0) + 1
        self.inflight_blocks[wid] = self.inflight_blocks.get(wid, 0) + -(-q.input_tokens // q.block_size)
        if self.name not in ("sglang_cache_aware", "vllm_cache_aware"):
            return
        tree = self.trees.setdefault(wid, OrderedDict())
        for k in reversed(keys):  # head last: most recently used, evicted last
            if k in tree:
                tree.move_to_end(k)
            else:
                tree[k] = None
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)


def _pick(rng: random.Random, idx: list[int]) -> int:
    return idx[0] if len(idx) == 1 else idx[rng.randrange(len(idx))]


PEERS = {
    "sglang_cache_aware": {"cache_threshold": 0.3, "balance_abs": 64, "balance_rel": 1.5},
    "vllm_cache_aware": {"cache_threshold": 0.5, "balance_abs": 32, "balance_rel": 1.1},
    "llmd_precise": {},
    "dynamo_kv": {},
}


def make_peer(name: str, formula: Formula) -> PeerRouter:
    if name not in PEERS:
        raise ValueError(f"unknown peer imitation {name!r}; known: {', '.join(PEERS)}")
    return PeerRouter(name, formula, **PEERS[name])  # type: ignore[arg-type]
