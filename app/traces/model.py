"""Request traces: one in-memory shape for the live replay (`flexlb bench`) and the simulator.

Both shared traces (RTP-LLM FlexLB, Mooncake FAST'25) and the synthetic generator load into the same
`Trace`, so the bench, the simulator and the hit-ratio bounds can never disagree on what a request
is. Block ids are kept exactly as the trace gives them (prefix-chained: equal id means equal prefix),
because the simulator uses them directly as KV block keys and the bench synthesises prompts from them.
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FORMATS",
    "Trace",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "parse_slice",
    "replicate",
    "save_trace",
    "scale_time",
    "slice_trace",
    "synthetic_trace",
]

FORMATS = ("flexlb", "mooncake", "synthetic")
# The upstream engines' block sizes: RTP-LLM hashes full 1024-token blocks only (the tail is
# unhashed); Mooncake hashes 512-token blocks including a partial last one.
FLEXLB_BLOCK_SIZE = 1024
MOONCAKE_BLOCK_SIZE = 512
_MASK63 = (1 << 63) - 1


class TraceError(ValueError):
    """A trace file that cannot be read as one of the known formats; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in the (sorted) trace
    arrival_ms: float  # relative to the first request
    input_len: int
    output_len: int  # 0 in the flexlb trace for prefill-only rows: replayed with max_tokens 1
    block_hashes: tuple[int, ...]  # prefix-chained block ids


@dataclass(frozen=True)
class Trace:
    name: str
    format: str
    block_size: int
    requests: list[TraceRequest]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_ms(self) -> float:
        """Last arrival minus the first (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_ms - self.requests[0].arrival_ms

    @property
    def mean_rate_rps(self) -> float:
        """Requests per second over the span, the README's "mean QPS" (0 when the span is 0)."""
        span = self.span_ms
        return len(self.requests) / (span / 1000.0) if span > 0 else 0.0

    def full_block_keys(self, r: TraceRequest) -> tuple[int, ...]:
        """The ids of ``r``'s *full* blocks: what an engine of this block size can cache.

        Mooncake also hashes a partial last block; an engine caches full blocks only, so it is
        dropped here (a partial block can never be reused as a prefix by a longer prompt anyway).
        """
        n = r.input_len // self.block_size
        return r.block_hashes if len(r.block_hashes) == n else r.block_hashes[:n]


# ---- loading ---------------------------------------------------------------------------------


def _open_lines(path: Path) -> Iterator[str]:
    with path.open("rb") as raw:
        head = raw.read(2)
    if head == b"\x1f\x8b":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            yield from f
    else:
        with path.open("r", encoding="utf-8") as f:
            yield from f


def _detect(row: dict[str, Any]) -> str:
    if "bh" in row and "il" in row:
        return "flexlb"
    if "hash_ids" in row and "input_length" in row:
        return "mooncake"
    if "block_hashes" in row and "input_len" in row:
        return "synthetic"
    raise TraceError(
        f"unknown trace row fields {sorted(row)}; expected flexlb (ts, il, ol, bh), "
        "mooncake (timestamp, input_length, output_length, hash_ids) or synthetic"
    )


def _row(fmt: str, row: dict[str, Any]) -> tuple[float, int, int, tuple[int, ...], int | None]:
    """(arrival ms, input, output, block ids, block size if the row says) of one row."""
    if fmt == "flexlb":
        return float(row["ts"]), int(row["il"]), int(row["ol"]), tuple(int(h) for h in row["bh"]), None
    if fmt == "mooncake":
        return (
            float(row["timestamp"]),
            int(row["input_length"]),
            int(row["output_length"]),
            tuple(int(h) for h in row["hash_ids"]),
            None,
        )
    bs = row.get("block_size")
    return (
        float(row["arrival_ms"]),
        int(row["input_len"]),
        int(row["output_len"]),
        tuple(int(h) for h in row["block_hashes"]),
        int(bs) if bs is not None else None,
    )


