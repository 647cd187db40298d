"""Worker health as the owner's polls see it, through a real replica and real Triton workers: a
worker that answers late stays in routing for a few polls, one that keeps not answering goes down
(app/cluster/health.py). The late answers are real: the `hang` fault makes the worker's control
model hold every poll until it is lifted, so each poll runs past its deadline and is answered
after it."""

from __future__ import annotations

from .conftest import worker_call
from .gateways import Gateway, start_gateway, wait_for


def _polls_slow(gw: Gateway, wid: str) -> float:
    for line in gw.get("/metrics").text.splitlines():
        if line.startswith(f'flexlb_worker_polls_slow_total{{worker="{wid}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_worker_answering_polls_late_stays_up_until_five_in_a_row(
    workers_reset, shared_embedded_redis, cluster, tmp_path
) -> None:
    """Two polls in a row past their deadline (a loaded box) leave the worker up and routable;
    with its answers back it is still up, never having gone down. Kept silent, it goes down after
    the fifth miss in a row, and comes back on the first good poll. The counts are the owner's
    (its slow-poll counter and its health log line), not wall-clock time: on a loaded box a poll
    may take longer, never fewer of them. `workers_reset` lifts the fault, pass or fail."""
    p, d = workers_reset["prefill"][0], workers_reset["decode"][0]
    wid = f"prefill@{p.address}"
    # Polls 2 s apart: a miss every 2.5 s while the worker is silent, so the test's own checks (slow
    # on a loaded box) see the second miss long before a fifth could come.
    gw = start_gateway(
        tmp_path, shared_embedded_redis, cluster, f"{wid},decode@{d.address}", FLEXLB_POLL_INTERVAL_MS="2000"
    )
    try:
        wait_for(lambda: gw.readyz()["workers"].get(wid) == "up", 60, what="worker up")
        before = _polls_slow(gw, wid)
        assert worker_call(p.address, "configure", faults={"hang": True})["ok"]
        states: list[str] = []

        def late(n: int) -> bool:
            states.append(gw.readyz()["workers"][wid])
            return _polls_slow(gw, wid) >= before + n

        # Two misses in a row: before slow polls were told apart that took a worker out of routing.
        # (Not more: on a loaded box a poll before the fault may have run late too.)
        wait_for(lambda: late(2), 30, what="two polls past the deadline")
        assert worker_call(p.address, "configure", faults={})["ok"]
        assert set(states) == {"up"}, states
        assert f"worker {wid} health up -> down" not in gw.log()
        r = gw.post("/v1/generate", json={"prompt": "still routed", "max_new_tokens": 2})
        assert r.status_code == 200 and r.json()["prefill_worker"] == wid, r.text

        assert worker_call(p.address, "configure", faults={"hang": True})["ok"]
        wait_for(lambda: gw.readyz()["workers"][wid] == "down", 60, what="down when it stays silent")
        assert f"worker {wid} health up -> down after 5 missed polls" in gw.log(), gw.log()[-2000:]
        assert worker_call(p.address, "configure", faults={})["ok"]
        wait_for(lambda: gw.readyz()["workers"][wid] == "up", 30, what="up on the first good poll")
    finally:
        gw.stop()
