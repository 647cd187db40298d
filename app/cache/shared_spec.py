"""Speculative cache entries shared through the owner (`FLEXLB_SHARED_SPECULATIVE`, issue 15).

A replica that hands a prompt to worker W remembers the prompt's blocks as speculative entries in
its own mirror (app/request/handoff_stage.py), so its next request sharing that prefix goes to W
before W's cache reports it. Every other replica learns of those blocks only from W's cache diff,
one to two polls after the prefill ran; meanwhile it routes the prefix's follow-ups anywhere. In the
simulator that cost 4 replicas 5.4 points of the full-block bound on trace_30min ("held by nobody
at routing", docs/benchmarks.md). W's owner reads every hand-off to W, whoever routed it, so it
publishes each one's blocks for all replicas:

- **Owner** (`SpecOutbox`): the read loop notes each entry it reads (the block keys the entry
  carries from routing, field `k`); the notes go out as one `XADD` per origin on the worker's
  speculative stream, pipelined with the loop's next `XREADGROUP` (same connection, one write, no
  round trip of their own; app/dispatch/intake.py `_read_entries`). Entries the origin hands
  over in process (it owns the worker: `OwnerIntake.take_local`) never reach that read, so their
  notes go out at once in a write of their own on the store's pool (`_flush_spec`), off the
  request path.
- **Follower** (`parse_record`, app/cache/follower.py): every replica reads those streams in the
  `XREAD` it already makes for the cache diffs and adds the blocks to its `SpecIndex` under the
  normal TTL, counted from the owner's read; it skips records of its own hand-offs (it has them).

Why a stream of its own (`Keys.spec_stream`), not records in the diff stream: the diff stream's
length is the history a lagging follower can catch up on before it must resync (MAXLEN 1,000 =
~200 s of polls); records at request rate would shorten that to seconds on a busy worker, and
every follower would have to tell them apart from versioned diffs. These records matter only for
one TTL (2 s), so their stream is short (`SPEC_STREAM_MAXLEN`) and a follower that starts replays
it and drops what is older than the TTL.

All of the entries carried keys is what the origin adds (`keys[:cap + 1]` with `cap =
hit_blocks_cap(n, block)`, which always covers every full block): the follower adds the same set.
Safety: a record is a hint with a TTL, never a fact; a stale owner's, a lost or a late one can
only make a route follow a prefix that is not there yet (as the origin's own entries can), so the
records are not fenced. Pure: no I/O, time passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SPEC_STREAM_MAXLEN", "SpecOutbox", "SpecRecord", "parse_record"]

# Records kept per worker (MAXLEN ~): what a follower may fall behind by and still see every
# record of the last TTL. At 100 hand-offs/s to one worker and a 2 s TTL 200 are live; a record is
# ~16 bytes of header plus 8 per block (a 2,000-token prompt at block 64: ~260 bytes), so the cap
# holds a worker's stream to ~130 KB (4 KB records of 32K-token prompts: ~2 MB).
SPEC_STREAM_MAXLEN = 512


@dataclass(frozen=True)
class SpecRecord:
    origin: str  # the replica that routed the hand-offs (it has the entries already)
    at_ms: float  # the owner's wall ms when it read them: the entries' TTL runs from here
    keys: Any  # np.ndarray of uint64 block keys (several prompts' blocks, deduplicated)


class SpecOutbox:
    """The owner's notes of hand-offs read since its last flush, by origin."""

    __slots__ = ("_by_origin", "enabled", "noted")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # FLEXLB_SHARED_SPECULATIVE; off: notes nothing, publishes nothing
        self._by_origin: dict[str, list[Any]] = {}
        self.noted = 0  # hand-offs noted so far (flushed or pending)

    def note(self, origin: str, keys: Any) -> None:
        """A hand-off read for the worker: its routing block keys (None for an entry without
        them, from an origin older than issue 20: nothing to publish)."""
        if not self.enabled or keys is None or len(keys) == 0:
            return
        self._by_origin.setdefault(origin, []).append(keys)
        self.noted += 1

    def __bool__(self) -> bool:
        return bool(self._by_origin)

    def take(self, stream: str, now_ms: float) -> list[list[Any]]:
        """The XADD commands for everything noted (one per origin), and forget the notes."""
        out = [
            [
                "XADD",
                stream,
                "MAXLEN",
                "~",
                SPEC_STREAM_MAXLEN,
                "*",
                "o",
                origin,
                "t",
                f"{now_ms:.0f}",
                "keys",
                _pack(arrs),
            ]
            for origin, arrs in self._by_origin.items()
        ]
        self._by_origin.clear()
        return out


def _pack(arrs: Sequence[Any]) -> bytes:
    keys = arrs[0] if len(arrs) == 1 else np.unique(np.concatenate(arrs))
    return np.asarray(keys, dtype="<u8").tobytes()


def parse_record(fields: dict[bytes, bytes]) -> SpecRecord | None:
    """A record of the speculative stream; None when malformed (skipped, never fatal: a bad hint
    must not stop the follower that also applies the cache diffs)."""
    raw = fields.get(b"keys")
    try:
        origin = fields[b"o"].decode()
        at = float(fields[b"t"])
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
    if raw is None or len(raw) % 8:
        return None
    return SpecRecord(origin, at, np.frombuffer(raw, dtype="<u8"))
