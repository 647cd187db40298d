"""Priorities and tenant fairness through a real replica (`FLEXLB_AUTH=keys`), Redis and Triton
workers (issue 16 item 3): `x-flexlb-priority` and the tenant travel in the hand-off entry to the
owner's batcher, which takes higher classes first and shares a saturated worker between tenants."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from app.rpc.worker_client import WorkerClient

from .gateways import ADMIN_TOKEN, start_gateway, wait_for

H = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def keyed_gateway(worker_pool, shared_embedded_redis, cluster, tmp_path):
    """One replica with API keys over one prefill worker (150 ms + 0.1 ms per prompt token) and
    the decode worker (near instant)."""
    p = worker_pool["prefill"][0]
    d = worker_pool["decode"][0]

    async def conf(reset_only: bool = False) -> None:
        for addr, kw in (
            (p.address, {"formula": "150 + sum(0.1*computeTokens)"}),
            (d.address, {"profile": "formula", "formula": "1", "time_scale": 0.05}),
        ):
            c = WorkerClient(addr)
            await c.reset()
            if not reset_only:
                await c.configure(**kw)
            await c.close()

    asyncio.run(conf())
    spec = f"prefill@{p.address},decode@{d.address}"
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, spec, FLEXLB_AUTH="keys")
    try:
        wait_for(lambda: gw.readyz()["ready"], 15, what="ready")
        yield gw
    finally:
        gw.stop()
        asyncio.run(conf(reset_only=True))


def test_classes_first_then_tenants_share_a_saturated_worker_fairly(keyed_gateway) -> None:
    gw = keyed_gateway
    keys = {}
    for tenant in ("a", "b"):
        res = httpx.post(gw.url + "/admin/keys", json={"tenant": tenant}, headers=H, timeout=10)
        assert res.status_code == 200, res.text
        keys[tenant] = res.json()["key"]
    # One batch at a time, one request per batch, no promotion within the test: the completion
    # order is the order the owner's batcher chose.
    cfg = {"schedule_mode": "direct", "max_inflight_batches": 1, "priority_starvation_ms": 60_000.0}
    assert httpx.put(gw.url + "/admin/config", json=cfg, headers=H, timeout=10).status_code == 200
    wait_for(lambda: gw.readyz()["config_version"] >= 1, 5, what="config applied")
    done: list[tuple[float, str]] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as c:

            async def one(tag: str, tenant: str, priority: str | int = "", prompt: str = "p") -> None:
                h = {"Authorization": f"Bearer {keys[tenant]}"}
                body: dict[str, Any] = {"prompt": f"{prompt} {tag}", "max_new_tokens": 1}
                if isinstance(priority, int) or priority.startswith("body:"):  # the body's field
                    body["priority"] = priority if isinstance(priority, int) else priority[5:]
                elif priority:
                    h["x-flexlb-priority"] = priority
                body["deadline_ms"] = 60_000  # this test is about the order, not SLO admission
                res = await c.post(gw.url + "/v1/generate", json=body, headers=h)
                assert res.status_code == 200, res.text
                done.append((time.monotonic(), tag))

            # a 2.2 s blocker occupies the worker while the rest queue up in the owner's batcher
            tasks = [asyncio.create_task(one("blocker", "a", prompt="x" * 20_000))]
            await asyncio.sleep(0.4)
            groups = [
                [("bulk", "a", "bulk")],
                # the class by header, by the body's name and by the body's level alike
                [("i0", "a", "interactive"), ("i1", "a", "body:interactive"), ("i2", "a", 2)],
                [(f"a{k}", "a", "") for k in range(8)],  # tenant a floods first ...
                [(f"b{k}", "b", "") for k in range(8)],  # ... then b, in the same class
            ]
            for group in groups:
                tasks += [asyncio.create_task(one(*g)) for g in group]
                await asyncio.sleep(0.15)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    order = [tag for _, tag in sorted(done)]
    assert order[0] == "blocker", order
    assert set(order[1:4]) == {"i0", "i1", "i2"}, order  # interactive before the earlier bulk
    assert order[-1] == "bulk", order  # bulk after every higher class
    first_default = order[4:12]  # first-come order would give these 8 slots all to tenant a
    shares = {t: sum(1 for tag in first_default if tag.startswith(t)) for t in "ab"}
    assert 3 <= shares["b"] <= 5, (shares, order)
