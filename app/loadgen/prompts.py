"""Prompts synthesised from a trace's KV-block hashes.

Traces carry no text, only per-block hash ids (equal id = equal prefix block). A replay must make
the gateway and the workers see exactly the trace's prefix sharing, no more and no less:

- every full trace block becomes `block_size` printable-ASCII characters derived from the block's
  hash id alone (and a run salt), so equal ids give equal text and different ids different text;
- whatever lies past the last full block (Mooncake hashes its partial last block; RTP-LLM leaves the
  tail unhashed) becomes text unique to the request, so a partial block never shares anything the
  engine could cache at a finer block size.

Printable ASCII because the gateway's default byte tokenizer maps one such character to exactly one
token: the prompt's token count then equals the trace's `input_len`, which the replay verifies on
every answer. The salt puts each run in its own cache namespace, so a second run against warm
workers does not inherit the first run's hits (pass a fixed `--seed` to reuse one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

PRINTABLE_FIRST = 0x20
PRINTABLE_COUNT = 95  # 0x20 (space) .. 0x7e (~)
# Byte value → printable ASCII byte: digest bytes become prompt text with one table lookup.
_TO_PRINTABLE = bytes(PRINTABLE_FIRST + (b % PRINTABLE_COUNT) for b in range(256))


class BlockSizeError(ValueError):
    """The workers' KV block size does not tile the trace's blocks, so the replay could not give
    the engines the trace's prefix sharing (a worker block would straddle two trace blocks)."""


def check_block_size(trace_block_size: int, worker_block_sizes: Sequence[int]) -> int:
    """The one worker block size, if it equals or divides the trace's; `BlockSizeError` otherwise.

    Why divide: a worker block that divides the trace block never spans two trace blocks, so a
    worker-level prefix hit implies a trace-level shared prefix and vice versa (at full trace
    blocks). A larger or non-dividing worker block would merge distinct trace blocks into one key.
    """
    sizes = sorted(set(int(s) for s in worker_block_sizes))
    if not sizes:
        raise BlockSizeError("the gateway reports no prefill worker, so the block size cannot be checked")
    if len(sizes) > 1:
        raise BlockSizeError(f"prefill workers disagree on the KV block size: {sizes}")
    ws = sizes[0]
    if trace_block_size <= 0 or ws <= 0:
        raise BlockSizeError(f"block sizes must be positive (trace {trace_block_size}, workers {ws})")
    if trace_block_size % ws != 0:
        raise BlockSizeError(
            f"the workers' KV block size ({ws} tokens) must equal or divide the trace's block size "
            f"({trace_block_size} tokens); start the workers with "
            f"--block-size {_divisor_hint(trace_block_size)}"
        )
    return ws


def _divisor_hint(trace_block_size: int) -> str:
    divs = [d for d in (16, 32, 64, 128, 256, 512, 1024) if trace_block_size % d == 0]
    return " or ".join(str(d) for d in divs[-3:]) if divs else str(trace_block_size)


def replay_max_tokens(output_len: int) -> int:
    """Output length to request: rows that logged no output (the RTP-LLM trace's prefill-only
    rows) are replayed as prefill only, `max_tokens: 1`, since the API needs at least one token."""
    return max(1, int(output_len))


class PromptSynth:
    """Text for trace requests; block texts are cached, since popular blocks repeat thousands of
    times in a trace and hashing is the replay client's main CPU cost."""

    def __init__(self, block_size: int, salt: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.salt = salt
        self._blocks: dict[int, str] = {}

    def _text(self, tag: bytes, n: int) -> str:
        digest = hashlib.shake_256(self.salt.to_bytes(8, "little", signed=True) + tag).digest(n)
        return digest.translate(_TO_PRINTABLE).decode("ascii")

    def block(self, block_hash: int) -> str:
        """The text of one trace block: a pure function of (salt, hash id)."""
        t = self._blocks.get(block_hash)
        if t is None:
            h = int(block_hash) & 0xFFFF_FFFF_FFFF_FFFF
            t = self._blocks[block_hash] = self._text(b"B" + h.to_bytes(8, "little"), self.block_size)
        return t

    def tail(self, index: int, n: int) -> str:
        """`n` characters that no other request of the run shares (tagged by request index)."""
        return self._text(b"T" + int(index).to_bytes(8, "little", signed=True), n) if n > 0 else ""

    def prompt(self, index: int, input_len: int, block_hashes: Sequence[int]) -> str:
        """`input_len` characters: one block text per full trace block, then a unique tail."""
        if input_len <= 0:
            raise ValueError(f"request {index}: input_len must be positive, got {input_len}")
        full = min(len(block_hashes), input_len // self.block_size)
        head = "".join(self.block(h) for h in block_hashes[:full])
        return head + self.tail(index, input_len - full * self.block_size)
