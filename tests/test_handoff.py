"""The hand-off queue scripts against both Redis flavours. Regression: Redis 6.2 (the embedded
server) crashed on the first version of the hand-off script (a long unpack()ed XADD)."""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis

from app.state.handoff import GROUP, Handoff, pack_tokens, unpack_tokens
from app.state.keys import Keys
from app.state.store import StateStore


async def test_handoff_take_settle_ack_roundtrip(redis_url: str, cluster: str) -> None:
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    h = Handoff(st)
    wid = "prefill@127.0.0.1:1"
    try:
        await h.ensure_group(wid)
        await h.ensure_group(wid)  # idempotent
        toks = np.arange(4096, dtype=np.int32)
        for i in range(50):
            entry, queued = await h.append(wid, {"rid": f"r{i}", "origin": "o"}, pack_tokens(toks), 2.5, 1000)
            assert entry is not None and queued == 2.5 * (i + 1)
        full, queued = await Handoff(st).append(wid, {"rid": "x"}, b"", 1.0, 50)
        assert full is None and queued == 125.0  # refused at the bound, nothing added
        res = await r.xreadgroup(GROUP, "c1", {keys.queue(wid): ">"}, count=100)
        entries = res[0][1]
        assert len(entries) == 50
        assert np.array_equal(unpack_tokens(entries[0][1][b"ids"]), toks)
        for i, (eid, _f) in enumerate(entries):
            await h.settle_ack(wid, "b", f"r{i}", eid.decode())
        assert await r.xlen(keys.queue(wid)) == 0
        assert (await r.xpending(keys.queue(wid), GROUP))["pending"] == 0
    finally:
        await r.delete(*[k async for k in r.scan_iter(f"{cluster}:*")] or ["_"])
        await r.aclose()
