"""What a call to a worker sends: its input tensors and the `ModelInferRequest` that carries them.

The prompt travels as block keys or token ids (`prompt_input`, docs/worker-protocol.md §4.1), in
the worker's key space (`KeySpace`, from its `describe` answer) or in one the caller already hashed
in (`PromptKeys`). The client that sends them is app/rpc/worker_client.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from app.protocol import worker_api as W
from app.protocol.blocks import block_keys, namespace_seed

Input = tuple[str, np.ndarray, str]  # name, data, KServe datatype


@dataclass(frozen=True)
class KeySpace:
    """How one worker incarnation hashes block keys, from its `describe` answer."""

    epoch: str
    block_size: int
    model: str
    tokenizer: str

    @property
    def space(self) -> int:
        """The key space's namespace seed (cached by `namespace_seed`)."""
        return namespace_seed(self.model, self.tokenizer, self.block_size)


@dataclass(frozen=True)
class PromptKeys:
    """Block keys the caller has already hashed (the gateway does, to route), one sequence per
    request of the batch (None: hash that one here), in the key space whose namespace seed
    (`app.protocol.blocks.namespace_seed`) is `space`; used when it is the worker's. The seed
    names the space in 8 bytes, which is what a hand-off entry carries with its keys."""

    space: int
    keys: Sequence[Sequence[int] | np.ndarray | None]

    @classmethod
    def named(cls, block_size: int, model: str, tokenizer: str, keys: Sequence[Any]) -> PromptKeys:
        return cls(namespace_seed(model, tokenizer, block_size), keys)


def inp(name: str, arr: np.ndarray, dtype: str) -> Input:
    return (name, arr, dtype)


def infer_request(model: str, inputs: Sequence[Input], request_id: str) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, arr, dtype in inputs:
        t = req.inputs.add()
        t.name = name
        t.datatype = dtype
        t.shape.extend(arr.shape)
        if dtype == "BYTES":
            packed = serialize_byte_tensor(arr)
            req.raw_input_contents.append(packed.item() if packed.size else b"")
        else:
            req.raw_input_contents.append(arr.tobytes())
    return req


def bytes_tensor(values: Sequence[str]) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def sampling_inputs(
    per_request: list[Mapping[str, Any] | None], t_name: str, p_name: str, s_name: str
) -> list[Input]:
    """Sampling tensors, one entry per request; absent fields get the neutral value (greedy,
    no nucleus cut, engine-chosen seed), documented in docs/worker-protocol.md §4.1."""

    def values(name: str, default: float) -> list[float]:
        return [default if (s or {}).get(name) is None else float((s or {})[name]) for s in per_request]

    # Seeds stay integers: through a float, a seed near 2**63 (a negative API seed folded into the
    # engines' range) rounds up to 2**63 and overflows INT64 (the OpenAPI fuzz pass found a 500).
    seeds = [-1 if (s or {}).get("seed") is None else int((s or {})["seed"]) for s in per_request]
    return [
        inp(t_name, np.array(values("temperature", 0.0), dtype=np.float64), "FP64"),
        inp(p_name, np.array(values("top_p", 1.0), dtype=np.float64), "FP64"),
        inp(s_name, np.array(seeds, dtype=np.int64), "INT64"),
    ]


def prompt_input(
    requests: Sequence[tuple[str, np.ndarray]], ks: KeySpace | None, given: PromptKeys | None
) -> Input:
    """The prompts as block keys (8 bytes a block instead of 4 a token: 1/128 of the bytes at
    block size 64) when the worker takes them, else as token ids. A batch without one full block
    sends its ids: a zero-length tensor does not cross Triton reliably.

    Given keys are used where they are in the worker's space and one per full block of their
    prompt; any other prompt is hashed here (~3.7 ms of this process's CPU for an 8 x 8K batch)."""
    if ks is not None:
        bs = ks.block_size
        use = given.keys if given is not None and given.space == ks.space else None
        parts: list[np.ndarray] = []
        for n, (_, t) in enumerate(requests):
            k = use[n] if use is not None else None
            if k is None or len(k) != len(t) // bs:
                k = block_keys(t, bs, model=ks.model, tokenizer=ks.tokenizer)
            parts.append(np.asarray(k, dtype=np.uint64))
        keys = np.concatenate(parts)
        if keys.size:
            return inp(W.P_BLOCK_KEYS, keys, "UINT64")
    ids = np.concatenate([np.asarray(t, dtype=np.int32) for _, t in requests])
    return inp(W.P_INPUT_IDS, ids, "INT32")
