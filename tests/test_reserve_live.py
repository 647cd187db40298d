"""The default `reserve_output_tokens = p90` on the live gateway (real workers, real Redis).

The origin reserves decode KV for prompt + the learned p90 of finished requests' output, not
prompt + max_new_tokens: a request whose maximum would not fit beside what another request holds
is admitted once the learned length fits, while one that no decode worker could hold at its
maximum is still refused before any prefill (`DecodeQuery.limit_tokens`).

The other hold is a real request the gateway admitted: a long generation on the pool's decode
worker, reconfigured for this test (a small KV, a slower clock, and the engine admitting on actual
use, as vLLM and SGLang do, so the engine itself runs the later requests beside it while the
gateway's reservation decides what is admitted). `workers_reset` puts the pool back, pass or fail.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import redis

from app.scheduling.reserve import share_chunk_size
from app.state.keys import Keys

from .conftest import WorkerProc, worker_call
from .gateways import start_gateway, wait_for

PROMPT = "r" * 60  # byte tokenizer: ~60 prompt tokens
CAP = 8_000  # the decode worker's KV for this test
# The long request reserves prompt + its maximum (nothing learned yet): ~7,460 of 8,000, leaving
# ~540, less than the ~560 a 500-token request needs at its maximum but room for its learned p90.
HOLD_NEW = 7_400
# Modelled decode step 8 ms x 0.5: ~4 ms a token, so the long request lives ~30 s of wall clock,
# far past the rest of the test (the 500-token request takes ~2 s); it is cancelled at the end.
DECODE_TIME_SCALE = 0.5


def test_the_default_reserves_the_learned_p90_and_refuses_what_can_never_fit(
    workers_reset: dict[str, list[WorkerProc]], shared_embedded_redis: str, cluster: str, tmp_path: Any
) -> None:
    pool = workers_reset
    dec = pool["decode"][0]
    did = f"decode@{dec.address}"
    configured = worker_call(
        dec.address,
        "configure",
        kv_capacity_tokens=CAP,
        time_scale=DECODE_TIME_SCALE,
        decode_admission="expected",
    )
    assert configured.get("ok"), configured
    spec = f"prefill@{pool['prefill'][0].address},{did}"
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec)  # FLEXLB_RESERVE_OUTPUT_TOKENS unset
    r = redis.Redis.from_url(shared_embedded_redis)
    held = Keys(cluster).reservations(did)

    def gen(max_new: int, request_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"prompt": PROMPT, "max_new_tokens": max_new}
        if request_id is not None:
            body["request_id"] = request_id
        return httpx.post(a.url + "/v1/generate", json=body, timeout=120)

    long_id = f"long-{uuid.uuid4().hex[:8]}"
    long_out: list[httpx.Response] = []
    long_req = threading.Thread(target=lambda: long_out.append(gen(HOLD_NEW, long_id)), daemon=True)
    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="ready")
        wait_for(
            lambda: _snapshot(a, did).get("kv_total_tokens") in (CAP, str(CAP)),
            30,
            what=f"the gateway to see the decode worker's {CAP}-token KV",
        )
        long_req.start()
        # Its reservation, written by the gateway when it admitted it (read-only poll).
        hold = int(wait_for(lambda: r.hget(held, long_id), 30, what="the long request's reservation"))
        assert hold == len(PROMPT) + HOLD_NEW, hold  # nothing learned yet: prompt + its maximum
        wait_for(lambda: long_id in _decoding(dec), 30, what="the long request decoding")

        big = gen(500)  # prompt + 500 = ~560 > ~540 left: nothing learned yet, so the maximum is reserved
        assert big.status_code == 429 and big.json()["error"]["code"] == "overloaded", big.text
        for _ in range(32):  # the estimator's min_samples: finished requests of 4 tokens each
            small = gen(4)
            assert small.status_code == 200, small.text
        big = gen(500)  # reserves prompt + the learned p90 (4): fits beside the long request's hold
        assert big.status_code == 200, big.text
        out = big.json()
        assert out["decode_worker"] == did and out["usage"]["completion_tokens"] == 500, big.text
        assert not r.hexists(held, out["request_id"])  # released at its end
        assert r.hget(held, long_id) is not None, "the long request ended before the check: box too slow?"
        # Prompt + max_new_tokens beyond the worker's whole KV: the engine could never hold it, so
        # the learned reservation does not get it a wasted prefill; 503 no_worker as under `max`.
        never = gen(CAP)
        assert never.status_code == 503 and never.json()["error"]["code"] == "no_worker", never.text

        assert a.delete(f"/v1/requests/{long_id}").status_code == 202
        long_req.join(60)
        assert long_out and long_out[0].status_code != 200, long_out  # cancelled, not finished
        wait_for(lambda: not r.hexists(held, long_id), 30, what="the long request's hold released")
        assert int(r.hget(held, "_total") or 0) == 0, r.hgetall(held)
    finally:
        a.stop()
        if long_req.is_alive():  # its client call ends with the gateway
            long_req.join(30)
        r.close()


def _snapshot(gw: Any, wid: str) -> dict[str, Any]:
    """The gateway's latest snapshot of ``wid`` (what its routing and reservations read)."""
    snap: dict[str, Any] = (
        gw.get("/admin/workers", admin=True).json()["workers"].get(wid, {}).get("snapshot", {})
    )
    return snap


