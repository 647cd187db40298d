"""A prefill hand-off entry as the owner reads it from the worker's queue stream."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.rpc.worker_client import PromptKeys
from app.scheduling.batcher import DEFAULT_PRIORITY
from app.security.limits import PRIORITIES
from app.security.tenants import NS
from app.state.handoff import unpack_keys, unpack_tokens
from app.state.text import to_str as s

#: A class's level in the queue entry's `pr` field (absent for `default`): the owner's batcher
#: takes higher levels first (app/scheduling/batcher.py).
LEVEL = {name: i for i, name in enumerate(PRIORITIES)}
assert LEVEL["default"] == DEFAULT_PRIORITY


def level_of(priority: str | None) -> int:
    """The level of a class name from the request's state (`default` when none was set)."""
    return LEVEL.get(priority or "default", DEFAULT_PRIORITY)


@dataclass
class QueueItem:
    entry_id: str
    request_id: str
    origin: str
    tokens: Any
    predicted_ms: float
    deadline_ms: float  # wall ms since the epoch; 0 = none
    trace_id: str = ""
    t_handoff: float = 0.0  # wall s when the origin appended it
    hit_tokens: int = 0  # the origin's expectation from its cache mirror
    attempt: int = 0  # the origin's hand-off number for this request, echoed in the reply
    ttft_deadline_ms: float = 0.0  # wall ms since the epoch its TTFT deadline passes; 0 = none
    drop_late: bool = False  # end it typed if that deadline passes while it waits here
    sampling: dict[str, Any] | None = None  # temperature/top_p/seed for a real engine; None: greedy
    priority: int = DEFAULT_PRIORITY  # LEVEL of its x-flexlb-priority class
    tenant: str = ""  # from the namespaced request id: nothing extra travels for it
    # Routing's block keys (the entry's `k` field) and their key space's namespace seed; None for
    # an entry without them (an origin older than issue 20's change): the owner's client hashes.
    keys: Any = None
    key_space: int = 0
    # Its predicted ms already came off the worker's queued_ms: an earlier commit of it (the dead
    # owner's batch it is re-admitted from: a claim's redispatch, an adoption's re-run) took them,
    # and a hand-off adds them once, so its next commit or refusal takes nothing for it.
    queued_taken: bool = False


def parse_item(entry_id: Any, f: dict[bytes, bytes]) -> QueueItem:
    m = json.loads(f[b"m"])
    carried = unpack_keys(f[b"k"]) if b"k" in f else None
    return QueueItem(
        entry_id=s(entry_id),
        request_id=str(m["rid"]),
        origin=str(m["origin"]),
        tokens=unpack_tokens(f[b"ids"]),
        predicted_ms=float(m.get("pred", 0.0)),
        deadline_ms=float(m.get("deadline", 0.0)),
        trace_id=str(m.get("trace", "")),
        t_handoff=float(m.get("t", 0.0)),
        hit_tokens=int(m.get("hit", 0)),
        attempt=int(m.get("att", 0)),
        ttft_deadline_ms=float(m.get("ttft_dl", 0.0)),
        drop_late=bool(m.get("drop", 0)),
        sampling=m.get("smp") or None,
        priority=int(m.get("pr", DEFAULT_PRIORITY)),
        tenant=str(m["rid"]).split(NS, 1)[0] if NS in str(m["rid"]) else "",
        keys=carried[1] if carried else None,
        key_space=carried[0] if carried else 0,
    )


def carried_keys(items: list[QueueItem]) -> PromptKeys | None:
    """The block keys the entries carry from routing, so the client does not hash the prompts
    again (issue 20). Keys in another space than the first carrier's (a rolling config change) and
    entries without keys go as None: the client hashes those."""
    space = next((i.key_space for i in items if i.keys is not None), None)
    if space is None:
        return None
    return PromptKeys(space, [i.keys if i.key_space == space else None for i in items])


def failure(code: str, error: str, accepted: bool) -> dict[str, Any]:
    """A batch that failed before the worker acknowledged it never started there, so its members
    may run elsewhere: `not_started` lets the origin retry them once on another worker."""
    out: dict[str, Any] = {"status": code, "error": error}
    if not accepted:
        out["not_started"] = 1
    return out
