"""Pickers imitating peer routers, for comparisons (issue 15, Deliver 5; see README.md).

Each is named after what it imitates and keeps that router's published defaults as its parameters.
Like the routers, they keep their own state per instance (one per gateway replica: each peer
router instance only knows its own decisions): the request blocks they routed per worker (an
approximate radix tree) and their own requests in flight per worker. `Policy.finished` tells
them a prefill they routed has finished. They need the prompt's block keys (`PrefillQuery.keys`);
without them the trees stay empty and the cache-aware ones balance by load only.

- ``sglang_cache_aware``: SGLang router's `cache_aware` policy as sglang-router 0.3.2 runs it in
  P/D mode. The algorithm: if the load is imbalanced (max − min in-flight > `balance_abs` and
  max > `balance_rel` × min) the least-loaded worker (the first of a tie); otherwise the worker
  with the longest prefix match when the match rate (matched characters over the prompt's)
  exceeds `cache_threshold`, else the least-loaded one. Defaults 0.3 / 64 / 1.5. But its P/D
  router never initialises the prefill policy's tree (`init_pd_cache_aware_policies` has no
  caller), so every request takes the policy's "no tree for this model" branch: a uniformly
  random healthy worker, nothing inserted (`uses_tree` False; its debug log says "No tree found
  for model ..., using random worker selection" on every request, docs/benchmarks.md "Peer
  imitations against the live routers"). The balance rule still runs first.
- ``vllm_cache_aware``: vLLM router's `cache_aware` (vllm-router 0.1.17): per worker, the prefix
  of the prompt's token ids its tree holds for that worker, the rate being matched tokens over
  the prompt's; above `cache_threshold` (and balanced) the least loaded of the best-matching
  workers, else the least loaded of all, the first of a tie (`ties` "first"), so on an idle
  cluster every new prefix goes to the first prefill worker. Library defaults 0.5 / 32 / 1.1
  (its command line's are SGLang's 0.3 / 64 / 1.5); it sees each prefill worker's requests in
  flight until their prefill ends. It needs the workers' token ids (`/v1/completions/render` or
  `/tokenize`); without them it routes by load alone.
- ``llmd_precise``: llm-d's scheduler profile with the precise prefix-cache scorer (KV events: here
  the cache mirror's hits), the queue scorer (the view's `queue_len`) and the KV-cache-utilisation
  scorer, weights 3:2:2; the highest weighted score wins.
- ``dynamo_kv``: Dynamo's KV router cost, `overlap_weight × prefill_blocks + decode_blocks`
  (prefill blocks: blocks the prompt must compute there plus the router's own in-flight prefill
  blocks on it; decode blocks: KV blocks active on the worker), lowest wins, overlap_weight 1.

Decode: the routers reserve no decode KV and refuse nothing for it. Each picks the decode worker
with its own policy (SGLang / vLLM router in P/D mode: `decode_policy` unset falls back to
`--policy`, so the same `cache_aware`, in flight counted until the response ends; llm-d: its
scorers on the decode pods; Dynamo: its KV cost on the decode workers) and the engine behind it
(vLLM, SGLang) admits on the KV a sequence uses and preempts (recompute) when it runs out. The
simulator does the same for them (`SimReplica.peer_decode`, its decode engines on
`admission="expected"`); a decode engine's prefix cache is not modelled, so no decode worker
reports a hit to them.

Pure (no clock, no I/O); random draws only from the ``rng`` passed in. Ties are drawn over the
tied candidates in their given order, as the routers do.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from app.scheduling.plugins.registry import BuildContext, Candidates, Plugin, register

__all__ = ["CacheAware", "DynamoKv", "LlmdPrecise", "PeerPicker"]


def _pick(rng: random.Random, idx: list[int]) -> int:
    return idx[0] if len(idx) == 1 else idx[rng.randrange(len(idx))]


def _blocks(q: Any) -> int:
    return -(-q.input_tokens // q.block_size)


class PeerPicker(Plugin):
    """Shared state of the imitations: our own requests in flight (and their blocks) per worker."""

    __slots__ = ("inflight", "inflight_blocks")
    #: The routers imitated have no SLO admission: a driver runs them without FlexLB's.
    peer = True

    def __init__(self, ctx: BuildContext) -> None:
        del ctx
        self.inflight: dict[str, int] = {}
        self.inflight_blocks: dict[str, int] = {}

    def pick(
        self, q: Any, c: Candidates, utils: list[float] | None, sign: float, rng: random.Random
    ) -> tuple[int, bool]:
        i = self._choose(q, c, rng)
        wid = c.workers[i].id
        self.inflight[wid] = self.inflight.get(wid, 0) + 1
        self.inflight_blocks[wid] = self.inflight_blocks.get(wid, 0) + _blocks(q)
        self._routed(wid, q)
        return i, False

    def finished(self, wid: str, q: Any) -> None:
        """The prefill we routed to ``wid`` finished: it no longer counts as in flight there."""
        self.inflight[wid] = max(0, self.inflight.get(wid, 0) - 1)
        self.inflight_blocks[wid] = max(0, self.inflight_blocks.get(wid, 0) - _blocks(q))

    def _choose(self, q: Any, c: Candidates, rng: random.Random) -> int:
        raise NotImplementedError

    def _routed(self, wid: str, q: Any) -> None:
        del wid, q


class CacheAware(PeerPicker):
    """SGLang / vLLM router `cache_aware`: an approximate radix tree per worker from the router's own
    routing decisions; the least loaded when imbalanced, else the longest prefix match above
    ``cache_threshold``, else the least loaded. ``sees_load``: whether the policy sees its own
    in-flight counts (when not, all read 0); ``ties``: how the least loaded is chosen among equals
    (``random``, or ``first`` in the workers' order; with ``first`` the least loaded of the
    best-matching workers also wins, as in vllm-router); ``uses_tree``: False for a router whose
    tree is never set up (a random worker whenever balanced, and nothing recorded)."""

    __slots__ = (
        "balance_abs",
        "balance_rel",
        "cache_threshold",
        "max_tree_blocks",
        "sees_load",
        "ties",
        "trees",
        "uses_tree",
    )

    def __init__(
        self,
        ctx: BuildContext,
        *,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_tree_blocks: int = 1 << 20,  # SGLang's bound is ~2^26 chars: effectively none
        sees_load: bool = False,
        ties: str = "random",
        uses_tree: bool = True,
    ) -> None:
        super().__init__(ctx)
        if ties not in ("random", "first"):
            raise ValueError(f"ties must be random or first, got {ties!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_blocks = max_tree_blocks
        self.sees_load = sees_load
        self.ties = ties
        self.uses_tree = uses_tree
        self.trees: dict[str, OrderedDict[int, None]] = {}

    def _choose(self, q: Any, c: Candidates, rng: random.Random) -> int:
        ws = c.workers
        loads = [self.inflight.get(w.id, 0) for w in ws] if self.sees_load else [0] * len(ws)
        hi, lo = max(loads), min(loads)
        least = [i for i, x in enumerate(loads) if x == lo]
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return least[0] if self.ties == "first" else _pick(rng, least)
        if not self.uses_tree:
            return rng.randrange(len(ws))
        keys = q.keys
        matched = [self._match(w.id, keys) for w in ws]
        best = max(matched)
        # The match rate is matched characters over the prompt's (one character a token in the
        # replay), so the unshared tail past the last full block counts in the divisor.
        if keys and best * q.block_size / max(1, q.input_tokens) > self.cache_threshold:
            top = [i for i, m in enumerate(matched) if m == best]
            if self.ties == "random":
                return _pick(rng, top)
            low = min(loads[i] for i in top)
            return next(i for i in top if loads[i] == low)
        return least[0] if self.ties == "first" else _pick(rng, least)

    def _match(self, wid: str, keys: Sequence[int]) -> int:
        tree = self.trees.get(wid)
        if not tree:
            return 0
        n = 0
        for k in keys:
            if k not in tree:
                break
            n += 1
        return n

    def _routed(self, wid: str, q: Any) -> None:
        if not self.uses_tree:
            return
        tree = self.trees.setdefault(wid, OrderedDict())
        for k in reversed(q.keys):  # head last: most recently used, evicted last
            if k in tree:
                tree.move_to_end(k)
            else:
                tree[k] = None
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)


@register("picker", "sglang_cache_aware", roles=("prefill",))
class SglangCacheAware(CacheAware):
    """SGLang router's `cache_aware` in P/D mode (defaults 0.3 / 64 / 1.5; no tree: random when
    balanced, the first least-loaded when not)."""

    __slots__ = ()

    def __init__(
        self,
        ctx: BuildContext,
        *,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_tree_blocks: int = 1 << 20,
        sees_load: bool = True,
        ties: str = "first",
        uses_tree: bool = False,
    ) -> None:
        super().__init__(
            ctx,
            cache_threshold=cache_threshold,
            balance_abs=balance_abs,
            balance_rel=balance_rel,
            max_tree_blocks=max_tree_blocks,
            sees_load=sees_load,
            ties=ties,
            uses_tree=uses_tree,
        )


@register("picker", "vllm_cache_aware", roles=("prefill",))
class VllmCacheAware(CacheAware):
    """vLLM router's `cache_aware`: SGLang's algorithm with its library defaults 0.5 / 32 / 1.1; it
    sees its in-flight counts and takes the first of the least loaded."""

    __slots__ = ()

    def __init__(
        self,
        ctx: BuildContext,
        *,
        cache_threshold: float = 0.5,
        balance_abs: int = 32,
        balance_rel: float = 1.1,
        max_tree_blocks: int = 1 << 20,
        sees_load: bool = True,
        ties: str = "first",
        uses_tree: bool = True,
    ) -> None:
        super().__init__(
            ctx,
            cache_threshold=cache_threshold,
            balance_abs=balance_abs,
            balance_rel=balance_rel,
            max_tree_blocks=max_tree_blocks,
            sees_load=sees_load,
            ties=ties,
            uses_tree=uses_tree,
        )


@register("picker", "llmd_precise", roles=("prefill",))
class LlmdPrecise(PeerPicker):
    """llm-d's precise prefix-cache + queue + KV-utilisation scorers, weights 3:2:2, best wins."""

    __slots__ = ()

    def _choose(self, q: Any, c: Candidates, rng: random.Random) -> int:
        ws, hits = c.workers, c.hits
        size = max(1, q.input_tokens)
        prefix = [h / size for h in hits]
        qs = [w.queue_len for w in ws]
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


@register("picker", "dynamo_kv", roles=("prefill",))
class DynamoKv(PeerPicker):
    """Dynamo's KV router: lowest `overlap_weight × prefill blocks + active decode blocks`."""

    __slots__ = ("overlap_weight",)

    def __init__(self, ctx: BuildContext, *, overlap_weight: float = 1.0) -> None:
        super().__init__(ctx)
        self.overlap_weight = overlap_weight

    def _choose(self, q: Any, c: Candidates, rng: random.Random) -> int:
        bs = q.block_size
        need = _blocks(q)
        cost = []
        for w, h in zip(c.workers, c.hits, strict=True):
            prefill_blocks = need - h // bs + self.inflight_blocks.get(w.id, 0)
            active = max(0, w.kv_total_tokens - w.kv_free_tokens - w.kv_evictable_tokens) // bs
            cost.append(self.overlap_weight * prefill_blocks + active)
        best = min(cost)
        return _pick(rng, [i for i, x in enumerate(cost) if x <= best + 1e-9])
