"""The HTTP facade answers vLLM's token-id endpoints, which vllm-router's `cache_aware` needs.

vllm-router 0.1.17 scores its P/D prefill choice on the workers' token ids, fetched per request
from `/v1/completions/render` (falling back to `/tokenize`). Without them it skipped its radix tree
and routed every request by load alone, so the peer comparison measured a load balancer under the
name `cache_aware` (docs/benchmarks.md, "Peer imitations against the live routers").
"""

import asyncio
from typing import Any

import httpx

from workers.http_facade.server import Facade, create_app
from workers.http_facade.wire import TOK
from workers.server.service import WorkerConfig, WorkerService


def _post(path: str, body: dict[str, Any]) -> httpx.Response:
    svc = WorkerService(WorkerConfig(role="prefill", host="127.0.0.1", grpc_port=0))
    app = create_app(Facade(svc, "prefill@test", "127.0.0.1", 0, "flexlb-sim"))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def test_render_returns_the_prompts_token_ids_as_vllm_does() -> None:
    r = _post("/v1/completions/render", {"model": "flexlb-sim", "prompt": "abc~ ", "max_tokens": 4})
    assert r.status_code == 200
    assert r.json() == [{"token_ids": TOK.encode("abc~ "), "features": None}]


def test_tokenize_returns_tokens_count_and_the_profiles_context_limit() -> None:
    r = _post("/tokenize", {"model": "flexlb-sim", "prompt": "hello"})
    doc = r.json()
    assert r.status_code == 200
    assert doc["tokens"] == TOK.encode("hello") and doc["count"] == 5
    assert doc["max_model_len"] >= 8192


def test_a_body_without_a_prompt_is_a_400_not_a_crash() -> None:
    r = _post("/tokenize", {"model": "flexlb-sim"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request"
