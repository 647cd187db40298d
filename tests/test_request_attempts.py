"""The lifecycle scripts of a retried client id (app/state/lifecycle.py) on a real Redis: a retry
re-opens only the attempt it read, once, even when retries race; the head never expires under a
running attempt and expires with its current one; a late end of an earlier attempt moves nothing.
The end-to-end behaviour (real gateways and workers) is tests/test_request_retry.py."""

from __future__ import annotations

import asyncio
import re

from app.state.keys import Keys
from app.state.lifecycle import attempt_id, attempt_of, client_id, current_attempt, invites_retry
from app.state.store import StateStore


async def retry(store: StateStore, cid: str, n: int, state: str, origin: str = "rep-B") -> bool:
    """The origin's `RETRY_REQUEST` (app/request/record_stage.py) for attempt n → n + 1."""
    keys = [
        store.keys.request(cid),
        store.keys.request(attempt_id(cid, n)),
        store.keys.request(attempt_id(cid, n + 1)),
    ]
    return int(await store.run_script("retry_request", keys, [n, state, origin])) == 1


def test_attempt_ids_share_their_heads_hash_slot_and_read_back() -> None:
    k = Keys("p")
    tag = re.compile(r"\{([^}]*)\}")
    assert tag.findall(k.request("t~abc#3")) == tag.findall(k.request("t~abc")) == ["q:t~abc"]
    assert k.request("abc") == "p:{q:abc}:req" and k.request("abc#2") == "p:{q:abc}:req#2"
    assert attempt_id("abc", 1) == "abc" and attempt_id("abc", 2) == "abc#2"
    assert client_id("abc#2") == "abc" and attempt_of("abc#2") == 2 and attempt_of("abc") == 1


def test_what_invites_a_retry() -> None:
    def err(retryable: bool) -> dict[str, object]:
        return {"error": {"code": "x", "retryable": retryable}}

    assert invites_retry({"state": "failed", "outcome": err(True)})
    assert invites_retry({"state": "timed_out", "outcome": err(True)})
    assert invites_retry({"state": "owner_lost", "outcome": err(True)})
    assert invites_retry({"state": "owner_lost", "outcome": {"error": "from before typed errors"}})
    assert invites_retry({"state": "cancelled", "outcome": err(False)})  # the client went away
    assert not invites_retry({"state": "failed", "outcome": err(False)})
    assert not invites_retry({"state": "completed", "outcome": {}})
    assert not invites_retry({"state": "decoding"})


async def test_a_retry_reopens_only_the_attempt_it_read_once_even_when_retries_race(
    store: StateStore,
) -> None:
    cid = "c1"
    assert await store.create_request(cid, "rep-A")
    assert not await retry(store, cid, 1, "queued")  # running: nothing to re-open
    assert await store.transition(cid, "failed", outcome={"error": {"retryable": True}})
    assert not await retry(store, cid, 1, "timed_out")  # not the state the caller judged
    results = await asyncio.gather(*(retry(store, cid, 1, "failed", f"rep-{i}") for i in range(10)))
    assert sum(results) == 1
    head = await store.get_request(cid)
    assert head is not None and head["attempt"] == "2" and head["state"] == "failed"
    assert await store.redis.ttl(store.keys.request(cid)) == -1  # no TTL under a running attempt
    rid, rec = await current_attempt(store, cid)
    assert rid == "c1#2" and rec is not None and rec["state"] == "queued" and rec["attempt"] == "2"
    assert not await retry(store, cid, 1, "failed")  # the head moved on: a repeat changes nothing
    assert not await retry(store, cid, 2, "queued")  # attempt 2 runs
    assert await store.transition(rid, "dispatched")
    assert await store.transition(rid, "completed", outcome={"output_ids": [1]})
    assert 0 < await store.redis.ttl(store.keys.request(rid)) <= 120
    assert 0 < await store.redis.ttl(store.keys.request(cid)) <= 120  # expires with its attempt
    assert not await retry(store, cid, 2, "queued")


async def test_a_late_end_of_an_earlier_attempt_never_expires_the_head_under_a_running_one(
    store: StateStore,
) -> None:
    cid = "c2"
    assert await store.create_request(cid, "rep-A")
    lost = {"error": {"code": "owner_lost", "retryable": True}}
    assert await store.transition(cid, "owner_lost", outcome=lost)
    assert await retry(store, cid, 1, "owner_lost")
    assert await store.transition(attempt_id(cid, 2), "cancelled", outcome={"error": {"retryable": False}})
    assert await retry(store, cid, 2, "cancelled")
    # The stalled origin of attempt 1 answered its client after all (owner_lost → completed):
    # the record says so, and the head keeps no TTL while attempt 3 runs.
    assert await store.transition(cid, "completed", outcome={"output_ids": [7]})
    assert await store.redis.ttl(store.keys.request(cid)) == -1
    rid, rec = await current_attempt(store, cid)
    assert rid == "c2#3" and rec is not None and rec["state"] == "queued"
    assert await store.transition(rid, "timed_out", outcome={"error": {"retryable": True}})
    assert 0 < await store.redis.ttl(store.keys.request(cid)) <= 120
