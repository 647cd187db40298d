"""Upper bounds on the prefix-cache hit ratio a router could reach on a trace.

Two references for the routed hit ratio of a run (DESIGN §9, lesson 11: exact where computed):

- *theoretical*: one global cache of unlimited size. Requests in trace order; block i of a request
  is a hit only if blocks 0..i all appeared in an earlier request (counting stops at the first miss).
  No router can beat it: it assumes every worker holds everything ever computed.
- *pooled LRU*: one LRU holding as many blocks as the whole cluster's KV capacity. Capacity, not
  routing, is what keeps real clusters well below the theoretical figure on these traces (36-94M
  distinct prefix tokens vs ~0.45M per H100), and this says how much of the gap a perfect router over
  the same memory could close.

Each comes as a block ratio (hit blocks / all blocks, the figure the trace README publishes) and a
token ratio (Σ min(hit_blocks × block_size, input) / Σ input), which is the unit of the routed hit
ratio (cached tokens / input tokens) and so the one to compare a run against.
"""

from __future__ import annotations

from collections import OrderedDict

from app.traces.model import Trace

__all__ = [
    "pooled_lru_hit_ratio",
    "pooled_lru_token_hit_ratio",
    "theoretical_hit_ratio",
    "theoretical_token_hit_ratio",
    "trace_bounds",
]


def _leading(hashes: tuple[int, ...], present: set[int] | OrderedDict[int, None]) -> int:
    """How many of a request's blocks, from the first, the cache holds (counting stops at a miss)."""
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n


def _infinite_hits(trace: Trace) -> list[int]:
    """Leading hit blocks per request with an unlimited global cache."""
    seen: set[int] = set()
    out: list[int] = []
    for r in trace.requests:
        out.append(_leading(r.block_hashes, seen))
        seen.update(r.block_hashes)
    return out


def _lru_hits(trace: Trace, capacity_tokens: int) -> list[int]:
    """Leading hit blocks per request with one LRU of ``capacity_tokens // block_size`` full blocks.

    After matching, a request's blocks are touched last block first, so its first blocks become the
    most recently used: a chain is evicted from its tail, as block-paged engines do, and a prefix
    never loses its head while keeping its tail (the tail alone could never hit).
    """
    if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
    cap = capacity_tokens // trace.block_size
    lru: OrderedDict[int, None] = OrderedDict()
    out: list[int] = []
    move = lru.move_to_end
    for r in trace.requests:
        # Full blocks only, as the engine caches them (`Trace.full_block_keys`): a Mooncake
        # partial last block is never cached, so it must neither hit nor take room.
        keys = trace.full_block_keys(r)
        out.append(_leading(keys, lru))
        if cap == 0:
            continue
        for h in reversed(keys):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        while len(lru) > cap:
            lru.popitem(last=False)
    return out


def _block_ratio(trace: Trace, hits: list[int]) -> float:
    total = sum(len(r.block_hashes) for r in trace.requests)
    return sum(hits) / total if total else 0.0


def _token_ratio(trace: Trace, hits: list[int]) -> float:
    bs = trace.block_size
    total = sum(r.input_len for r in trace.requests)
    hit = sum(min(h * bs, r.input_len) for h, r in zip(hits, trace.requests, strict=True))
    return hit / total if total else 0.0


def theoretical_hit_ratio(trace: Trace) -> float:
    """Block hit ratio with an infinite global cache (22.31% / 36.64% on the shared traces)."""
    return _block_ratio(trace, _infinite_hits(trace))


def theoretical_token_hit_ratio(trace: Trace) -> float:
    """Token-weighted hit ratio with an infinite global cache (20.56% / 37.36% on the shared traces)."""
    return _token_ratio(trace, _infinite_hits(trace))


def pooled_lru_hit_ratio(trace: Trace, capacity_tokens: int) -> float:
    """Block hit ratio of one LRU holding the whole cluster's KV capacity (see module doc)."""
    return _block_ratio(trace, _lru_hits(trace, capacity_tokens))


def pooled_lru_token_hit_ratio(trace: Trace, capacity_tokens: int) -> float:
    """Token-weighted hit ratio of one LRU holding the whole cluster's KV capacity."""
    return _token_ratio(trace, _lru_hits(trace, capacity_tokens))


def trace_bounds(trace: Trace, capacity_tokens: int) -> dict[str, float]:
    """Both bounds in both units, keyed as results.json names them.

    ``hit_ratio_theoretical`` and ``hit_ratio_pooled_lru`` are token-weighted, the unit of
    ``hit_ratio_routed``; the ``*_blocks`` keys are the block ratios the trace README publishes.
    """
    inf = _infinite_hits(trace)
    lru = _lru_hits(trace, capacity_tokens)
    return {
        "hit_ratio_theoretical": _token_ratio(trace, inf),
        "hit_ratio_theoretical_blocks": _block_ratio(trace, inf),
        "hit_ratio_pooled_lru": _token_ratio(trace, lru),
        "hit_ratio_pooled_lru_blocks": _block_ratio(trace, lru),
    }
