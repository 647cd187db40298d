"""`FLEXLB_DECODE_PREFER_HELD` on the live gateway (real Redis, real pool workers plus a second
decode worker): a request goes to the decode worker where the gateway's own hold already names
its prompt, although the other worker has more raw headroom, because there it reserves only its
unshared part and keeps more room. With the setting off the same requests go to the emptier
worker (the old pick).

Two long generations hold KV on the two decode workers (a slow clock keeps them running): one
with the shared prompt, one with another, 1,280 tokens shorter. Follow-ups with the shared prompt
then run one by one while both hold.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import pytest
import redis

from app.scheduling.reserve import share_chunk_size
from app.state.keys import Keys

from .conftest import WorkerProc, start_worker, worker_call
from .gateways import start_gateway, wait_for
from .test_reserve_live import SHARED_PROMPT, _decoding, _snapshot

CAP = 20_000  # each decode worker's KV; the pick's band is 5 % of the best headroom (~950)
LONG_NEW = 300
GAP = 1_280  # the other long hold is this much smaller: out of the band, and less than the held part
OTHER_PROMPT = "o" * (len(SHARED_PROMPT) - GAP)
# Modelled decode step 8 ms x 20: ~160 ms a token, so the long requests live ~48 s of wall clock,
# far past the follow-ups (one decode step each); they are cancelled at the end.
DECODE_TIME_SCALE = 20.0


def _num(snap: dict[str, Any], key: str) -> int:
    return int(float(snap.get(key) or 0))


@pytest.mark.parametrize("prefer", [True, False])
def test_a_request_goes_where_its_prompt_is_held(
    prefer: bool,
    workers_reset: dict[str, list[WorkerProc]],
    shared_embedded_redis: str,
    cluster: str,
    tmp_path: Any,
) -> None:
    pool = workers_reset
    extra = start_worker("decode", tmp_path, "--profile", "formula", "--formula", "1")
    decs = [pool["decode"][0], extra]
    dids = [f"decode@{d.address}" for d in decs]
    for d in decs:
        got = worker_call(d.address, "configure", kv_capacity_tokens=CAP, time_scale=DECODE_TIME_SCALE)
        assert got.get("ok"), got
    pre = f"prefill@{pool['prefill'][0].address}"
    env = {} if prefer else {"FLEXLB_DECODE_PREFER_HELD": "false"}
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, ",".join([pre, *dids]), **env)
    r = redis.Redis.from_url(shared_embedded_redis)
    keys = Keys(cluster)

    def gen(prompt: str, max_new: int, request_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": max_new}
        if request_id is not None:
            body["request_id"] = request_id
        return httpx.post(a.url + "/v1/generate", json=body, timeout=120)

    def held_on(rid: str) -> str | None:
        return next((d for d in dids if r.hexists(keys.reservations(d), rid)), None)

    longs = [f"long-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"]
    threads = [
        threading.Thread(target=lambda: gen(SHARED_PROMPT, LONG_NEW, longs[0]), daemon=True),
        threading.Thread(target=lambda: gen(OTHER_PROMPT, LONG_NEW, longs[1]), daemon=True),
    ]
    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="ready")
        for did in dids:
            wait_for(
                lambda did=did: _num(_snapshot(a, did), "kv_total_tokens") == CAP, 30, what=f"{did}'s KV"
            )
        bs = _num(_snapshot(a, pre), "block_size")
        chunk = share_chunk_size(bs)
        n_tokens = len(SHARED_PROMPT)  # byte tokenizer
        shared = (n_tokens // bs) * bs // chunk * chunk  # what a follow-up shares with the long hold
        band = 0.05 * CAP
        assert band < GAP < shared - band, (bs, shared)  # out of the band alone, in it with the held part
        threads[0].start()
        holder = wait_for(lambda: held_on(longs[0]), 30, what="the long request's reservation")
        other = dids[1 - dids.index(holder)]
        hold = int(r.hget(keys.reservations(holder), longs[0]) or 0)
        wait_for(lambda: _num(_snapshot(a, holder), "reserved_tokens") == hold, 30, what="its snapshot")
        threads[1].start()  # the emptier worker takes it
        assert wait_for(lambda: held_on(longs[1]), 30, what="the other long reservation") == other
        hold2 = int(r.hget(keys.reservations(other), longs[1]) or 0)
        assert hold - hold2 == GAP, (hold, hold2)
        for rid, did in ((longs[0], holder), (longs[1], other)):
            wait_for(
                lambda rid=rid, did=did: rid in _decoding(decs[dids.index(did)]), 30, what=f"{rid} decoding"
            )

        def settled() -> bool:
            # snapshots without the previous follow-up: a stale one would move the band
            h, o = _snapshot(a, holder), _snapshot(a, other)
            return (
                _num(h, "reserved_tokens") == hold
                and _num(o, "reserved_tokens") == hold2
                and _num(h, "kv_free_tokens") >= CAP - hold
                and _num(o, "kv_free_tokens") >= CAP - hold2
            )

        placed = []
        for _ in range(4):
            wait_for(settled, 30, what="settled snapshots")
            out = gen(SHARED_PROMPT, 2)
            assert out.status_code == 200, out.text
            placed.append(out.json()["decode_worker"])
        assert held_on(longs[0]) == holder and held_on(longs[1]) == other, (
            "a long request ended: box too slow?"
        )
        assert placed == [holder if prefer else other] * 4, (holder, placed)
        for rid in longs:
            assert a.delete(f"/v1/requests/{rid}").status_code == 202
        for t in threads:
            t.join(60)
        for did in dids:
            wait_for(
                lambda did=did: _num({"t": r.hget(keys.reservations(did), "_total")}, "t") == 0,
                30,
                what="released",
            )
    finally:
        a.stop()
        extra.stop()
        for t in threads:
            if t.is_alive():
                t.join(30)
        r.close()