def _decoding(w: WorkerProc) -> list[str]:
    """Ids the decode worker's engine is generating for now."""
    running: list[str] = worker_call(w.address, "status")["live"]["running"]
    return running


SHARED_PROMPT = "s" * 3_000  # byte tokenizer: ~3,000 prompt tokens, all but the last block full


def test_a_second_request_on_a_shared_prompt_holds_only_its_new_blocks(
    workers_reset: dict[str, list[WorkerProc]], shared_embedded_redis: str, cluster: str, tmp_path: Any
) -> None:
    """`FLEXLB_DECODE_SHARED_PREFIX` (default on): a session's next turn, decoding while the last
    one still runs on the same worker, shares its prompt blocks there. The gateway reserves only
    the blocks no hold on the worker names yet, and the engine (given the block keys) holds them
    once, so the second request runs beside the first where counting the prompt twice refused it
    (prompt + output > the KV left)."""
    pool = workers_reset
    dec = pool["decode"][0]
    did = f"decode@{dec.address}"
    n_prompt = len(SHARED_PROMPT)
    # ~800 left beside the long request: < the prompt, > the prompt's unshared tail (less than one
    # sharing chunk, `share_chunk_size`) + 200
    cap = n_prompt + HOLD_NEW + 800
    configured = worker_call(dec.address, "configure", kv_capacity_tokens=cap, time_scale=DECODE_TIME_SCALE)
    assert configured.get("ok"), configured
    spec = f"prefill@{pool['prefill'][0].address},{did}"
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec)
    r = redis.Redis.from_url(shared_embedded_redis)
    keys = Keys(cluster)
    held = keys.reservations(did)

    def gen(max_new: int, request_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"prompt": SHARED_PROMPT, "max_new_tokens": max_new}
        if request_id is not None:
            body["request_id"] = request_id
        return httpx.post(a.url + "/v1/generate", json=body, timeout=120)

    long_id = f"long-{uuid.uuid4().hex[:8]}"
    long_out: list[httpx.Response] = []
    long_req = threading.Thread(target=lambda: long_out.append(gen(HOLD_NEW, long_id)), daemon=True)
    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="ready")
        wait_for(
            lambda: _snapshot(a, did).get("kv_total_tokens") in (cap, str(cap)),
            30,
            what=f"the gateway to see the decode worker's {cap}-token KV",
        )
        bs = int(float(_snapshot(a, f"prefill@{pool['prefill'][0].address}").get("block_size") or 0))
        assert 0 < share_chunk_size(bs) <= 600, bs  # the unshared tail + 200 fit in the ~800 left
        long_req.start()
        hold = int(wait_for(lambda: r.hget(held, long_id), 30, what="the long request's reservation"))
        assert hold == n_prompt + HOLD_NEW, hold
        assert int(r.hget(held, "_total") or 0) == hold
        wait_for(lambda: long_id in _decoding(dec), 30, what="the long request decoding")

        second = gen(200)  # prompt + 200 = ~3,200 > ~800 left unless the prompt's blocks are shared
        assert second.status_code == 200, second.text
        out = second.json()
        assert out["decode_worker"] == did and out["usage"]["completion_tokens"] == 200, second.text
        assert r.hget(held, long_id) is not None, "the long request ended before the check: box too slow?"
        assert int(r.hget(held, "_total") or 0) == hold  # the second's hold released, the shared blocks kept
        assert r.hget(keys.reservation_blocks(did), "@" + long_id) is not None

        assert a.delete(f"/v1/requests/{long_id}").status_code == 202
        long_req.join(60)
        wait_for(lambda: not r.hexists(held, long_id), 30, what="the long request's hold released")
        assert int(r.hget(held, "_total") or 0) == 0, r.hgetall(held)
        assert r.hgetall(keys.reservation_blocks(did)) == {}
    finally:
        a.stop()
        if long_req.is_alive():
            long_req.join(30)
        r.close()
