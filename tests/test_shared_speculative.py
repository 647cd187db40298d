"""Speculative cache entries shared through the owner (FLEXLB_SHARED_SPECULATIVE, issue 15 Deliver
3): the owner publishes every hand-off it reads for its worker, and every other replica's mirror
follows a prefix another replica just sent before the worker's cache reports it.

Pure checks of the record, the owner's publication and the follower against real Redis, and two
real gateway replicas with real Triton workers for the end-to-end route."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import numpy as np
import redis.asyncio as aioredis

from app.cache.follower import MirrorFollower
from app.cache.mirror import CacheMirror
from app.cache.shared_spec import SpecOutbox, parse_record
from app.cluster.leases import Lease, acquire_leases
from app.dispatch.owner import OwnerDispatcher
from app.protocol.blocks import block_keys, namespace_seed
from app.state.handoff import pack_keys, pack_tokens
from app.state.keys import Keys

from .conftest import handoff_rig
from .gateways import Gateway, start_gateway, wait_for


def test_outbox_packs_one_record_per_origin_and_parses_back() -> None:
    """Notes of several hand-offs become one XADD per origin (blocks deduplicated, capped stream);
    a record parses back to its origin, time and keys; malformed ones and notes without keys (an
    older origin's entry) publish nothing; a disabled outbox notes nothing."""
    out = SpecOutbox()
    out.note("gw-a", np.array([1, 2, 3], dtype="<u8"))
    out.note("gw-a", np.array([1, 2, 9], dtype="<u8"))
    out.note("gw-b", np.array([7], dtype="<u8"))
    out.note("gw-b", None)
    assert out and out.noted == 3
    cmds = out.take("s", 1234.0)
    assert not out and [c[:6] for c in cmds] == [["XADD", "s", "MAXLEN", "~", 512, "*"]] * 2
    recs = [
        parse_record(dict(zip(map(str.encode, c[6::2]), [_b(x) for x in c[7::2]], strict=True))) for c in cmds
    ]
    assert [(r.origin, r.at_ms, sorted(r.keys.tolist())) for r in recs if r] == [
        ("gw-a", 1234.0, [1, 2, 3, 9]),
        ("gw-b", 1234.0, [7]),
    ]
    assert parse_record({b"o": b"x", b"t": b"1", b"keys": b"\0" * 7}) is None
    assert parse_record({b"o": b"x", b"keys": b""}) is None
    off = SpecOutbox(enabled=False)
    off.note("gw-a", np.array([1], dtype="<u8"))
    assert not off and off.take("s", 0.0) == []


def _b(x: object) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


async def test_follower_adds_other_replicas_records_and_skips_its_own_and_stale_ones(
    redis_url: str, cluster: str
) -> None:
    """On real Redis: the follower reads the worker's spec stream in its diff XREAD and adds another
    replica's blocks with the TTL counted from the owner's read; its own records (it has them) and
    records older than the TTL (a replay after start) are skipped; off, it reads none."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    wid = "prefill@127.0.0.1:1"
    now = time.time() * 1000
    try:
        for origin, at, ks in (("gw-b", now - 500, [11, 12]), ("me", now, [21]), ("gw-c", now - 5000, [31])):
            out = SpecOutbox()
            out.note(origin, np.array(ks, dtype="<u8"))
            for cmd in out.take(keys.spec_stream(wid), at):
                await r.execute_command(*cmd)
        for shared in (True, False):
            mirror = CacheMirror(speculative_ttl_ms=2000)
            f = MirrorFollower(
                r, keys, mirror, lambda: [wid], block_ms=50, replica_id="me", share_speculative=shared
            )
            await f.step()
            t = time.time() * 1000
            got = {k: (mirror.spec.get(k) or {}).get(wid) for k in (11, 12, 21, 31)}
            if not shared:
                assert got == dict.fromkeys(got) and f.spec_applied == 0
                continue
            assert f.spec_applied == 1 and got[21] is None and got[31] is None
            assert got[11] == got[12] == round(now - 500) + 2000  # the TTL runs from the owner's read
            assert mirror.match([11, 12, 13], [wid, "other"], t) == {wid: 2, "other": 0}
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()


async def test_owner_publishes_each_read_handoffs_blocks_on_its_next_read(
    clients, shared_embedded_redis
) -> None:
    """A real owner reads two hand-offs (origins A and B, carried keys) and writes their blocks to
    the worker's spec stream in the pipeline of its next queue read: one record per origin, the
    keys the origin routed on, counted among the owner's Redis commands (one XADD per record, no
    round trip of its own). Off (`share_speculative=False`), nothing is written."""
    p = clients["prefill"][0]
    await p.configure(formula="5")
    epoch = (await p.status())["epoch"]
    d = await p.describe()
    bs = int(d["block_size"])
    space = namespace_seed(str(d["model_name"]), str(d["tokenizer"]), bs)
    for shared in (True, False):
        keys, wid, r, store, handoff = await handoff_rig(shared_embedded_redis, "t-sspec", p.address)
        lease = Lease(keys.owner_lease(wid), "gw-own", 3000, 1000)
        assert await acquire_leases(r, keys.fence_counter, [lease])
        own = OwnerDispatcher(
            wid,
            "gw-own",
            lease,
            store,
            p,
            shared_embedded_redis,
            epoch=lambda: epoch,
            share_speculative=shared,
        )
        own.start()
        want: dict[str, list[int]] = {}
        try:
            await asyncio.wait_for(own._claimed_once.wait(), 15)
            for origin, seed in (("gw-a", 1), ("gw-b", 2)):
                prompt = np.random.default_rng(seed).integers(32, 127, size=bs * 3 + 5, dtype=np.int32)
                ks = block_keys(prompt, bs, model=d["model_name"], tokenizer=d["tokenizer"])
                want[origin] = ks
                meta = {"rid": f"ss-{uuid.uuid4().hex[:6]}", "origin": origin, "pred": 5.0}
                await handoff.append(wid, meta, pack_tokens(prompt), 5.0, 1000, 1.0, pack_keys(space, ks))
            end = time.monotonic() + 15
            while time.monotonic() < end:  # both answered: both read, and at least one read since
                await lease.renew(r)
                answered = [await r.xlen(keys.replies(o)) for o in want]
                if all(answered) and own.spec_out.noted == 2 * shared:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # > one BLOCK 100 read: the last notes went out with it
            recs = [parse_record(f) for _, f in await r.xrange(keys.spec_stream(wid))]
            got = {rec.origin: sorted(rec.keys.tolist()) for rec in recs if rec}
            if shared:
                assert got == {o: sorted(ks) for o, ks in want.items()}
            else:
                assert got == {} and own.spec_out.noted == 0
        finally:
            await own.stop()
            left = await r.keys(f"{keys.prefix}*")
            if left:
                await r.delete(*left)
            await r.aclose()


def test_a_replica_routes_a_prefix_another_replica_just_handed_off_to_the_same_worker(
    workers_reset, shared_embedded_redis, tmp_path
) -> None:
    """Replica A sends prompts that land on both prefill workers. The workers' caches are not
    polled again (30 s poll), so no replica's mirror confirms them; B has never routed them. With
    the owners publishing A's hand-offs, B sends each follow-up (same prefix) to the worker A chose,
    and the worker serves it from cache. Without the feature B's mirror knows nothing of these
    prefixes, both workers look alike, and B's picks fall where its draws put them (6 follow-ups
    all on the right worker by chance: 1 in 64). Real replicas, Redis and Triton workers."""
    pool = workers_reset
    p1, p2 = pool["prefill"]
    d = pool["decode"][0]
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    spec = f"prefill@{p1.address},prefill@{p2.address},decode@{d.address}"
    env = {
        "FLEXLB_POLL_INTERVAL_MS": "30000",  # each worker is polled once, at its owner's start
        "FLEXLB_SPECULATIVE_TTL_MS": "60000",  # no entry expires on a slow box
    }
    # One after the other: B's first look at the worker snapshots must come after A's owners wrote
    # them (B started alongside A can read them empty and wait a whole 30 s poll to look again).
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec, **env)
    gws = [a]
    try:
        wait_for(lambda: a.readyz()["ready"], 60, what="A ready")
        gws.append(start_gateway(tmp_path, shared_embedded_redis, cluster, spec, **env))
    except BaseException:
        a.stop()
        raise
    b = gws[1]

    def settled() -> bool:
        """Both ready and every worker owned (leases are sticky: no owner starts later and
        publishes a first cache poll that holds our prompts)."""
        states = [g.readyz() for g in gws]
        owned = {w for s in states for w in s["owned"]}
        return all(s["ready"] for s in states) and owned == set(spec.split(","))

    def applied(g: Gateway) -> float:
        text = g.get("/metrics").text
        line = 'flexlb_shared_speculative_records_total{event="applied"}'
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

    def send(g: Gateway, text: str) -> dict:
        resp = g.post("/v1/generate", json={"prompt": text, "max_new_tokens": 2})
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    try:
        wait_for(settled, 60, what="both replicas ready with settled leases")
        rnd = random.Random(5)
        held: dict[str, str] = {}  # prompt → the worker A sent it to
        for _ in range(40):
            if len(held) >= 6 and len(set(held.values())) == 2:
                break
            text = "".join(rnd.choice("abcdefghij ") for _ in range(1500))
            held[text] = send(a, text)["prefill_worker"]
        assert len(set(held.values())) == 2, held  # both workers hold some: B cannot guess
        wait_for(lambda: applied(b) >= len(held), 30, what="B applied A's hand-offs")
        assert applied(a) == 0  # its own records: skipped, it has them
        for text, worker in held.items():
            got = send(b, text + " and a follow-up")
            assert got["prefill_worker"] == worker, (text[:20], got["prefill_worker"], worker)
            assert got["cached_tokens"] >= 1024  # the prefix really was on that worker
    finally:
        for g in gws:
            g.stop()