def load_trace(path: str | Path, format: str = "auto") -> Trace:
    """Read a `.jsonl` or `.jsonl.gz` trace (gzip is detected by its magic bytes, not the name).

    ``format="auto"`` picks the format from the first row's fields. Rows are stably sorted by
    arrival (both shared files already are), arrivals re-based to the first one, and ``index`` is
    the position after sorting. Malformed rows raise TraceError naming the line.
    """
    p = Path(path)
    if format != "auto" and format not in FORMATS:
        raise TraceError(f"unknown trace format {format!r}; known: auto, {', '.join(FORMATS)}")
    fmt = format
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    block_size: int | None = None
    for lineno, line in enumerate(_open_lines(p), 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise TraceError(f"{p}:{lineno}: not a JSON object")
            if fmt == "auto":
                fmt = _detect(obj)
            t, il, ol, bh, bs = _row(fmt, obj)
        except TraceError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{p}:{lineno}: bad {fmt} row: {exc!r}") from exc
        if il < 0 or ol < 0 or not math.isfinite(t):
            raise TraceError(f"{p}:{lineno}: negative length or non-finite time")
        if bs is not None:
            block_size = bs
        rows.append((t, il, ol, bh))
    if fmt == "auto":
        raise TraceError(f"{p}: empty trace")
    if block_size is None:
        block_size = {"flexlb": FLEXLB_BLOCK_SIZE, "mooncake": MOONCAKE_BLOCK_SIZE}.get(fmt, 64)
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    t0 = rows[0][0] if rows else 0.0
    reqs = [TraceRequest(i, t - t0, il, ol, bh) for i, (t, il, ol, bh) in enumerate(rows)]
    name = p.name
    for suffix in (".gz", ".jsonl"):
        name = name.removesuffix(suffix)
    return Trace(name, fmt, block_size, reqs)


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in the synthetic format (gzip when the name ends in .gz), so a generated
    workload can be replayed live and simulated from the same file."""
    p = Path(path)
    buf = io.StringIO()
    for r in trace.requests:
        buf.write(
            json.dumps(
                {
                    "arrival_ms": r.arrival_ms,
                    "input_len": r.input_len,
                    "output_len": r.output_len,
                    "block_hashes": list(r.block_hashes),
                    "block_size": trace.block_size,
                }
            )
        )
        buf.write("\n")
    data = buf.getvalue().encode()
    if p.name.endswith(".gz"):
        p.write_bytes(gzip.compress(data, mtime=0))
    else:
        p.write_bytes(data)


# ---- transformations -------------------------------------------------------------------------


def _rebuilt(trace: Trace, reqs: Iterable[TraceRequest], name: str | None = None) -> Trace:
    out = list(reqs)
    t0 = out[0].arrival_ms if out else 0.0
    # Plain constructor calls, not dataclasses.replace: this runs once per request of traces with
    # hundreds of thousands of them.
    return Trace(
        name or trace.name,
        trace.format,
        trace.block_size,
        [
            TraceRequest(i, r.arrival_ms - t0, r.input_len, r.output_len, r.block_hashes)
            for i, r in enumerate(out)
        ],
    )


def parse_slice(spec: str) -> tuple[int, int | None]:
    """``"A:B"`` → (A, B); either side may be empty (``":500"``, ``"100:"``). Raises ValueError."""
    if ":" not in spec:
        raise ValueError(f"slice must look like A:B, got {spec!r}")
    a, b = spec.split(":", 1)
    start = int(a) if a.strip() else 0
    stop = int(b) if b.strip() else None
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"slice must have 0 <= A <= B, got {spec!r}")
    return start, stop


def slice_trace(trace: Trace, start: int, stop: int | None) -> Trace:
    """Requests ``start..stop-1`` by index, re-indexed, arrivals re-based so the first is at 0."""
    return _rebuilt(trace, trace.requests[start:stop])


def scale_time(trace: Trace, speed: float) -> Trace:
    """Compress time: ``speed=2`` replays the same requests twice as fast (arrivals halved)."""
    if not speed > 0 or not math.isfinite(speed):
        raise ValueError(f"speed must be a positive number, got {speed}")
    return Trace(
        trace.name,
        trace.format,
        trace.block_size,
        [
            TraceRequest(r.index, r.arrival_ms / speed, r.input_len, r.output_len, r.block_hashes)
            for r in trace.requests
        ],
    )


def _mix64(x: int) -> int:
    """splitmix64 finaliser: spreads (copy, id) pairs over 63 bits so copies never share a block."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK63


def replicate(trace: Trace, copies: int, seed: int = 0, *, max_requests: int | None = None) -> Trace:
    """``copies`` independent tenants of the same workload, merged into one trace.

    Each copy gets its own block-id namespace (copy 0 keeps the original ids, so its bounds equal
    the source trace's), so prefixes are shared within a copy and never across copies: a cluster
    ``copies`` times larger sees ``copies`` times the load with the same per-tenant reuse. Copies
    after the first are shifted by a seeded random offset below one mean inter-arrival gap, so the
    merge does not turn every arrival into a burst of ``copies`` simultaneous requests while the
    minute-scale rate drift of the source is kept. Ties in the merge are ordered by (copy, index).

    ``max_requests`` keeps only the first N merged arrivals, computed without building the rest
    (the result equals replicating everything and slicing ``0:N``).
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if copies == 1:
        return trace if max_requests is None else _rebuilt(trace, trace.requests[:max_requests])
    n = len(trace.requests)
    gap = trace.span_ms / (n - 1) if n > 1 else 0.0
    rng = random.Random(seed)
    offsets = [0.0] + [rng.uniform(0.0, gap) for _ in range(copies - 1)]
    spaces = [0] + [_mix64(seed * 0x10001 + c) for c in range(1, copies)]
    if max_requests is not None and max_requests < n * copies:
        # Build the first m requests of each copy; enough when the N-th merged arrival comes
        # strictly before the first one left out (every copy's request m arrives at t_m or later).
        m = min(n, max_requests // copies + 16)
        while True:
            out = _merge(trace, m, offsets, spaces)[:max_requests]
            if m >= n or (out and out[-1].arrival_ms < trace.requests[m].arrival_ms):
                break
            m = min(n, 2 * m)
    else:
        out = _merge(trace, n, offsets, spaces)
    return _rebuilt(trace, out, f"{trace.name}x{copies}")


def _merge(trace: Trace, m: int, offsets: list[float], spaces: list[int]) -> list[TraceRequest]:
    """The first ``m`` requests of every copy, merged by (arrival, copy, index)."""
    streams: list[list[tuple[float, int, int, TraceRequest]]] = []
    src = trace.requests[:m]
    for c, (off, ns) in enumerate(zip(offsets, spaces, strict=True)):
        cs: list[tuple[float, int, int, TraceRequest]] = []
        for r in src:
            bh = r.block_hashes if c == 0 else tuple(_mix64(h ^ ns) for h in r.block_hashes)
            t = r.arrival_ms + off
            cs.append((t, c, r.index, TraceRequest(r.index, t, r.input_len, r.output_len, bh)))
        streams.append(cs)
    return [r for _, _, _, r in heapq.merge(*streams, key=lambda x: (x[0], x[1], x[2]))]


def synthetic_trace(
    n: int,
    rate_rps: float,
    *,
    prefix_groups: int,
    prefix_blocks: int,
    unique_blocks: int,
    block_size: int,
    output_len: int,
    seed: int,
) -> Trace:
    """Poisson arrivals at ``rate_rps``; each request = one of ``prefix_groups`` shared prefixes
    (``prefix_blocks`` full blocks, group drawn uniformly) + ``unique_blocks`` blocks of its own.

    Prompts are whole blocks, so every request's theoretical hit is exactly its group prefix once
    the group has been seen; that makes hit ratios of small scenarios easy to check by hand.
    """
    if n < 0 or not rate_rps > 0 or block_size <= 0 or prefix_groups < 1:
        raise ValueError("need n >= 0, rate_rps > 0, block_size > 0 and prefix_groups >= 1")
    if prefix_blocks < 0 or unique_blocks < 0 or prefix_blocks + unique_blocks == 0:
        raise ValueError("need prefix_blocks, unique_blocks >= 0 and at least one block per request")
    rng = random.Random(seed)
    # Group g's block i is (g+1) << 32 | i: chained ids that no other group or unique block uses.
    prefixes = [tuple(((g + 1) << 32) | i for i in range(prefix_blocks)) for g in range(prefix_groups)]
    next_unique = (prefix_groups + 2) << 32
    reqs: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate_rps) * 1000.0
        g = rng.randrange(prefix_groups)
        own = tuple(range(next_unique, next_unique + unique_blocks))
        next_unique += unique_blocks
        blocks = prefixes[g] + own
        reqs.append(TraceRequest(i, t, len(blocks) * block_size, output_len, blocks))
    return Trace("synthetic", "synthetic", block_size, reqs)
