"""When a request arrived: the clock the origin's overhead, TTFT and deadlines count from.

The outermost of the app's middlewares stamps `scope[ARRIVAL]` as uvicorn hands the request over
(its C parser has read the request line and headers; nothing has read the body yet). The body's
read, JSON parse and validation, the tenant check and everything after count in the origin's
overhead: measured from the pipeline's start it left out the most expensive part of the request
before the hand-off.
"""

from __future__ import annotations

import time
from typing import Any

ARRIVAL = "flexlb.arrival"


class StampArrival:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[ARRIVAL] = time.perf_counter()
        await self.app(scope, receive, send)


def arrival_of(scope: Any) -> float:
    """The stamp, or now when the app runs without the middleware (an in-process test app)."""
    return float(scope.get(ARRIVAL) or time.perf_counter())
