"""The FastAPI application of one gateway replica."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from app import metrics as M
from app.api.arrival import StampArrival
from app.api.http_metrics import HttpMetrics, http_series
from app.api.openapi import build_openapi
from app.api.routes import router as api_router
from app.cluster.registry import WorkerSpec
from app.config import Settings
from app.gateway.admin import router as admin_router
from app.gateway.errors import install_error_handlers
from app.gateway.replica import Replica
from app.scheduling.policy import DECODE, PREFILL
from app.security.admin_token import AdminAuth
from app.security.apikeys import KeyStore
from app.security.limits import BodyLimit, ConcurrencyCap
from app.security.ratelimit import Limiter
from app.security.tenants import TenantGate, Tenants

log = logging.getLogger("flexlb.gateway")

#: Objects allocated (net) before a young-generation collection; CPython's default is 700.
YOUNG_GC_THRESHOLD = 10_000


def create_app(settings: Settings, redis_url: str, seed_workers: list[WorkerSpec] | None = None) -> FastAPI:
    replica = Replica(settings, redis_url, seed_workers)
    admin_auth = AdminAuth(settings.admin_token, replica.keys.prefix)
    if settings.auth not in ("none", "keys"):
        raise ValueError(f"FLEXLB_AUTH must be none or keys, not {settings.auth!r}")
    tenants = Tenants(
        settings.auth == "keys",
        KeyStore(replica.redis, replica.keys.prefix),
        Limiter(replica.store, replica.keys.prefix),
        lambda: replica.tenant_limits,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await replica.start()
        try:
            await admin_auth.resolve(replica.redis)
        except RedisError as exc:  # retried at the first admin call (require_admin)
            log.warning("admin token not agreed with the cluster yet: %s", exc)
        # Everything alive now (modules, the app, the replica) lives as long as the process: freeze
        # it out of the collector's reach. Unfrozen, each full collection walked ~85K start-up
        # objects, a ~45 ms stall of the event loop and every request on it.
        gc.collect()
        gc.freeze()
        # A young generation of 10,000 objects instead of 700 (#20). A request allocates thousands
        # of tracked objects and keeps its 1,000-id token lists alive across many collections of
        # 700, so each collection traversed the in-flight requests again and promoted them, and
        # gen1 collections walked them once more. At 32 clients (CPU timed with gc.callbacks, ~1,800
        # requests) the young collections took 0.30 s, 0.17 ms a request; with 10,000 0.05 s (20
        # collections instead of 690, each ~2 ms instead of ~0.3: a collection traverses what is
        # alive, which does not grow with the threshold). Only cyclic garbage waits longer to be
        # freed. The 40-64 ms full collections seen in the bench are start-up ones, before this
        # freeze and before uvicorn serves; under load a full one walks the in-flight requests
        # (~15-19K objects, 5-8 ms of CPU) and is rare: none in a 240 s 32-client loop
        # (docs/benchmarks.md, Request path profile (#20), fifth pass).
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
        log.info("replica %s serving at %s", replica.replica_id, replica.address)
        try:
            yield
        finally:
            await replica.stop(drain=True)

    app = FastAPI(title="FlexLB gateway", lifespan=lifespan)
    app.state.replica = replica
    app.state.admin_auth = admin_auth
    app.state.tenants = tenants
    install_error_handlers(app)
    schema: dict[str, Any] = {}
    built_for: list[Any] = [None]  # the policy book the cached document lists

    def openapi() -> dict[str, Any]:
        """The published contract, with this replica's limits (served model, max tokens, vocabulary)
        and the policy names it accepts, rebuilt when policies are declared at runtime."""
        book = replica.policies
        if not schema or built_for[0] is not book:
            vocab = int(replica.tokenizer.vocab_size)
            names = {role: book.names(role) for role in (PREFILL, DECODE)}
            schema.clear()
            schema.update(build_openapi(app, settings.model, settings.max_new_tokens_limit, vocab, names))
            built_for[0] = book
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    # The API's routes first: the router tries routes in order (~3.5 µs each with FastAPI 0.165),
    # and the 16 admin routes ahead of them cost every client request ~70 µs of CPU (#20,
    # bench/gw_http_layer.py). The two sets cannot overlap (/v1/... vs /admin/...), so which route
    # answers is unchanged; only the OpenAPI document lists the API's paths first.
    app.include_router(api_router)
    app.include_router(admin_router)
    # HTTP metrics by route template (bounded labels, status grouped as 2xx/4xx/5xx), exported through
    # our registry and /metrics; probes and scrapes are left out so they do not drown the traffic.
    # Innermost of the middlewares, as the instrumentator it replaces was (app/api/http_metrics.py):
    # answers the limits below give before routing are not counted.
    app.add_middleware(HttpMetrics, series=http_series(M.REGISTRY), excluded=_NOT_TRAFFIC)
    # Input limits before any work (app/security/limits.py): outside routing, so a refused body is
    # never read whole; the cap answers before the body is read at all.
    # Outermost first: the body limit (413 from Content-Length at once), the tenant (401/403; it
    # tells the cap how high a priority the caller may ask for), the cap (429 by class).
    app.add_middleware(ConcurrencyCap, limit=settings.max_concurrent_requests)
    app.add_middleware(TenantGate, tenants=tenants)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(_BoundedMethod)  # the HTTP metrics see the bounded method
    app.add_middleware(StampArrival)  # outermost: the origin's clock starts before the body is read

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP. Readiness is /readyz."""
        return {"status": "ok", "replica": replica.replica_id}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ok, reasons = replica.readiness()
        body = {
            "ready": ok,
            "reasons": reasons,
            "replica": replica.replica_id,
            "redis": {"ok": replica.redis_ok, "reason": replica.redis_reason},
            "workers": {
                w: replica.snapshots.get(w, {}).get("health", "unknown") for w in sorted(replica.workers)
            },
            "owned": sorted(replica.leases.owned()),
            "master": replica.leases.is_master(),
            "live_replicas": list(replica.leases.live),  # the cluster's, as the last lease tick read it
            "config_version": replica.config_version,  # runtime config version applied here
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(M.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


_NOT_TRAFFIC = ("/metrics", "/healthz", "/readyz")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _BoundedMethod:
    """The HTTP metrics label each request with its method, and a client may send any token as a
    method: each would add series for good. Non-standard methods become `OTHER` (they are answered
    405/404 all the same)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in _METHODS:
            scope = {**scope, "method": "OTHER"}
        await self.app(scope, receive, send)
