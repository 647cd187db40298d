"""Block keys: the one implementation of KV-block hashing shared by gateway, workers and simulator.

A key identifies a *prefix*, not a block: `key_i = H(key_{i-1}, tokens of block i)`, so two prompts
share key i exactly when they share their first (i+1)*block_size tokens. Keys are namespaced by
(model, tokenizer, block size) so caches of different models never alias. Only full blocks are
hashed: a partial tail can never be reused by another prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

MASK64 = (1 << 64) - 1


@lru_cache(maxsize=64)
def namespace_seed(model: str, tokenizer: str, block_size: int) -> int:
    """The 64-bit root key of a chain; differs for every (model, tokenizer, block size)."""
    digest = hashlib.blake2b(f"{model}\x00{tokenizer}\x00{block_size}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    model: str = "flexlb-sim",
    tokenizer: str = "byte",
) -> list[int]:
    """Chained unsigned 64-bit keys of every full block of `tokens`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = np.asarray(tokens, dtype="<i4")
    n_full = len(arr) // block_size
    if n_full == 0:
        return []
    raw = arr[: n_full * block_size].tobytes()
    step = block_size * 4
    prev = namespace_seed(model, tokenizer, block_size)
    keys: list[int] = []
    blake = hashlib.blake2b
    for i in range(n_full):
        h = blake(prev.to_bytes(8, "little"), digest_size=8)
        h.update(raw[i * step : (i + 1) * step])
        prev = int.from_bytes(h.digest(), "little")
        keys.append(prev)
    return keys


def hit_blocks_cap(input_tokens: int, block_size: int) -> int:
    """Most blocks a prompt may take from cache: at least one token must always be computed
    (the first output token comes from the last position), so a fully cached prompt still
    recomputes its last block."""
    if input_tokens <= 0:
        return 0
    return (input_tokens - 1) // block_size
