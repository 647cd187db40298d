"""Power of two choices on live load at hand-off time (FLEXLB_FRESH_PICK, issue 15 Deliver 3): the
hand-off script weighs the policy's pick against its runner-up on both workers' queued and owed
ms as Redis holds them now, in the origin's one round trip.

Against real Redis (both flavours) for the script, and real replicas, Redis and Triton workers for
the end-to-end check that a load the replica's snapshot has not seen yet moves the request."""

from __future__ import annotations

import random
import threading
import time
import uuid

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from app.request.routing_inputs import LOAD_SLOPE, FreshPair, fresh_pair
from app.scheduling.admission import pick_within
from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, compile_formula
from app.scheduling.plugins import registry
from app.scheduling.plugins.registry import BuildContext, Candidates
from app.scheduling.policy import PolicyBook
from app.scheduling.routing import PREFILL, Choice, PrefillQuery, WorkerView
from app.state.keys import Keys
from app.state.store import StateStore

from .gateways import Gateway, start_gateway, wait_for


def _view(wid: str, queued: float = 0.0, owed: float = 0.0) -> WorkerView:
    return WorkerView(
        id=wid,
        role=PREFILL,
        up=True,
        kv_total_tokens=1_000_000,
        kv_free_tokens=1_000_000,
        kv_evictable_tokens=0,
        queue_len=0,
        queued_ms=queued,
        owed_ms=owed,
        reserved_tokens=0,
        running=0,
    )


def test_fresh_pair_ranks_as_the_policys_second_look() -> None:
    """The pair's lines in (queued, owed) decide as `Policy.second_look` does with the same fresh
    loads, for the default `cost` policy (cache-aware, near-tie band) and `least_load`: the script
    and the simulator's twin agree on who goes."""
    formula = compile_formula(DEFAULT_PREFILL_FORMULA)
    book = PolicyBook()
    rnd = random.Random(7)
    agree = moved = 0
    for name in ("cost", "least_load"):
        policy = book.build(PREFILL, name, formula)
        for trial in range(300):
            views = [_view(f"p{i}", rnd.uniform(0, 400), rnd.uniform(0, 400)) for i in range(4)]
            hits = {f"p{i}": rnd.choice([0, 0, 4, 16]) for i in range(4)}
            q = PrefillQuery(rnd.randint(256, 2048), hits, 64)
            seed = 1000 + trial
            first = policy.choose(q, views, random.Random(seed))
            pair = fresh_pair(policy, q, views, first, random.Random(seed))
            assert pair is not None
            live = {v.id: (rnd.uniform(0, 600), rnd.uniform(0, 600)) for v in views}
            loads = (live[pair.first.worker_id], live[pair.alt.worker_id])
            mine = pair.choice(pair.decide(loads)).worker_id
            twin = policy.second_look(q, views, first, live.__getitem__, random.Random(seed))
            # A near-tie is drawn in both; only the band's verdict must agree then.
            if twin.reason != "near_tie":
                assert mine == twin.worker_id, (name, trial, pair, loads)
                agree += 1
            moved += mine != first.worker_id
    assert agree > 400 and moved > 50, (agree, moved)


def test_each_scorer_moves_with_live_load_by_its_listed_slope() -> None:
    """`LOAD_SLOPE` is what the hand-off script's lines rest on: each listed scorer's score moves
    by exactly its slope per ms queued and per ms owed, at any load and hit."""
    formula = compile_formula(DEFAULT_PREFILL_FORMULA)
    ctx = BuildContext(formula, PREFILL)
    rnd = random.Random(11)
    for name, slope in LOAD_SLOPE.items():
        scorer = registry.build("scorer", name, ctx, {})
        for _ in range(20):
            q = PrefillQuery(rnd.randint(64, 4096), {}, 64)
            base = _view("w", rnd.uniform(0, 500), rnd.uniform(0, 500))
            hits = [rnd.choice([0, 64, 640])]
            s0 = scorer.score(q, Candidates([base], hits))[0]
            for dq, do in ((7.5, 0.0), (0.0, 3.25)):
                moved = _view("w", base.queued_ms + dq, base.owed_ms + do)
                s1 = scorer.score(q, Candidates([moved], hits))[0]
                assert s1 - s0 == pytest.approx(slope * (dq + do)), (name, dq, do)


def test_fresh_pair_is_none_for_a_load_blind_policy() -> None:
    policy = PolicyBook().build(PREFILL, "round_robin", compile_formula(DEFAULT_PREFILL_FORMULA))
    views = [_view("a"), _view("b")]
    q = PrefillQuery(100, {}, 64)
    first = policy.choose(q, views, random.Random(1))
    assert fresh_pair(policy, q, views, first, random.Random(1)) is None


