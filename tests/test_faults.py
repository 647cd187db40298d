"""The chaos suite (issue 14, Deliver 5): real Redis, real Triton workers, two gateway replicas,
mixed streaming and non-streaming load on both; one fault per case. After every case, within a
few seconds of the last reply: no non-terminal record, decode hold, ledger entry, queue entry or
queued time is left, and a fresh batch of 20 requests all succeed (tests/chaos.py).

Cases are short (3-8 s of load each, ~20 s with start-up) to fit the suite's time budget; the faults are real
(SIGKILL, a Redis killed and restarted from its AOF, connections reset on the wire by a proxy in
front of the real Redis — tests/faultproxy.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from app.cluster.rendezvous import assign
from app.state.embedded_redis import find_redis_server
from app.state.keys import Keys
from app.state.redis_ha import RedisHA

from .chaos import Load, assert_clean, fresh_batch, summary
from .conftest import finished_records, record_mark, start_worker, worker_call
from .faultproxy import FaultProxy
from .gateways import Gateway, free_port, start_gateway, wait_for

GW_ENV = {"FLEXLB_RECONCILE_INTERVAL_MS": "500", "FLEXLB_RECONCILE_FORGET_S": "8"}


def report(results, t_fault: float) -> None:  # type: ignore[no-untyped-def]
    """One line of the fault-suite table (case, sent, ok, typed, hung, lost, recovery s; shown
    with -s). Recovery: when the last request that did not succeed ended, in s after the fault
    (0 when every request succeeded); every request after it succeeded."""
    import inspect

    case = inspect.stack()[1].function.split("_")[1]
    codes = Counter(x.code for x in results if x.kind == "typed")
    bad = [x.t1 or x.t0 for x in results if x.kind != "ok"]
    recovery = max(0.0, max(bad) - t_fault) if bad else 0.0
    print(f"\n[chaos] {case}: {summary(results)} recovery_s {recovery:.1f} typed codes {dict(codes)}")


def wait_ready(g: Gateway, timeout: float) -> None:
    try:
        wait_for(lambda: g.readyz()["ready"], timeout, what=f"{g.replica_id} ready")
    except AssertionError:
        raise AssertionError(f"{g.replica_id} not ready: {g.readyz()}") from None


def wid(w) -> str:  # type: ignore[no-untyped-def]
    return f"{w.role}@{w.address}"


def start_two(  # type: ignore[no-untyped-def]
    tmp: Path, redis_url: str, cluster: str, wids: list[str], accept=None, via=None, **env: str
) -> tuple[Gateway, Gateway]:
    """Two replicas, live before the workers are registered, so each takes what rendezvous hashing
    assigns it; `accept(owners, a, b)` picks replica ids that give the case its ownership."""
    ids = ("gw-a0", "gw-b0")
    for i in range(10_000):
        cand = (f"gw-a{i}", f"gw-b{i}")
        own = assign(wids, list(cand))
        if accept is None or accept(own, *cand):
            ids = cand
            break
    with ThreadPoolExecutor(2) as ex:
        futs = [
            ex.submit(start_gateway, tmp, redis_url, cluster, FLEXLB_REPLICA_ID=rid, **{**GW_ENV, **env})
            for rid in ids
        ]
    gws = [f.result() for f in futs]
    a, b = gws
    wait_for(lambda: len(a.get("/admin/leases", admin=True).json()["live_replicas"]) == 2, 60, what="2 live")
    assert a.post("/admin/workers", admin=True, json={"workers": ",".join(wids)}).status_code == 200
    r = via or redis.Redis.from_url(redis_url)  # `via`: a plain client when the URL is Sentinel's
    keys = Keys(cluster)
    want = assign(wids, list(ids))

    def owned() -> bool:
        vals = {w: r.get(keys.owner_lease(w)) for w in wids}
        return all(v is not None and v.decode().rsplit("|", 1)[0] == want[w] for w, v in vals.items())

    wait_for(owned, 15, what="leases as rendezvous assigns them")
    wait_for(lambda: a.readyz()["ready"] and b.readyz()["ready"], 15, what="both ready")
    r.close()
    return a, b


def slow_prefill(pool, formula: str = "40") -> None:  # type: ignore[no-untyped-def]
    for w in pool["prefill"]:
        assert worker_call(w.address, "configure", formula=formula)["ok"]


def finish(r: redis.Redis, keys: Keys, prefill: list[str], urls: list[str]) -> dict[str, int]:
    try:
        assert_clean(r, keys, prefill, 6.0)
    except AssertionError as exc:  # say who holds what is left: the first thing to know
        raise AssertionError(f"{exc}; {queue_holders(r, keys, prefill)}") from None
    fresh = fresh_batch(urls)
    assert summary(fresh) == {"sent": 20, "ok": 20, "typed": 0, "hung": 0, "lost": 0}, fresh
    assert_clean(r, keys, prefill, 6.0)
    return summary(fresh)


def queue_holders(r: redis.Redis, keys: Keys, prefill: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for w in prefill:
        try:
            pend = r.xpending_range(keys.queue(w), "owner", "-", "+", 5)
        except redis.ResponseError:  # no stream or group
            continue
        if pend:
            out[w] = {"lease": r.get(keys.owner_lease(w)), "pending": pend}
    return out


# ---- case 1 -------------------------------------------------------------------------------------
def test_case1_sigkill_of_an_owner_replica_loses_none_of_the_survivors_requests(
    workers_reset, shared_embedded_redis, tmp_path
) -> None:
    pool = workers_reset
    p0, p1, d = wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0])
    cluster = f"t-f1-{uuid.uuid4().hex[:6]}"
    # B owns a prefill worker: A's requests queued there must survive B's death
    a, b = start_two(tmp_path, shared_embedded_redis, cluster, [p0, p1, d], lambda own, a, b: own[p0] == b)
    r, keys = redis.Redis.from_url(shared_embedded_redis), Keys(cluster)
    try:
        slow_prefill(pool)
        alive = [a.url, b.url]
        load = Load(lambda: list(alive)).start()
        time.sleep(2)
        alive.remove(b.url)
        b.kill()
        t_fault = time.monotonic()
        time.sleep(5)
        results = load.stop()
        report(results, t_fault)
        on_a = [x for x in results if x.gw == a.url]
        on_b = [x for x in results if x.gw == b.url]
        bad = [x for x in on_a if x.kind != "ok"]
        assert not bad, (summary(on_a), bad[:5])
        assert not [x for x in on_b if x.kind == "hung"]
        assert len(on_a) >= 60
        # the dead replica's requests were ended by the reconciler, its leftovers deleted
        for x in on_b:
            if x.kind != "ok":
                st = r.hget(keys.request(x.rid), "state")
                assert st is None or st.decode() in ("owner_lost", "completed", "failed", "cancelled"), st
        finish(r, keys, [p0, p1], [a.url])

        # Its reply stream, live set and group consumers go in one step, once it has been dead
        # FLEXLB_RECONCILE_FORGET_S with nothing of it pending. Awaited together: the stream may
        # never have existed (an origin that owns the workers it hands off to is answered in
        # process, issue 20), and then it proves nothing as a clock for the forgetting.
        def forgotten() -> bool:
            gone = not r.exists(keys.replies(b.replica_id))
            return gone and not r.sismember(keys.replicas_seen, b.replica_id)

        wait_for(forgotten, 15, what="dead replica's reply stream gone and the replica forgotten")
        metrics = a.get("/metrics").text
        assert 'flexlb_loop_errors_total{loop="owner_decide"} 0.0' in metrics
    finally:
        b.kill()
        a.stop()
        r.close()


# ---- case 3 -------------------------------------------------------------------------------------
def test_case3_sigkill_of_a_prefill_worker_mid_batch_retries_or_types_every_request(
    workers_reset, shared_embedded_redis, tmp_path, worker_tmp
) -> None:
    pool = workers_reset
    own = start_worker("prefill", worker_tmp, "--profile", "formula", "--formula", "60")
    p0, px, d = wid(pool["prefill"][0]), wid(own), wid(pool["decode"][0])
    cluster = f"t-f3-{uuid.uuid4().hex[:6]}"
    # Round robin: the case is a worker dying mid-batch, so the doomed worker must get work whatever
    # the cache says (`cost` keeps the load's shared prefixes on the worker that holds them).
    a, b = start_two(
        tmp_path, shared_embedded_redis, cluster, [p0, px, d], FLEXLB_PREFILL_STRATEGY="round_robin"
    )
    r, keys = redis.Redis.from_url(shared_embedded_redis), Keys(cluster)
    try:
        slow_prefill(pool, "60")
        load = Load(lambda: [a.url, b.url]).start()

        def busy() -> bool:
            return bool(worker_call(own.address, "status")["live"])

        wait_for(busy, 10, what="a batch running on the doomed worker")
        own.kill_hard()
        t_fault = time.monotonic()
        time.sleep(4)
        results = load.stop()
        report(results, t_fault)
        s = summary(results)
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        typed = [x for x in results if x.kind == "typed"]
        assert all(x.code == "worker_error" for x in typed), typed[:5]
        assert len(typed) <= 10, s  # only batches the worker had accepted; the rest ran elsewhere
        assert s["ok"] >= s["sent"] - len(typed)
        finish(r, keys, [p0, px], [a.url, b.url])
    finally:
        own.kill_hard() if own.proc.poll() is None else None
        a.stop()
        b.stop()
        r.close()


# ---- case 4 -------------------------------------------------------------------------------------
def test_case4_sigkill_of_a_decode_worker_mid_stream_ends_streams_typed(
    workers_reset, shared_embedded_redis, tmp_path, worker_tmp
) -> None:
    pool = workers_reset
    own = start_worker("decode", worker_tmp, "--profile", "formula", "--formula", "1")
    p0, p1, d0, dx = (wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0]), wid(own))
    cluster = f"t-f4-{uuid.uuid4().hex[:6]}"
    a, b = start_two(tmp_path, shared_embedded_redis, cluster, [p0, p1, d0, dx])
    r, keys = redis.Redis.from_url(shared_embedded_redis), Keys(cluster)
    try:
        for addr in (pool["decode"][0].address, own.address):
            assert worker_call(addr, "configure", time_scale=3.0)["ok"]  # streams last a while
        load = Load(lambda: [a.url, b.url], max_new_tokens=(24, 48)).start()

        def streaming() -> bool:
            return any(worker_call(own.address, "status")["live"].values())

        wait_for(streaming, 10, what="streams running on the doomed decode worker")
        own.kill_hard()
        t_fault = time.monotonic()
        time.sleep(3)
        results = load.stop()
        report(results, t_fault)
        s = summary(results)
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        typed = [x for x in results if x.kind == "typed"]
        assert typed, "the kill hit no stream: the case proved nothing"
        assert all(x.code in ("worker_error", "overloaded") for x in typed), typed[:5]
        finish(r, keys, [p0, p1], [a.url, b.url])
    finally:
        own.kill_hard() if own.proc.poll() is None else None
        a.stop()
        b.stop()
        r.close()


# ---- case 7 -------------------------------------------------------------------------------------
def test_case7_one_percent_of_redis_traffic_reset_no_loop_dies_nothing_leaks(
    workers_reset, shared_embedded_redis, tmp_path
) -> None:
    pool = workers_reset
    p0, p1, d = wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0])
    cluster = f"t-f7-{uuid.uuid4().hex[:6]}"
    proxy = FaultProxy(shared_embedded_redis)
    a, b = start_two(tmp_path, proxy.url, cluster, [p0, p1, d])
    r, keys = redis.Redis.from_url(shared_embedded_redis), Keys(cluster)
    try:
        slow_prefill(pool, "20")
        load = Load(lambda: [a.url, b.url]).start()
        proxy.flaky(0.01)
        t_fault = time.monotonic()
        time.sleep(6)
        proxy.flaky(0.0)
        results = load.stop()
        report(results, t_fault)
        s = summary(results)
        assert proxy.resets > 0, "no fault was injected"
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        typed = [x for x in results if x.kind == "typed"]
        codes = {x.code for x in typed}
        assert codes <= {"state_unavailable", "worker_error"}, (
            codes,
            [x for x in typed if x.code not in ("state_unavailable", "worker_error")][:3],
        )
        for g in (a, b):  # no loop died, and every one is running again
            wait_ready(g, 10)
        finish(r, keys, [p0, p1], [a.url, b.url])
        for g in (a, b):
            assert "died" not in " ".join(g.readyz()["reasons"])
    finally:
        a.stop()
        b.stop()
        r.close()
        proxy.close()


# ---- case 5 -------------------------------------------------------------------------------------
class OwnRedis:
    """A redis-server of our own with an AOF (fsync always) we can SIGKILL and restart."""

    def __init__(self, tmp: Path) -> None:
        self.binary = find_redis_server()
        if self.binary is None:
            pytest.skip("no redis-server binary")
        self.port = free_port()
        self.dir = tmp / f"redis-{self.port}"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = redis.Redis.from_url(self.url)
        wait_for(lambda: _ping(r), 10, what="redis-server up")
        r.close()

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _ping(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False


def test_case5_redis_sigkill_and_restart_from_aof_ends_everything_and_recovers(
    workers_reset, tmp_path
) -> None:
    pool = workers_reset
    p0, p1, d = wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0])
    own = OwnRedis(tmp_path)
    cluster = f"t-f5-{uuid.uuid4().hex[:6]}"
    a, b = start_two(tmp_path, own.url, cluster, [p0, p1, d])
    keys = Keys(cluster)
    try:
        slow_prefill(pool, "20")
        load = Load(lambda: [a.url, b.url]).start()
        time.sleep(2)
        own.kill()
        t_fault = time.monotonic()
        time.sleep(0.5)
        own.start()
        t_back = time.monotonic()
        time.sleep(6)
        results = load.stop()
        report(results, t_fault)
        s = summary(results)
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        typed = [x for x in results if x.kind == "typed"]
        codes = {x.code for x in typed}
        assert codes <= {"state_unavailable", "worker_error"}, (
            codes,
            [x for x in typed if x.code not in ("state_unavailable", "worker_error")][:3],
        )
        # new requests succeed within 5 s of Redis being back
        late = [x for x in results if x.t0 > t_back + 5]
        assert late and all(x.kind == "ok" for x in late), summary(late)
        assert any(self_file.name.endswith(".aof") or self_file.is_dir() for self_file in own.dir.iterdir())
        r = redis.Redis.from_url(own.url)
        try:
            finish(r, keys, [p0, p1], [a.url, b.url])
        finally:
            r.close()
    finally:
        a.stop()
        b.stop()
        own.stop()


def test_case5b_redis_back_empty_is_rebuilt_and_no_request_hangs(workers_reset, tmp_path) -> None:
    pool = workers_reset
    p0, p1, d = wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0])
    own = OwnRedis(tmp_path)
    cluster = f"t-f5b-{uuid.uuid4().hex[:6]}"
    a, b = start_two(tmp_path, own.url, cluster, [p0, p1, d])
    keys = Keys(cluster)
    try:
        slow_prefill(pool, "20")
        load = Load(lambda: [a.url, b.url]).start()
        time.sleep(2)
        own.kill()
        t_fault = time.monotonic()
        for f in own.dir.rglob("*"):  # everything it had is gone
            if f.is_file():
                f.unlink()
        own.start()
        t_back = time.monotonic()
        time.sleep(7)
        results = load.stop()
        report(results, t_fault)
        s = summary(results)
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        late = [x for x in results if x.t0 > t_back + 5]
        assert late and all(x.kind == "ok" for x in late), summary(late)
        assert a.get("/metrics").status_code == 200
        r = redis.Redis.from_url(own.url)
        try:
            assert r.scard(keys.workers) == 3  # the registry was put back
            finish(r, keys, [p0, p1], [a.url, b.url])
        finally:
            r.close()
    finally:
        a.stop()
        b.stop()
        own.stop()


# ---- case 2 -------------------------------------------------------------------------------------
def test_case2_sigstop_past_the_leases_steps_down_runs_nothing_twice_and_keeps_completions(
    workers_reset, shared_embedded_redis, tmp_path
) -> None:
    pool = workers_reset
    p0, p1, d = wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0])
    cluster = f"t-f2-{uuid.uuid4().hex[:6]}"
    a, b = start_two(tmp_path, shared_embedded_redis, cluster, [p0, p1, d], lambda own, a, b: own[p0] == b)
    r, keys = redis.Redis.from_url(shared_embedded_redis), Keys(cluster)
    marks = {w.address: record_mark(w.address) for w in pool["prefill"]}  # this case's records only
    try:
        slow_prefill(pool)
        targets = [a.url, b.url]
        load = Load(lambda: list(targets)).start()
        time.sleep(2)
        targets.remove(b.url)
        os.kill(b.proc.pid, signal.SIGSTOP)
        t_fault = time.monotonic()
        time.sleep(4.5)  # longer than membership and lease TTLs (3 s): A takes over and reaps B
        os.kill(b.proc.pid, signal.SIGCONT)
        targets.append(b.url)
        time.sleep(2.5)
        results = load.stop()
        report(results, t_fault)
        s = summary(results)
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        on_a = [x for x in results if x.gw == a.url]
        assert all(x.kind == "ok" for x in on_a), summary(on_a)
        # what completed for its client is recorded completed, never owner_lost
        for x in results:
            if x.kind == "ok":
                assert r.hget(keys.request(x.rid), "state") == b"completed", x
        # nothing ran twice on a prefill engine
        for w in pool["prefill"]:
            recs = finished_records(w.address, marks[w.address])
            ran = Counter(f["request_id"] for f in recs if f["status"] == "ok")
            assert all(n == 1 for n in ran.values()), [k for k, n in ran.items() if n > 1]
        # the zombie stepped down before writing, and is back as a live, ready member
        assert "stepping down" in b.log() or "lapsed locally" in b.log()
        wait_ready(b, 10)
        assert sorted(a.get("/admin/leases", admin=True).json()["live_replicas"]) == sorted(
            [a.replica_id, b.replica_id]
        )
        finish(r, keys, [p0, p1], [a.url, b.url])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(b.proc.pid, signal.SIGCONT)
        a.stop()
        b.stop()
        r.close()


# ---- case 6 -------------------------------------------------------------------------------------
def test_case6_sentinel_failover_under_load_within_5_s_then_nothing_leaks(workers_reset, tmp_path) -> None:
    pool = workers_reset
    p0, p1, d = wid(pool["prefill"][0]), wid(pool["prefill"][1]), wid(pool["decode"][0])
    ha = RedisHA(tmp_path / "ha")
    cluster = f"t-f6-{uuid.uuid4().hex[:6]}"
    a, b = start_two(tmp_path, ha.url, cluster, [p0, p1, d], via=ha.master())
    keys = Keys(cluster)
    try:
        slow_prefill(pool, "20")
        load = Load(lambda: [a.url, b.url]).start()
        time.sleep(2)
        old = ha.master_port()
        ha.kill_master()
        t_kill = t_fault = time.monotonic()
        wait_for(lambda: ha.master_port() not in (None, old), 8, interval=0.1, what="sentinels fail over")
        failover_s = time.monotonic() - t_kill
        time.sleep(6)
        results = load.stop()
        report(results, t_fault)
        print(f"[chaos] case6 failover {failover_s:.1f} s")
        assert failover_s <= 5.0, failover_s
        s = summary(results)
        assert s["hung"] == 0 and s["lost"] == 0, (s, [x for x in results if x.kind in ("hung", "lost")][:5])
        late = [x for x in results if x.t0 > t_kill + failover_s + 5]
        assert late and all(x.kind == "ok" for x in late), summary(late)
        r = ha.master()
        try:
            finish(r, keys, [p0, p1], [a.url, b.url])
        finally:
            r.close()
    finally:
        a.stop()
        b.stop()
        ha.stop()
