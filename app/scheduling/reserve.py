"""How much decode KV to reserve per request: `reserve_output_tokens = max | mean | pXX`.

Pure (no I/O, no clock). Reserving prompt + `max_new_tokens` for every request refuses the
cluster for decode KV (`decode_reserve_refused`) on traffic with long shared contexts while most
of the reserved tokens are never generated: clients set `max_tokens` far above what they get.
Real engines admit on expected use and preempt when they run out (workers/engine/decode.py,
`admission="expected"`). This learns the output length of finished requests per model (a window
of the last `window` of them) and reserves its mean or a percentile instead, capped by the
request's own `max_new_tokens`; until `min_samples` are seen it reserves the maximum.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

__all__ = [
    "SHARE_CHUNK_TOKENS",
    "DecodeHoldMirror",
    "OutputLengthEstimator",
    "SharedBlockHolds",
    "parse_reserve_policy",
    "share_chunk_size",
    "share_chunks",
]

#: The grain at which decode holds name their prompt's blocks: a hold names one key per chunk of at
#: least this many tokens, not one per block. The RESERVE / RELEASE scripts touch each named key,
#: so at a 64-token block an 8K prompt named 128 keys: +0.29 ms a reserve round trip, +0.21 a
#: release (16 chunk keys: +0.07 / +0.04; best of 5 x 200 on loopback Redis). Chained keys make a
#: chunk's last block key name the whole chunk (and its prefix), so counting shared chunks
#: under-counts sharing by less than a chunk per hold, never over-counts.
SHARE_CHUNK_TOKENS = 512


def share_chunks(block_size: int, keys: Sequence[int]) -> tuple[int, list[int]]:
    """(chunk size, one chained key per full chunk): what a decode hold names for ``keys``, the
    prompt's full-block keys of ``block_size`` tokens (`SHARE_CHUNK_TOKENS`)."""
    if block_size <= 0 or not keys:
        return 0, []
    stride = share_chunk_size(block_size) // block_size
    return block_size * stride, list(keys[stride - 1 :: stride])


