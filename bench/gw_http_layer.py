"""What the HTTP metrics middleware and the route order cost a request, in-process (#20).

One FastAPI app shaped like the gateway's routing (the docs routes, 20 admin routes in an included
router, then the API's), a POST answered at once, driven straight through ASGI (no sockets, no
server) and timed by this process's CPU time: without HTTP metrics, with
prometheus-fastapi-instrumentator as the gateway used it, with app/api/http_metrics.py, and with
that and the API's router included before the admin one (app/gateway/app.py). The arms alternate
in rounds; the medians of the rounds' µs per request are printed, so the box's load hits the arms
alike.

    .venv/bin/python bench/gw_http_layer.py [ROUNDS] [REQUESTS_PER_ROUND]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.responses import Response

from app.api.http_metrics import HttpMetrics, HttpSeries

ARMS = ("none", "instrumentator", "lean", "lean+api-first")


def make(arm: str) -> FastAPI:
    app = FastAPI()
    admin, api = APIRouter(), APIRouter()
    for i in range(20):
        admin.add_api_route(f"/admin/thing{i}/{{x}}", lambda x: {"x": x}, methods=["GET"])

    @api.post("/v1/completions")
    async def completions() -> Response:
        return Response(b'{"ok":1}', media_type="application/json")

    for r in (api, admin) if arm.endswith("api-first") else (admin, api):
        app.include_router(r)
    excluded = ["/metrics", "/healthz", "/readyz"]
    if arm == "instrumentator":
        Instrumentator(registry=CollectorRegistry(), excluded_handlers=excluded).instrument(
            app, metric_namespace="x"
        )
    elif arm.startswith("lean"):
        app.add_middleware(HttpMetrics, series=HttpSeries(CollectorRegistry(), "x"), excluded=excluded)
    return app


async def per_request_us(app: FastAPI, n: int) -> float:
    body = b'{"prompt": [1, 2, 3], "max_tokens": 4}'
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    t0 = time.process_time()  # CPU, not wall: on the shared box, wall time is mostly waiting
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.process_time() - t0) / n * 1e6


async def main(rounds: int, n: int) -> None:
    apps = {arm: make(arm) for arm in ARMS}
    for app in apps.values():
        await per_request_us(app, 200)  # builds the middleware stack, warms caches
    got: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(rounds):
        for arm in ARMS if i % 2 == 0 else reversed(ARMS):
            got[arm].append(await per_request_us(apps[arm], n))
    med = {arm: statistics.median(v) for arm, v in got.items()}
    print(
        f"CPU µs per request, median of {rounds} rounds of {n}: "
        + ", ".join(f"{arm} {med[arm]:.1f}" for arm in ARMS)
        + f"; metrics cost: instrumentator {med['instrumentator'] - med['none']:.1f}, "
        + f"lean {med['lean'] - med['none']:.1f}; API routes first: "
        + f"{med['lean+api-first'] - med['lean']:.1f}"
    )


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    asyncio.run(main(*(args + [9, 2000][len(args) :])))
