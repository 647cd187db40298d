"""The `flexlb_http_*` series, recorded by one lean ASGI middleware.

These series used to come from prometheus-fastapi-instrumentator's middleware, which costs more
than the request's own routing: before every request it matches the path against every route again
to name the handler (the router then does the same scan), and after it it builds a `Response` and
an `Info` object, re-reads the headers and awaits an empty `asyncio.gather` (#20: 0.35-0.55 ms per
request in-process on this box, more than the HTTP parse and validation). Here the handler is the
route the router itself chose (`scope["route"]`, set by FastAPI's routing), and the same five
series are updated directly.

The series, labels, buckets and rules are the instrumentator's defaults as this gateway used them
(docs/operations.md "Metrics"): the handler is the route template, or `none` for a path no route
matches; probes and scrapes (`excluded`, searched as regular expressions in the handler, as the
instrumentator did) are not counted; status codes are grouped (`2xx`); the duration covers the
whole response, token streams included; sizes are the `Content-Length` headers (0 when absent);
a request whose app raised before answering counts as `5xx`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from prometheus_fastapi_instrumentator import routing
from starlette.requests import HTTPConnection

HIGHR_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    1.5,
    2,
    2.5,
    3,
    3.5,
    4,
    4.5,
    5,
    7.5,
    10,
    30,
    60,
    float("inf"),
)
LOWR_BUCKETS = (0.1, 0.5, 1, float("inf"))


class HttpSeries:
    """The five series, registered once per registry."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.total = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ("method", "status", "handler"),
            namespace=namespace,
            registry=registry,
        )
        self.in_size = Summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is respected. "
            "Otherwise ignored. No percentile calculated. ",
            ("handler",),
            namespace=namespace,
            registry=registry,
        )
        self.out_size = Summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler. Only value of header is respected. "
            "Otherwise ignored. No percentile calculated. ",
            ("handler",),
            namespace=namespace,
            registry=registry,
        )
        self.latency_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate "
            "percentile calculations. ",
            buckets=HIGHR_BUCKETS,
            namespace=namespace,
            registry=registry,
        )
        self.latency_lowr = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by "
            "handler is important. ",
            ("method", "handler"),
            buckets=LOWR_BUCKETS,
            namespace=namespace,
            registry=registry,
        )


_SERIES: dict[int, HttpSeries] = {}


def http_series(registry: CollectorRegistry, namespace: str = "flexlb") -> HttpSeries:
    """The series of `registry`, registered at its first use: every app built in a process (tests
    build several) records into the same ones."""
    s = _SERIES.get(id(registry))
    if s is None:
        s = _SERIES[id(registry)] = HttpSeries(registry, namespace)
    return s


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value)
    return 0


class HttpMetrics:
    """Pure ASGI: no wrapper objects per request beyond the `send` closure."""

    def __init__(self, app: Any, series: HttpSeries, excluded: Iterable[str] = ()) -> None:
        self.app = app
        self.series = series
        self.excluded = [re.compile(p) for p in excluded]
        self._skip: dict[str, bool] = {}  # handler -> excluded (templates only: a bounded set)
        # (method, status class, handler) -> its children of the four labelled series: `labels`
        # takes a lock and builds a key per call, four times a request. No more entries than the
        # series have children (nothing here removes one).
        self._children: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        out_size = 0

        async def send_wrapper(message: Any) -> None:
            nonlocal status, out_size
            if message["type"] == "http.response.start":
                status = int(message["status"])
                out_size = _content_length(message.get("headers") or ())
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._observe(scope, status, out_size, time.perf_counter() - start)

    def _observe(self, scope: Any, status: int, out_size: int, duration: float) -> None:
        route = scope.get("route")
        handler = getattr(route, "path", None) if route is not None else None
        if handler is None:  # no route of ours took it (404, or the router never ran)
            handler = routing.get_route_name(HTTPConnection(scope), should_include_root_path=False)
        if handler is None:
            # An untemplated path is grouped as `none`, but exclusion looks at the raw path.
            if any(p.search(scope["path"]) for p in self.excluded):
                return
            handler = "none"
        else:
            skip = self._skip.get(handler)
            if skip is None:
                skip = self._skip[handler] = any(p.search(handler) for p in self.excluded)
            if skip:
                return
        s = self.series
        method = scope["method"]
        key = (method, f"{str(status)[0]}xx", handler)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                s.total.labels(*key),
                s.in_size.labels(handler),
                s.out_size.labels(handler),
                s.latency_lowr.labels(method, handler),
            )
        total, in_size, out_size_s, latency_lowr = children
        total.inc()
        in_size.observe(_content_length(scope["headers"]))
        out_size_s.observe(out_size)
        s.latency_highr.observe(duration)
        latency_lowr.observe(duration)
