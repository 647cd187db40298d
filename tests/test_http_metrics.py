"""The gateway's `flexlb_http_*` series (app/api/http_metrics.py) against the instrumentator they
replace: the same requests through two copies of one app, one with prometheus-fastapi-instrumentator
as the gateway configured it, one with `HttpMetrics`, must give the same series, labels and values
(durations: the same counts; their sums are wall time).

The requests cover what names a handler: a template with a path parameter inside an included
router, a route of the app itself, a path no route matches (`none`), a method the route does not
take (405: the instrumentator names the route), the excluded scrape, an endpoint that raises (5xx),
a streamed answer, request bodies with and without a length, and a non-standard status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_fastapi_instrumentator import Instrumentator

from app.api.http_metrics import HttpMetrics, HttpSeries

EXCLUDED = ["/metrics", "/healthz", "/readyz"]


def _app(registry: CollectorRegistry, lean: bool) -> FastAPI:
    app = FastAPI()
    admin, api = APIRouter(), APIRouter()

    @admin.get("/admin/workers/{worker_id}")
    async def worker(worker_id: str) -> dict[str, str]:
        return {"id": worker_id}

    @api.post("/v1/generate")
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        return {"n": len(body)}

    @api.get("/v1/requests/{request_id}")
    async def status(request_id: str) -> JSONResponse:
        return JSONResponse({"id": request_id}, status_code=202 if request_id == "queued" else 200)

    @api.get("/v1/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(3):
                await asyncio.sleep(0)
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @api.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("endpoint failed")

    app.include_router(admin)
    app.include_router(api)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("scrape")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    if lean:
        app.add_middleware(HttpMetrics, series=HttpSeries(registry, "flexlb"), excluded=EXCLUDED)
    else:
        Instrumentator(registry=registry, excluded_handlers=EXCLUDED).instrument(
            app, metric_namespace="flexlb"
        )
    return app


async def _drive(app: FastAPI) -> None:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for _ in range(2):
            await c.get("/admin/workers/w1")
            await c.post("/v1/generate", json={"prompt": [1, 2, 3], "max_new_tokens": 4})
            await c.post("/v1/generate", content=b"not json", headers={"content-type": "application/json"})
            await c.get("/v1/requests/abc")
            await c.get("/v1/requests/queued")
            await c.get("/v1/stream")
            await c.get("/v1/boom")
            await c.get("/no/such/path")
            await c.delete("/v1/generate")  # 405: the route exists for another method
            await c.get("/metrics")
            await c.get("/healthz")
            await c.get("/metrics/extra")  # untemplated, but excluded by its raw path


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue  # creation timestamps
            if "duration" in s.name and (s.name.endswith("_sum") or s.name.endswith("_bucket")):
                continue  # wall time: compared through the counts below
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_lean_http_metrics_record_what_the_instrumentator_recorded() -> None:
    regs = {lean: CollectorRegistry() for lean in (False, True)}
    for lean, reg in regs.items():
        asyncio.run(_drive(_app(reg, lean)))
    want, got = _samples(regs[False]), _samples(regs[True])
    assert got == want
    # The comparison covers what matters, not an empty registry on both sides.
    handlers = {dict(k[1]).get("handler") for k in want if k[0] == "flexlb_http_requests_total"}
    assert handlers == {
        "/admin/workers/{worker_id}",
        "/v1/generate",
        "/v1/requests/{request_id}",
        "/v1/stream",
        "/v1/boom",
        "none",
    }
    assert (
        want[("flexlb_http_requests_total", (("handler", "/v1/boom"), ("method", "GET"), ("status", "5xx")))]
        == 2
    )
    assert (
        want[
            (
                "flexlb_http_requests_total",
                (("handler", "/v1/generate"), ("method", "DELETE"), ("status", "4xx")),
            )
        ]
        == 2
    )
    assert want[("flexlb_http_request_duration_highr_seconds_count", ())] == 2 * 9
