"""Defects found by the soak with faults (SIGKILLed replicas and workers, a Redis that restarts
empty, overload bursts, client disconnects and cancels; docs/operations.md "Soak with faults"):
each test here failed before its fix."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import redis.asyncio as aioredis

from app.cluster.leases import Lease
from app.dispatch.owner import OwnerDispatcher
from app.state.keys import Keys
from app.state.retry import TerminalWrites
from app.state.store import StateStore


def test_an_owner_retries_its_replies_in_the_replicas_queue_even_while_that_queue_is_empty() -> None:
    """The replica hands its one terminal-write queue to every owner it runs, so its stop gives
    an owner's failed reply + settle writes their last bounded chance and one task drains them.
    An empty queue is falsy (it has a length): `terminal or TerminalWrites()` gave each owner a
    private queue, which nobody stopped; after a Redis restart the gateway logged "Task was
    destroyed but it is pending! task: <Task pending name='terminal-writes' ...>" when a
    dropped owner's private queue was collected."""

    async def run() -> None:
        shared = TerminalWrites()
        assert len(shared) == 0
        url = "redis://127.0.0.1:1/0"  # never connected to: nothing here reaches Redis
        store = StateStore(aioredis.from_url(url), Keys("t-edges"))
        lease = Lease("lease", "me", 3000, 500)
        d = OwnerDispatcher(
            "prefill@x", "me", lease, store, cast(Any, None), url, epoch=lambda: "1", terminal=shared
        )
        assert d.terminal is shared

    asyncio.run(run())
