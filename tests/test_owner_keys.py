"""The owner hands the worker the block keys the hand-off entry carries from routing instead of
hashing the prompt again (issue 20), and still serves entries without them (an older origin's)
or with keys in another key space. Real Redis, a real Triton worker, a real owner."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import redis.asyncio as aioredis

from app.cluster.leases import Lease, acquire_leases
from app.dispatch.items import parse_item
from app.dispatch.owner import OwnerDispatcher
from app.protocol.blocks import block_keys, namespace_seed
from app.state.handoff import GROUP, Handoff, pack_keys, pack_tokens, unpack_keys
from app.state.keys import Keys
from app.state.store import StateStore

from .conftest import handoff_rig


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(32, 127, size=n, dtype=np.int32)


async def test_both_handoff_scripts_carry_the_keys_field(redis_url: str, cluster: str) -> None:
    """`HANDOFF` and `HANDOFF_PICK` (the gateway's default with FLEXLB_FRESH_PICK) write the keys
    as the entry's `k` field on the queue they chose, and no `k` when given none."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    a, b = "prefill@127.0.0.1:1", "prefill@127.0.0.1:2"
    raw = pack_keys(namespace_seed("flexlb-sim", "byte", 64), block_keys(_prompt(3, 200), 64))
    try:
        h = Handoff(st)
        await h.append(a, {"rid": "x"}, b"ids", 1.0, 100, 1.0, raw)
        await h.append(a, {"rid": "y"}, b"ids", 1.0, 100)
        ks = [keys.queue(a), keys.queued_ms(a), keys.ledger(a), keys.queue(b), keys.queued_ms(b)]
        ks += [keys.ledger(b), keys.request("none")]
        # B's utility is far higher: the pick goes to B
        terms = ["0", "0", "0", "1000", "0", "0", "1", "0", "0"]
        for k in (raw, b""):
            args = [100, b"ids", '{"w":"a"}', '{"w":"b"}', "1", "1", "1", "1", *terms, 1, b, k]
            res = await st.run_script("handoff_pick", ks, args)
            assert int(res[3]) == 2
        on_a = [f.get(b"k") for _, f in await r.xrange(keys.queue(a))]
        on_b = [f.get(b"k") for _, f in await r.xrange(keys.queue(b))]
        assert on_a == [raw, None] and on_b == [raw, None]
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()


def test_keys_pack_and_parse_from_an_entry() -> None:
    """The `k` field round-trips; an entry without it (or a malformed one) parses with no keys."""
    keys = block_keys(_prompt(1, 64 * 4 + 3), 64)
    space = namespace_seed("flexlb-sim", "byte", 64)
    raw = pack_keys(space, keys)
    assert len(raw) == 8 * (1 + len(keys))
    got = unpack_keys(raw)
    assert got is not None and got[0] == space and got[1].tolist() == keys
    base = {b"m": b'{"rid":"r","origin":"o"}', b"ids": pack_tokens(np.arange(300))}
    with_keys = parse_item("1-0", {**base, b"k": raw})
    assert with_keys.key_space == space and with_keys.keys.tolist() == keys
    without = parse_item("1-1", base)
    assert without.keys is None and without.key_space == 0
    assert parse_item("1-2", {**base, b"k": raw[:-3]}).keys is None


async def test_owner_sends_carried_keys_and_hashes_entries_without_them(
    clients, shared_embedded_redis
) -> None:
    """Four entries, claimed from a dead owner and read fresh: one carries keys that are not its
    prompt's (another prompt's, in the worker's space), so the worker caching those keys shows the
    owner sent what the entry carried rather than hashing; one carries none (an older origin) and
    one carries keys of another key space: both are hashed by the owner's client and cache their
    own prompt's keys. Every one is answered `ok`."""
    p = clients["prefill"][0]
    await p.configure(formula="5")
    epoch = (await p.status())["epoch"]
    d = await p.describe()
    bs = int(d["block_size"])
    space = namespace_seed(str(d["model_name"]), str(d["tokenizer"]), bs)
    keys, wid, r, store, handoff = await handoff_rig(shared_embedded_redis, "t-okeys", p.address)
    names = ("carried", "decoy", "plain", "other", "fresh")
    prompts = {name: _prompt(seed, bs * 3) for seed, name in enumerate(names)}

    def hashed(name: str) -> list[int]:
        return block_keys(prompts[name], bs, model=d["model_name"], tokenizer=d["tokenizer"])

    decoy_keys = hashed("decoy")
    wrong_space = namespace_seed("another-model", "byte", bs)
    carry = {
        "carried": pack_keys(space, decoy_keys),
        "plain": b"",
        "other": pack_keys(wrong_space, block_keys(prompts["other"], bs, model="another-model")),
    }
    rids = {name: f"ok-{name}-{uuid.uuid4().hex[:6]}" for name in prompts}

    async def append(name: str, k: bytes) -> None:
        meta = {"rid": rids[name], "origin": "gw-origin", "pred": 5.0}
        await handoff.append(wid, meta, pack_tokens(prompts[name]), 5.0, 1000, 1.0, k)

    for name, k in carry.items():
        await append(name, k)
    await r.xreadgroup(GROUP, "gw-old", {keys.queue(wid): ">"}, count=100)  # read, then it died
    base = (await p.cache(None, epoch))["version"]
    lease = Lease(keys.owner_lease(wid), "gw-new", 3000, 1000)
    assert await acquire_leases(r, keys.fence_counter, [lease])
    own = OwnerDispatcher(wid, "gw-new", lease, store, p, shared_embedded_redis, epoch=lambda: epoch)
    own.start()
    try:
        await asyncio.wait_for(own._claimed_once.wait(), 15)
        await append("fresh", pack_keys(space, hashed("fresh")))  # read by the new owner's read loop
        want = {rids[x] for x in ("carried", "plain", "other", "fresh")}
        got: dict[str, str] = {}
        end = time.monotonic() + 15
        while time.monotonic() < end and set(got) != want:
            await lease.renew(r)
            replies = await r.xrange(keys.replies("gw-origin"))
            got = {f[b"rid"].decode(): f[b"status"].decode() for _, f in replies}
            await asyncio.sleep(0.1)
        assert got == dict.fromkeys(want, "ok"), got
        cached = set((await p.cache(base, epoch))["added"])
        assert set(decoy_keys) <= cached and not set(hashed("carried")) & cached  # sent as carried
        for name in ("plain", "other", "fresh"):
            assert set(hashed(name)) <= cached
    finally:
        await own.stop()
        await r.aclose()
