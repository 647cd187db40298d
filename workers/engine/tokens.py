"""Deterministic output tokens: token i of request r depends only on (seed, r, i).

Printable ASCII ids (32..126) so the byte tokenizer renders readable text, and so prefill (index 0)
and decode (indices 1..) produce one coherent stream from two different processes.
"""

from __future__ import annotations

import hashlib

import numpy as np

_LO, _SPAN = 32, 95
_M64 = (1 << 64) - 1
# Up to this many tokens plain Python integers beat numpy's per-call overhead (the prefill's single
# first token is on the simulator's hot path); both paths compute the same values.
_SMALL = 8


def _request_state(seed: int, request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest(), "little")


def output_tokens(seed: int, request_id: str, start: int, count: int) -> list[int]:
    """Tokens [start, start+count) of the request's output stream."""
    if count <= 0:
        return []
    state = _request_state(seed, request_id)
    if count <= _SMALL:
        out = []
        for i in range(start, start + count):
            z = (state + i * 0x9E3779B97F4A7C15) & _M64
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
            z ^= z >> 31
            out.append(z % _SPAN + _LO)
        return out
    base = np.uint64(state)
    idx = np.arange(start, start + count, dtype=np.uint64)
    # splitmix64 over (base + index): cheap, vectorised, well mixed.
    with np.errstate(over="ignore"):
        z = base + idx * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(_SPAN) + np.uint64(_LO)).astype(np.int64).tolist()
