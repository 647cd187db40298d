"""The clean-up of an aborted request runs to its end even when its task is cancelled again
while it runs (a DELETE's notify and the origin's sweep of its cancel set both cancel it).

Before the fix a second cancel cut the shielded wait short: the request left the origin's live
set while its terminal write was still in flight, and the origin's own sweep ended it `failed`
under the clean-up's feet (CI saw `lifecycle failed` after a DELETE on the other replica)."""

from __future__ import annotations

import asyncio

import pytest

from app.gateway.errors import ApiError
from app.request.endings import Endings
from app.request.types import GenRequest, Progress


class _Probe(Endings):
    """Only the clean-up's shape: `_abort_inner` waits for `release`, then records its end."""

    def __init__(self) -> None:  # no replica: the methods under test touch none of it
        self.release = asyncio.Event()
        self.events: list[str] = []

    def _observe(self, req: GenRequest, p: Progress, code: str) -> None:
        self.events.append(f"observe {code}")

    async def _abort_inner(self, req: GenRequest, p: Progress, state: str, err: ApiError) -> None:
        self.events.append("inner started")
        await self.release.wait()
        self.events.append(f"inner done {state}")


async def test_a_second_cancel_does_not_cut_the_clean_up_short() -> None:
    probe = _Probe()
    req = GenRequest(request_id="r1", input_ids=[1, 2], max_new_tokens=4, timeout_ms=1000)
    p = Progress(t0=0.0)
    p.stage = "handed_off"
    task = asyncio.create_task(probe._abort(req, p, "cancelled", ApiError("cancelled", "x")))
    while "inner started" not in probe.events:
        await asyncio.sleep(0)
    for _ in range(3):  # notify, sweep, client disconnect
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done(), "the abort returned while its clean-up was still running"
    probe.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert probe.events[-1] == "inner done cancelled"


async def test_an_uncancelled_abort_returns_normally() -> None:
    probe = _Probe()
    req = GenRequest(request_id="r2", input_ids=[1], max_new_tokens=4, timeout_ms=1000)
    p = Progress(t0=0.0)
    p.stage = "handed_off"
    probe.release.set()
    await probe._abort(req, p, "failed", ApiError("internal", "x"))
    assert probe.events == ["observe internal", "inner started", "inner done failed"]
