"""The worker client reads gRPC answers through `IndexedResult`, an `InferResult` that finds outputs by
name through one index per event: it must read every answer exactly as tritonclient's does."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from app.rpc.events import IndexedResult


def _response(
    outputs: list[tuple[str, np.ndarray, str]], raw_for: int | None = None
) -> service_pb2.ModelInferResponse:
    """A response with `outputs`; raw contents only for the first `raw_for` of them (all: None)."""
    r = service_pb2.ModelInferResponse(model_name="m", id="x")
    for n, (name, arr, dtype) in enumerate(outputs):
        t = r.outputs.add()
        t.name, t.datatype = name, dtype
        t.shape.extend(arr.shape)
        if raw_for is not None and n >= raw_for:
            continue
        if dtype == "BYTES":
            packed = serialize_byte_tensor(arr)
            r.raw_output_contents.append(packed.item() if packed.size else b"")
        else:
            r.raw_output_contents.append(arr.tobytes())
    return r


OUTPUTS = [
    ("event", np.array([b"results"], dtype=np.object_), "BYTES"),
    ("ids", np.array([b"a", b"", b"\xff\x00x"], dtype=np.object_), "BYTES"),
    ("tokens", np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32), "INT32"),
    ("ms", np.array([1.5, -2.25]), "FP64"),
    ("seq", np.array([2**40], dtype=np.int64), "INT64"),
    ("keys", np.array([2**63 + 5], dtype=np.uint64), "UINT64"),
    ("event", np.array([b"shadowed"], dtype=np.object_), "BYTES"),  # a repeated name: the first wins
    ("none", np.zeros(0, dtype=np.int32), "INT32"),
]


def _read(r: InferResult, name: str) -> np.ndarray | type[Exception] | None:
    try:
        return r.as_numpy(name)
    except ValueError as exc:  # e.g. no raw contents for a shape that needs some
        return type(exc)


@pytest.mark.parametrize("raw_for", [None, 3])
def test_reads_every_output_as_tritonclient_does(raw_for: int | None) -> None:
    resp = _response(OUTPUTS, raw_for)
    ours, theirs = IndexedResult(resp), InferResult(resp)
    for name in [*{n for n, _, _ in OUTPUTS}, "absent"]:
        for _ in range(2):  # the index is built on the first read, used on the second
            a, b = _read(ours, name), _read(theirs, name)
            if b is None or isinstance(b, type):
                assert a is b, name
                continue
            assert isinstance(a, np.ndarray), name
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tolist() == b.tolist(), name
    assert ours.as_numpy("event").tolist() == [b"results"]
    if raw_for is None:
        assert ours.as_numpy("tokens").tolist() == [[1, 2, 3], [4, 5, 6]]
    else:  # an output without raw contents: empty of its type, which only a 0-size shape takes
        assert _read(ours, "seq") is ValueError
        none = ours.as_numpy("none")
        assert none is not None and none.tolist() == [] and none.dtype == np.int32
