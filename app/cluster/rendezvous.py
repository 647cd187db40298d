"""Rendezvous (highest-random-weight) hashing: which live replica should own which worker.

Why HRW and not a hash ring: with N members each worker's owner is the member with the highest
`weight(member, worker)`, so removing a member moves exactly the workers it owned (each to its own
runner-up) and adding one takes over only the workers it now wins, with no virtual nodes to tune.
Every replica computes the same answer from the same (workers, members) sets, without talking.

The weight is a stable 64-bit hash (blake2b, not Python's salted `hash()`), so all processes and
all Python versions agree. Pure functions: no I/O, no clock, safe in the simulator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(member_id: str, worker_id: str) -> int:
    """The 64-bit HRW score of `member_id` for `worker_id`; higher wins."""
    digest = hashlib.blake2b(f"{member_id}|{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _key(member_id: str, worker_id: str) -> tuple[int, str]:
    # The member id breaks the (astronomically unlikely) 64-bit tie, so the order is total and every
    # replica still agrees.
    return weight(member_id, worker_id), member_id


def ranked_owners(worker_id: str, members: Iterable[str]) -> list[str]:
    """All members, best first: the preferred owner, then who takes over if it is gone, and so on."""
    return sorted(set(members), key=lambda m: _key(m, worker_id), reverse=True)


def preferred_owner(worker_id: str, members: Iterable[str]) -> str | None:
    """The member that should own `worker_id`; None when there are no members."""
    best: tuple[int, str] | None = None
    for m in members:
        k = _key(m, worker_id)
        if best is None or k > best:
            best = k
    return None if best is None else best[1]


def assign(worker_ids: Iterable[str], member_ids: Iterable[str]) -> dict[str, str]:
    """Map every worker to its preferred member; empty when there are no members.

    Deterministic in the *sets* given (order and duplicates do not matter).
    """
    members = sorted(set(member_ids))
    if not members:
        return {}
    out: dict[str, str] = {}
    for w in set(worker_ids):
        owner = preferred_owner(w, members)
        assert owner is not None
        out[w] = owner
    return out
