"""The default `reserve_output_tokens = p90` on the live gateway (real workers, real Redis).

The origin reserves decode KV for prompt + the learned p90 of finished requests' output, not
prompt + max_new_tokens: a request whose maximum would not fit beside what other replicas hold
is admitted once the learned length fits, while one that no decode worker could hold at its
maximum is still refused before any prefill (`DecodeQuery.limit_tokens`).
"""

from __future__ import annotations

import httpx
import redis

from app.state.keys import Keys

from .gateways import start_gateway, wait_for

PROMPT = "r" * 60  # byte tokenizer: ~60 prompt tokens
CAP = 1_000  # the decode worker's KV


def test_the_default_reserves_the_learned_p90_and_refuses_what_can_never_fit(
    worker_pool, worker_tmp, shared_embedded_redis, cluster, tmp_path
) -> None:
    from .conftest import start_worker

    dec = start_worker(
        "decode",
        worker_tmp,
        "--profile",
        "formula",
        "--formula",
        "1",
        "--kv-capacity-tokens",
        str(CAP),
        "--time-scale",
        "0.1",
    )
    did = f"decode@{dec.address}"
    spec = f"prefill@{worker_pool['prefill'][0].address},{did}"
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec)  # FLEXLB_RESERVE_OUTPUT_TOKENS unset
    r = redis.Redis.from_url(shared_embedded_redis)
    keys = Keys(cluster)

    def gen(max_new: int) -> httpx.Response:
        body = {"prompt": PROMPT, "max_new_tokens": max_new}
        return httpx.post(a.url + "/v1/generate", json=body, timeout=60)

    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="ready")
        # Another replica holds 600 of the 1,000 tokens: 400 left for this origin's reservations.
        r.hset(keys.reservations(did), mapping={"someone-else": 600, "_total": 600})
        big = gen(500)  # prompt + 500 = ~560 > 400: nothing learned yet, so the maximum is reserved
        assert big.status_code == 429 and big.json()["error"]["code"] == "overloaded", big.text
        for _ in range(32):  # the estimator's min_samples: finished requests of 4 tokens each
            small = gen(4)
            assert small.status_code == 200, small.text
        big = gen(500)  # reserves prompt + the learned p90 (4): fits beside the other hold
        assert big.status_code == 200, big.text
        out = big.json()
        assert out["decode_worker"] == did and out["usage"]["completion_tokens"] == 500, big.text
        assert not r.hexists(keys.reservations(did), out["request_id"])  # released at its end
        # Prompt + max_new_tokens beyond the worker's whole KV: the engine could never hold it, so
        # the learned reservation does not get it a wasted prefill; 503 no_worker as under `max`.
        never = gen(CAP)
        assert never.status_code == 503 and never.json()["error"]["code"] == "no_worker", never.text
    finally:
        r.delete(keys.reservations(did))
        a.stop()
        dec.stop()
        r.close()
