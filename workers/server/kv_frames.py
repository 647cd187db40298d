"""KV frames: one request's KV cache as bytes, from the prefill worker to the decode worker.

Why a frame of our own rather than pickle or torch.save: the bytes cross a socket between two
processes, so the receiver must be able to check everything before it trusts a length or builds a
tensor (a truncated read or a flipped bit must become a typed error, never a wrong text), and
pickle would let a peer run code. Layout (little-endian; docs/worker-protocol.md §5.1):

    0      4  magic b"FLKV"
    4      2  version (1)
    6      2  reserved (0)
    8      4  header length H
    12     8  payload length P
    20     H  header: UTF-8 JSON (request_id, layers, kv_heads, head_dim, tokens, dtype, shape,
              first_token, first_index, sampling)
    20+H   P  payload: the KV tensor [layers, 2, kv_heads, tokens, head_dim], C order
    20+H+P 4  CRC-32 of bytes [0, 20+H+P)

On a GPU the tensor is copied to host memory to be framed and back to the device on arrival; a
production deployment would move it device to device instead (NIXL over RDMA, or NCCL send/recv)
and keep only the header as the control message.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.hf_model import Sampling

MAGIC = b"FLKV"
VERSION = 1
PREFIX = struct.Struct("<4sHHIQ")  # magic, version, reserved, header length, payload length
CRC = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1 << 30  # 1 GiB: far above any KV this project moves; a bigger length is garbage

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class KvFrameError(ValueError):
    """A frame that cannot be trusted: truncated, too large, corrupt or inconsistent."""


@dataclass(frozen=True)
class KvFrame:
    request_id: str
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    first_token: int
    sampling: Sampling

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[3])


def encode(frame: KvFrame) -> bytes:
    kv = frame.kv.detach().to("cpu").contiguous()  # device -> host on a GPU
    if kv.dtype not in _NAMES:
        raise KvFrameError(f"unsupported KV dtype {kv.dtype}")
    payload = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
    s = frame.sampling
    header = json.dumps(
        {
            "request_id": frame.request_id,
            "layers": int(kv.shape[0]),
            "kv_heads": int(kv.shape[2]),
            "tokens": int(kv.shape[3]),
            "head_dim": int(kv.shape[4]),
            "dtype": _NAMES[kv.dtype],
            "shape": list(kv.shape),
            "first_token": frame.first_token,
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed},
        },
        separators=(",", ":"),
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise KvFrameError("header too large")
    body = PREFIX.pack(MAGIC, VERSION, 0, len(header), len(payload)) + header + payload
    if len(body) + CRC.size > MAX_FRAME_BYTES:
        raise KvFrameError(f"frame of {len(body) + CRC.size} bytes exceeds {MAX_FRAME_BYTES}")
    return body + CRC.pack(zlib.crc32(body))


def frame_size(prefix: bytes) -> int:
    """Total frame length from its first 20 bytes (what a reader must read next)."""
    if len(prefix) < PREFIX.size:
        raise KvFrameError("truncated frame prefix")
    magic, version, _, hlen, plen = PREFIX.unpack_from(prefix)
    if magic != MAGIC or version != VERSION:
        raise KvFrameError("not a KV frame (bad magic or version)")
    total = PREFIX.size + hlen + plen + CRC.size
    if hlen > MAX_HEADER_BYTES or total > MAX_FRAME_BYTES:
        raise KvFrameError(f"frame of {total} bytes exceeds the limit")
    return total


def decode(data: bytes, device: str | torch.device = "cpu") -> KvFrame:
    """Check and unpack a frame; any inconsistency raises KvFrameError."""
    total = frame_size(data[: PREFIX.size])
    if len(data) != total:
        raise KvFrameError(f"truncated frame: {len(data)} of {total} bytes")
    (crc,) = CRC.unpack_from(data, total - CRC.size)
    if zlib.crc32(memoryview(data)[: total - CRC.size]) != crc:
        raise KvFrameError("checksum mismatch")
    _, _, _, hlen, plen = PREFIX.unpack_from(data)
    try:
        h: dict[str, Any] = json.loads(data[PREFIX.size : PREFIX.size + hlen])
        dtype = DTYPES[h["dtype"]]
        shape = [int(x) for x in h["shape"]]
        s = h.get("sampling") or {}
        sampling = Sampling(
            float(s.get("temperature", 0.0)), float(s.get("top_p", 1.0)), int(s.get("seed", -1))
        )
        request_id, first = str(h["request_id"]), int(h["first_token"])
    except (ValueError, KeyError, TypeError) as exc:
        raise KvFrameError(f"bad frame header: {exc}") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    if len(shape) != 5 or n * itemsize != plen or shape[3] != h.get("tokens"):
        raise KvFrameError("frame header does not match its payload")
    start = PREFIX.size + hlen
    raw = bytearray(data[start : start + plen])
    kv = (
        torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        if plen
        else torch.empty(shape, dtype=dtype)
    )
    return KvFrame(request_id, kv.to(device), first, sampling)  # host -> device on a GPU