async def test_handoff_pick_script_decides_as_fresh_pair(redis_url: str, cluster: str) -> None:
    """`HANDOFF_PICK` on real Redis: reads both workers' live queued ms and ledgers, goes where
    `FreshPair.decide` says, adds the winner's prediction to its queued ms only, names the
    runner-up in the request record when it wins, and skips a full queue."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    a, b = "prefill@127.0.0.1:1", "prefill@127.0.0.1:2"
    rnd = random.Random(3)
    try:
        for lease in (a, b):
            await r.set(keys.owner_lease(lease), "O|1", px=60_000)
        wins = [0, 0]
        for i in range(40):
            qa, qb = rnd.uniform(0, 300), rnd.uniform(0, 300)
            oa, ob = rnd.choice([0.0, rnd.uniform(0, 300)]), rnd.choice([0.0, rnd.uniform(0, 300)])
            await r.set(keys.queued_ms(a), f"{qa:.6f}")
            await r.set(keys.queued_ms(b), f"{qb:.6f}")
            await r.delete(keys.ledger(a), keys.ledger(b))
            far = time.time() * 1000 + 600_000  # not started: the whole prediction is owed
            if oa:
                await st.commit_batch(a, f"ba{i}", ["x"], oa, far, 1, "O")
            if ob:
                await st.commit_batch(b, f"bb{i}", ["y"], ob, far, 1, "O")
            pair = FreshPair(
                Choice(a, hit_tokens=64, predicted_ms=10.0),
                Choice(b, predicted_ms=30.0),
                # half the cases with the hinge a budget scorer adds (cost's predicted_late_ms)
                (
                    (-10.0 - 64.0, -0.25, -0.25, hw := rnd.choice([0.0, -0.75]), rnd.uniform(-500, 100)),
                    (-30.0, -0.25, -0.25, hw, rnd.uniform(-500, 100)),
                ),
                -1.0,
                0.1,
                20.0,
                rnd.randint(0, 1),
            )
            want = pair.decide(((qa, oa), (qb, ob)))
            rid = f"r{i}"
            await r.hset(keys.request(rid), mapping={"state": "queued", "prefill_worker": a})
            (t0, cq0, co0, hw0, hc0), (t1, cq1, co1, hw1, hc1) = pair.terms
            ks = [keys.queue(a), keys.queued_ms(a), keys.ledger(a), keys.queue(b), keys.queued_ms(b)]
            terms = [repr(x) for x in (t0, cq0, co0, t1, cq1, co1, -1.0, 0.1, 20.0)]
            hinges = [repr(x) for x in (hw0, hc0, hw1, hc1)]
            res = await st.run_script(
                "handoff_pick",
                [*ks, keys.ledger(b), keys.request(rid)],
                [100, b"ids", "{}", "{}", "10.0", "30.0", "1", "1", *terms, pair.winner + 1, b, b"", *hinges],
            )
            got = int(res[3]) - 1
            assert got == want, (i, qa, oa, qb, ob, pair.winner)
            wins[got] += 1
            qa_after, qb_after = float(await r.get(keys.queued_ms(a))), float(await r.get(keys.queued_ms(b)))
            assert (qa_after, qb_after) == pytest.approx((qa + 10.0, qb) if got == 0 else (qa, qb + 30.0))
            assert [float(x) for x in res[4:8]] == pytest.approx([qa_after, oa, qb_after, ob], abs=0.01)
            rec = (await r.hget(keys.request(rid), "prefill_worker")).decode()
            assert rec == (a if got == 0 else b)
            await r.delete(keys.queue(a), keys.queue(b))
        assert min(wins) >= 5, wins  # both sides were exercised
        # a full queue is no candidate, whatever the ranking says; both full: refused (-1)
        await r.delete(keys.queue(a), keys.queue(b))
        await r.xadd(keys.queue(a), {"m": "{}"})
        args = _plain_pick_args(b)
        ks = [keys.queue(a), keys.queued_ms(a), keys.ledger(a), keys.queue(b), keys.queued_ms(b)]
        ks += [keys.ledger(b), keys.request("none")]
        res = await st.run_script("handoff_pick", ks, args)
        assert int(res[3]) == 2 and res[0] != b"-1"
        assert not await r.exists(keys.request("none"))  # no record: none is created
        res = await st.run_script("handoff_pick", ks, args)
        assert int(res[0]) == -1
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()


async def test_handoff_pick_holds_each_candidate_to_its_own_max_backlog(redis_url: str, cluster: str) -> None:
    """`HANDOFF_PICK` with `max_backlog_a` / `_b` (each candidate's own allowance: their predicted
    prefills differ) decides as `admission.pick_within` after `FreshPair.decide`: the ranking's
    winner within its allowance; else the other within its own; else -2 with the winner's load
    and nothing written. The simulator calls the same `pick_within`."""
    r = aioredis.from_url(redis_url)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    await st.load_scripts()
    a, b = "prefill@127.0.0.1:1", "prefill@127.0.0.1:2"
    rnd = random.Random(5)
    outcomes = set()
    try:
        for i in range(60):
            qa, qb = rnd.uniform(0, 1000), rnd.uniform(0, 1000)
            la, lb = rnd.uniform(0, 1000), rnd.uniform(0, 1000)
            await r.set(keys.queued_ms(a), f"{qa:.6f}")
            await r.set(keys.queued_ms(b), f"{qb:.6f}")
            pair = FreshPair(
                Choice(a, predicted_ms=10.0),
                Choice(b, predicted_ms=30.0),
                ((-10.0, -0.25, -0.25, 0.0, 0.0), (-30.0, -0.25, -0.25, 0.0, 0.0)),
                -1.0,
                0.1,
                20.0,
                rnd.randint(0, 1),
            )
            ranked = pair.decide(((qa, 0.0), (qb, 0.0)))
            want = pick_within(ranked, (qa, qb), (la, lb), (False, False))
            outcomes.add(want)
            rid = f"m{i}"
            (t0, cq0, co0, hw0, hc0), (t1, cq1, co1, hw1, hc1) = pair.terms
            ks = [keys.queue(a), keys.queued_ms(a), keys.ledger(a), keys.queue(b), keys.queued_ms(b)]
            terms = [repr(x) for x in (t0, cq0, co0, t1, cq1, co1, -1.0, 0.1, 20.0)]
            hinges = [repr(x) for x in (hw0, hc0, hw1, hc1)]
            args = [
                100,
                b"ids",
                "{}",
                "{}",
                "10.0",
                "30.0",
                "1",
                "1",
                *terms,
                pair.winner + 1,
                b,
                b"",
                *hinges,
            ]
            args += ["", "", "", "", "", repr(la), repr(lb)]
            res = await st.run_script("handoff_pick", [*ks, keys.ledger(b), keys.request(rid)], args)
            qa_after, qb_after = float(await r.get(keys.queued_ms(a))), float(await r.get(keys.queued_ms(b)))
            if want is None:
                assert res[0] == -2 and int(res[3]) - 1 == ranked, (i, qa, qb, la, lb)
                assert float(res[1]) == pytest.approx((qa, qb)[ranked], abs=1e-6)
                assert (qa_after, qb_after) == pytest.approx((qa, qb))
                assert await r.xlen(keys.queue(a)) == 0 and await r.xlen(keys.queue(b)) == 0
            else:
                assert res[0] != -2 and int(res[3]) - 1 == want, (i, qa, qb, la, lb, ranked)
                assert (qa_after, qb_after) == pytest.approx(
                    (qa + 10.0, qb) if want == 0 else (qa, qb + 30.0)
                )
            await r.delete(keys.queue(a), keys.queue(b))
        assert outcomes == {0, 1, None}, outcomes  # each answer was exercised
        # the winner over its allowance and the other full: refused, not queued past the bound
        await r.set(keys.queued_ms(a), "900")
        await r.set(keys.queued_ms(b), "0")
        await r.xadd(keys.queue(b), {"m": "{}"})
        ks = [keys.queue(a), keys.queued_ms(a), keys.ledger(a), keys.queue(b), keys.queued_ms(b)]
        args = _plain_pick_args(b)
        args += [b"", "0", "0", "0", "0", "", "", "", "", "", "500", "500"]
        res = await st.run_script("handoff_pick", [*ks, keys.ledger(b), keys.request("x")], args)
        assert res[0] == -2 and int(res[3]) == 1 and await r.xlen(keys.queue(a)) == 0
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()


# The load replica A's view has not seen: replica B's real batch, held in flight on the holder by a
# slow engine formula. Its owed time is what the gateway's formula predicts for it: 40,000 uncached
# tokens ≈ 2,000 ms, past the `cost` policy's 1 s budget, where a holder gives its prefix up against
# a backlog of 3x the saving (~40 ms here). Both prefill workers run a 100x slower clock (set before
# the replicas start, so the one snapshot A takes carries it), so that owed time ages 10 modelled ms
# a wall second: the window outlives the test's steps on a loaded box by minutes.
FRESH_SCALE = 100.0
FRESH_TAIL = "t" * 40_000  # byte tokenizer: 40,000 tokens the holder has not cached
FRESH_HOLD_FORMULA = "2000"  # the holder's engine time for B's batch: 200 s of wall clock at scale


@pytest.mark.parametrize("fresh", [False, True], ids=["snapshot", "fresh"])
def test_fresh_load_another_replica_committed_moves_the_request(
    fresh: bool, workers_reset, shared_embedded_redis, tmp_path
) -> None:
    """A follow-up prompt whose prefix replica A just sent to worker H goes to H on A's view (H
    looks idle and holds the prefix). Then replica B sends a long prompt with that prefix: it lands
    on H too (the owner shares each hand-off's prefix with every mirror) and its batch, committed
    into H's ledger by H's owner, stays in flight (H's engine is made slow for it). A's snapshot
    has not seen it (one poll at start-up, the next 30 s later): with the fresh pick A's hand-off
    reads H's live owed time and the request goes to the other worker; on the snapshot alone it
    still goes to H. Real replicas, Redis and Triton workers; nothing is written by the test.
    `workers_reset` puts the pool back, pass or fail."""
    from .conftest import worker_call

    pool = workers_reset
    p1, p2 = pool["prefill"]
    d = pool["decode"][0]
    for w in (p1, p2):
        assert worker_call(w.address, "configure", time_scale=FRESH_SCALE).get("ok")
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    spec = f"prefill@{p1.address},prefill@{p2.address},decode@{d.address}"
    env = {
        "FLEXLB_POLL_INTERVAL_MS": "30000",  # the snapshot stays as it was at start
        "FLEXLB_SPECULATIVE_TTL_MS": "60000",  # the just-routed prefix stays in the mirrors
        "FLEXLB_FRESH_PICK": "1" if fresh else "0",
    }
    a = start_gateway(tmp_path, shared_embedded_redis, cluster, spec, **env)
    # B joins later: the owner leases are sticky, so A owns (and alone polls) every worker
    b = start_gateway(tmp_path, shared_embedded_redis, cluster, **{**env, "FLEXLB_FRESH_PICK": "1"})
    keys = Keys(cluster)
    r = redis.Redis.from_url(shared_embedded_redis)
    b_id = f"b-{cluster}"
    out: dict[str, httpx.Response | httpx.TransportError] = {}

    def post(gw: Gateway, name: str, body: dict) -> None:
        try:
            out[name] = httpx.post(gw.url + "/v1/generate", json=body, timeout=120)
        except httpx.TransportError as exc:  # the gateway stopped under it: a failed test's cleanup
            out[name] = exc

    def send(text: str) -> dict:
        resp = httpx.post(a.url + "/v1/generate", json={"prompt": text, "max_new_tokens": 2}, timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    prompt = "fresh pick prefix " * 80
    b_body = {"prompt": prompt + FRESH_TAIL, "max_new_tokens": 2, "request_id": b_id}
    a_body = {"prompt": prompt + " once more", "max_new_tokens": 2}
    b_th = threading.Thread(target=post, args=(b, "b", b_body), daemon=True)
    a_th = threading.Thread(target=post, args=(a, "a", a_body), daemon=True)
    try:
        wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 60, what="ready")
        leases = a.get("/admin/leases", admin=True).json()["owners"]
        assert {(o or {}).get("holder") for o in leases.values()} == {a.replica_id}, leases
        holder = send(prompt)["prefill_worker"]
        assert send(prompt + " again")["prefill_worker"] == holder  # the cached prefix draws it
        other = next(w for w in (f"prefill@{p1.address}", f"prefill@{p2.address}") if w != holder)
        assert worker_call(holder.split("@", 1)[1], "configure", formula=FRESH_HOLD_FORMULA).get("ok")

        b_th.start()  # B's request: committed into H's ledger by A (H's owner), then held running
        wait_for(
            lambda: any(b_id in v.decode() for v in r.hvals(keys.ledger(holder))),
            30,
            what="B's batch in the holder's ledger",
        )
        assert r.hget(keys.request(b_id), "prefill_worker") == holder.encode()
        snap = a.get("/admin/workers", admin=True).json()["workers"][holder]["snapshot"]
        assert float(snap.get("owed_ms", 0) or 0) == 0.0, snap  # A's view has not seen it

        a_th.start()

        def a_placed() -> bool:
            """A's request (no client id: only a fresh id takes the fresh pick) has been handed off:
            answered, or waiting on the holder behind B's batch (queued or committed there)."""
            if "a" in out:
                return True
            queued = float(r.get(keys.queued_ms(holder)) or 0)
            return queued > 0 or any(b_id not in v.decode() for v in r.hvals(keys.ledger(holder)))

        wait_for(a_placed, 30, what="A's request placed")
        # B's batch was still owed when A picked (a box too slow for the window fails here, not below)
        assert any(b_id in v.decode() for v in r.hvals(keys.ledger(holder))), "B's batch settled early"
        # End both for real: the holder fast again (A's request may wait there), B's cancelled.
        assert worker_call(holder.split("@", 1)[1], "configure", formula="1").get("ok")
        assert b.delete(f"/v1/requests/{b_id}").status_code == 202
        b_th.join(60)
        a_th.join(60)
        ended_b, ended_a = out.get("b"), out.get("a")
        assert isinstance(ended_b, httpx.Response) and ended_b.status_code == 499, ended_b
        assert isinstance(ended_a, httpx.Response) and ended_a.status_code == 200, ended_a
        went = ended_a.json()["prefill_worker"]
        if fresh:
            assert went == other, "the live owed time must move the request off the busy holder"
        else:
            assert went == holder, "on the stale snapshot the holder still looks best"
        wait_for(lambda: not r.hlen(keys.ledger(holder)), 30, what="the holder's ledger settled")
    finally:
        a.stop()
        b.stop()
        for th in (a_th, b_th):
            if th.is_alive():  # their client calls end with the gateways
                th.join(30)
        r.close()


async def test_handoff_pick_rides_in_a_limited_tenants_gate(shared_embedded_redis: str, cluster: str) -> None:
    """A limited tenant's round trip runs inside the limit's `GATE` script (app/security/
    ratelimit.py): the fresh pick folds into it like the plain hand-off, still one command, and
    answers as alone (here the runner-up, idle, against a busy pick; the record names it)."""
    from app.security.apikeys import Limits
    from app.security.ratelimit import GATE, Limiter

    r = aioredis.from_url(shared_embedded_redis)
    keys = Keys(cluster)
    st = StateStore(r, keys)
    a, b, rid = "prefill@127.0.0.1:1", "prefill@127.0.0.1:2", "g1"
    try:
        await st.load_scripts()
        await r.script_load(GATE)  # loaded, as after a first call (a NOSCRIPT costs a load and a rerun)
        await r.set(keys.queued_ms(a), "500.000000")  # busy now, whatever the snapshot said
        ks = [
            keys.queue(a),
            keys.queued_ms(a),
            keys.ledger(a),
            keys.queue(b),
            keys.queued_ms(b),
            keys.ledger(b),
        ]
        # cost-like lines: u = -(10 + queued + owed) on A, -(30 + queued + owed) on B; no tie band
        terms = ["-10.0", "-1.0", "-1.0", "-30.0", "-1.0", "-1.0", "-1.0", "0.0", "0.0"]
        args = [100, b"ids", "{}", "{}", "10.0", "30.0", "1", "1", *terms, 1, b]
        trip = [
            ["EVALSHA", st.sha("create_request"), 1, keys.request(rid), "o", "prefill_worker", a],
            ["EVALSHA", st.sha("handoff_pick"), 7, *ks, keys.request(rid), *args],
        ]
        n0 = st.commands_total
        v, res = await Limiter(st, cluster).run("t", Limits(rps=5), rid, 8, 60_000, trip)
        assert v.allowed and st.commands_total - n0 == 1
        assert res[0] == 1 and int(res[1][3]) == 2, res  # B: 30 + 0 beats 10 + 500
        assert float(await r.get(keys.queued_ms(b))) == 30.0 and await r.xlen(keys.queue(a)) == 0
        assert (await r.hget(keys.request(rid), "prefill_worker")).decode() == b
    finally:
        left = await r.keys(f"{cluster}*")
        if left:
            await r.delete(*left)
        await r.aclose()


def _plain_pick_args(b: str) -> list[object]:
    """`HANDOFF_PICK`'s arguments up to the worker id of B, for a pick with no utilities, no
    preference between the two, nothing cached and one-entry queue bounds."""
    return [1, b"ids", "{}", "{}", "1", "1", "1", "1", "0", "0", "0", "-1000", "0", "0", "-1", "0", "0", 1, b]
