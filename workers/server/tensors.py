"""numpy <-> Triton tensor helpers for the worker models (BYTES tensors are object arrays)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


def b1(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.bytes_)


def bytes_arr(items: Iterable[str]) -> np.ndarray:
    """Fixed-width bytes (dtype kind 'S'): PyTriton's validator rejects *empty* object arrays."""
    return np.array([s.encode() for s in items], dtype=np.bytes_)


def as_str(arr: np.ndarray | None, default: str = "") -> str:
    if arr is None or arr.size == 0:
        return default
    v = arr.reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else str(v)


def as_strs(arr: np.ndarray) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)]


def as_int(arr: np.ndarray | None, default: int = 0) -> int:
    if arr is None or arr.size == 0:
        return default
    return int(arr.reshape(-1)[0])


def get(req: Mapping[str, Any], name: str) -> np.ndarray | None:
    try:
        return req[name]
    except KeyError:
        return None