def share_chunk_size(block_size: int) -> int:
    """Tokens per chunk a decode hold names at this block size: whole blocks, ≥ SHARE_CHUNK_TOKENS."""
    return block_size * max(1, -(-SHARE_CHUNK_TOKENS // block_size))


def parse_reserve_policy(policy: str) -> float | None:
    """`max` → None; `mean` → -1.0; `pXX` (0 < XX <= 100) → XX. Raises ValueError otherwise."""
    if policy == "max":
        return None
    if policy == "mean":
        return -1.0
    if policy.startswith("p"):
        try:
            q = float(policy[1:])
        except ValueError:
            q = -1.0
        if 0 < q <= 100:
            return q
    raise ValueError(f"reserve_output_tokens must be max, mean or pXX (0 < XX <= 100), got {policy!r}")


class OutputLengthEstimator:
    def __init__(self, policy: str = "max", window: int = 2048, min_samples: int = 32) -> None:
        self.q = parse_reserve_policy(policy)
        self.policy = policy
        self.min_samples = min_samples
        self.samples: deque[int] = deque(maxlen=window)
        self._cached: float | None = None

    def observe(self, generated: int) -> None:
        """A finished request generated this many tokens."""
        if self.q is not None and generated > 0:
            self.samples.append(generated)
            self._cached = None

    def estimate(self) -> float | None:
        """The learned output length (None: reserve the maximum)."""
        if self.q is None or len(self.samples) < self.min_samples:
            return None
        if self._cached is None:
            if self.q < 0:
                self._cached = sum(self.samples) / len(self.samples)
            else:
                ordered = sorted(self.samples)
                k = max(0, math.ceil(self.q / 100 * len(ordered)) - 1)
                self._cached = float(ordered[k])
        return self._cached

    def reserve(self, max_new_tokens: int) -> int:
        """Output tokens to reserve for a request that may generate up to `max_new_tokens`."""
        est = self.estimate()
        if est is None:
            return max_new_tokens
        return max(1, min(max_new_tokens, math.ceil(est)))


class SharedBlockHolds:
    """One decode worker's reserved prompt blocks, each counted once however many requests hold it.

    A decode engine with a prefix cache on its paged KV (vLLM's decode instance, SGLang's with
    its decode radix cache, workers/engine/decode.py given `block_keys`) holds a full prompt
    block that several of its running sequences share once: an application's
    system prompt, or a session's history while its next turn already decodes. Reserving prompt +
    output per request counted such a block once per holder and refused the worker while most of
    its KV was duplicates (chat_agents at load 4: a third of the pool). The origin reserves only
    the blocks no reservation on the worker names yet; the live twin is the `reserve` / `release`
    scripts (app/state/scripts.py), which keep the same counts in Redis.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.count: dict[int, int] = {}
        self.of: dict[str, tuple[int, ...]] = {}

    def held_tokens(self, keys: tuple[int, ...]) -> int:
        """Tokens of ``keys``' blocks some reservation on this worker already holds."""
        return self.block_size * sum(1 for k in keys if k in self.count)

    def hold(self, request_id: str, keys: tuple[int, ...]) -> None:
        if not keys:
            return
        for k in keys:
            self.count[k] = self.count.get(k, 0) + 1
        self.of[request_id] = keys

    def drop(self, request_id: str) -> int:
        """The request's hold ends; returns the tokens of its blocks other holds still name (not
        freed: subtract them from the request's reserved amount)."""
        kept = 0
        for k in self.of.pop(request_id, ()):
            n = self.count[k] - 1
            if n:
                self.count[k] = n
                kept += 1
            else:
                del self.count[k]
        return kept * self.block_size


class DecodeHoldMirror:
    """Which decode worker this origin's own holds name each chunk key on: the decode pick's view
    of where a request's prompt is already held (`DecodeQuery.held`).

    Without it the decode pick saw only headroom, so a request shared its application's or
    session's blocks only when it happened to land where they were held. The authoritative counts
    live in Redis (`reservation_blocks(w)`), but reading them per request would add a round trip
    before the one that reserves (the pick is made before it, `RoutingInputs.choose_decode`), so
    each origin keeps what it placed itself: exact with one replica, a lower bound with several
    (another replica's holds are missed, never invented). Pure and shared by the gateway
    (`Pipeline.dholds`) and the simulator (`SimReplica.dholds`). A stale entry only biases a
    score: the RESERVE script still counts what is really held."""

    def __init__(self) -> None:
        self.index: dict[int, dict[str, int]] = {}  # chunk key → decode worker id → holds naming it
        self.of: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # request → (worker, chunk, keys)

    def __len__(self) -> int:
        return len(self.of)

    def held(self, chunk: int, keys: Sequence[int]) -> dict[str, int]:
        """Per decode worker, tokens of ``keys`` (chunks of ``chunk`` tokens) our holds there name."""
        out: dict[str, int] = {}
        if chunk <= 0:
            return out
        index = self.index
        for k in keys:
            ws = index.get(k)
            if ws:
                for w in ws:
                    out[w] = out.get(w, 0) + chunk
        return out

    def hold(self, request_id: str, worker_id: str, chunk: int, keys: Sequence[int]) -> None:
        """``request_id`` now holds ``keys`` on ``worker_id`` (replaces an earlier hold of it)."""
        self.drop(request_id)
        if chunk <= 0 or not keys:
            return
        t = tuple(keys)
        for k in t:
            ws = self.index.setdefault(k, {})
            ws[worker_id] = ws.get(worker_id, 0) + 1
        self.of[request_id] = (worker_id, chunk, t)

    def drop(self, request_id: str) -> None:
        """The request's hold ended (released, or never made: a no-op)."""
        entry = self.of.pop(request_id, None)
        if entry is None:
            return
        w, _, keys = entry
        for k in keys:
            ws = self.index[k]
            n = ws[w] - 1
            if n:
                ws[w] = n
            else:
                del ws[w]
                if not ws:
                    del self.index[k]
