"""The admin API through real gateway replicas (subprocesses), real Redis and real Triton workers:
auth and validation, and the runtime config and declared policies every replica applies. Cluster
state as replicas, workers and Redis come and go: tests/test_gateway_cluster_state.py."""

from __future__ import annotations

import json

from .gateways import Gateway, specs, start_gateway, wait_for


def test_admin_auth_and_validation(worker_pool, shared_embedded_redis, cluster, tmp_path) -> None:
    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, specs(worker_pool))
    try:
        for path in ("/admin/workers", "/admin/leases", "/admin/config"):
            resp = gw.get(path)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized"
        before = gw.get("/admin/workers", admin=True).json()["workers"].keys()
        for bad in ({"workers": "gpu@h:1"}, {"workers": ""}, {"nope": 1}, {"workers": "prefill@h:99999"}):
            resp = gw.post("/admin/workers", admin=True, json=bad)
            assert resp.status_code == 400, bad
            assert resp.json()["error"]["code"] == "invalid_request"
        assert gw.get("/admin/workers", admin=True).json()["workers"].keys() == before
        cfg0 = gw.get("/admin/config", admin=True).json()
        for bad in ({"prefill_strategy": "fastest"}, {"prefill_time_formula": "1 + foo"}, {}, {"x": 1}):
            resp = httpx_put(gw, "/admin/config", bad)
            assert resp.status_code == 400, bad
        assert gw.get("/admin/config", admin=True).json() == cfg0
        # the names the config accepts are what the policy registry holds, and the API lists them
        listed = gw.get("/admin/policies", admin=True).json()
        assert sorted(listed["policies"]["prefill"]) == [
            "cost",
            "least_load",
            "prefix",
            "random",
            "round_robin",
        ]
        assert "predicted_finish_ms" in listed["plugins"]["scorer"]
        ok = httpx_put(
            gw, "/admin/config", {"prefill_strategy": "prefix", "prefill_time_formula": "5 + inputTokens"}
        )
        assert ok.status_code == 200 and ok.json()["config"]["prefill_strategy"] == "prefix"
        # a second replica sees the same config (stored in Redis)
        gw2 = start_gateway(tmp_path, shared_embedded_redis, cluster)
        try:
            assert gw2.get("/admin/config", admin=True).json()["config"]["prefill_strategy"] == "prefix"
        finally:
            gw2.stop()
        # add / drain / remove persist
        assert (
            gw.post("/admin/workers", admin=True, json={"workers": "decode@127.0.0.1:1"}).status_code == 200
        )
        assert gw.post("/admin/workers/decode@127.0.0.1:1/drain", admin=True).status_code == 200
        assert (
            gw.get("/admin/workers", admin=True).json()["workers"]["decode@127.0.0.1:1"]["state"]
            == "draining"
        )
        import httpx

        resp = httpx.delete(
            gw.url + "/admin/workers/decode@127.0.0.1:1", headers={"Authorization": "Bearer test-admin-token"}
        )
        assert resp.status_code == 200
        assert "decode@127.0.0.1:1" not in gw.get("/admin/workers", admin=True).json()["workers"]
        m = gw.get("/metrics").text
        for name in (
            "flexlb_lease_changes_total",
            "flexlb_redis_latency_seconds_bucket",
            "flexlb_worker_up",
            "flexlb_redis_up",
        ):
            assert name in m
        json.loads(gw.get("/readyz").text)
    finally:
        gw.stop()


def test_a_declared_policy_routes_live_with_its_batching(
    worker_pool, shared_embedded_redis, cluster, tmp_path
) -> None:
    """A prefill policy declared in FLEXLB_POLICIES and selected by FLEXLB_PREFILL_STRATEGY is what
    the replica runs, its batching mode included, until the runtime config names a mode itself;
    the admin API lists it with the built-in ones."""
    import httpx

    declared = {
        "sticky_direct": {
            "role": "prefill",
            "scorers": {"predicted_finish_ms": 1, "cache_hit_tokens": 0.01},
            "picker": {"name": "best", "tie_pct": 0.1, "tie_abs": 20},
            "batching": "direct",
        }
    }
    gw = start_gateway(
        tmp_path,
        shared_embedded_redis,
        cluster,
        specs(worker_pool),
        FLEXLB_POLICIES=json.dumps(declared),
        FLEXLB_PREFILL_STRATEGY="sticky_direct",
    )
    try:
        effective = gw.get("/admin/config", admin=True).json()["effective"]
        assert (effective["prefill_strategy"], effective["schedule_mode"]) == ("sticky_direct", "direct")
        listed = gw.get("/admin/policies", admin=True).json()["policies"]["prefill"]
        assert listed["sticky_direct"]["scorers"][1] == {"name": "cache_hit_tokens", "weight": 0.01}
        wait_for(lambda: gw.readyz()["ready"], 60, what="ready")
        body = {"prompt": "declared policy " * 8, "max_new_tokens": 2}
        done = httpx.post(gw.url + "/v1/generate", json=body, timeout=30)
        assert done.status_code == 200, done.text
        assert httpx_put(gw, "/admin/config", {"schedule_mode": "batch"}).status_code == 200
        wait_for(
            lambda: gw.get("/admin/config", admin=True).json()["effective"]["schedule_mode"] == "batch",
            10,
            what="the runtime config's mode over the policy's",
        )
    finally:
        gw.stop()


def test_policies_declared_at_runtime_apply_on_every_replica(
    worker_pool, shared_embedded_redis, cluster, tmp_path
) -> None:
    """`PUT /admin/config` `policies` declares policies without a restart: checked against the
    plugin registry (a bad one stores nothing), stored in Redis, listed, published and selectable
    on every replica, and a selected policy cannot be removed from under the config."""
    import httpx

    gw = start_gateway(tmp_path, shared_embedded_redis, cluster, specs(worker_pool))
    gw2 = start_gateway(tmp_path, shared_embedded_redis, cluster)
    try:
        cfg0 = gw.get("/admin/config", admin=True).json()
        sticky = {"role": "prefill", "scorers": {"predicted_finish_ms": 1, "cache_hit_tokens": 0.01}}
        for bad in (
            {"x": {"role": "prefill", "scorers": {"no_such_scorer": 1}}},
            {"cost": sticky},  # a built-in's name
            {"a,b": sticky},  # not usable in `flexlb simulate --policy a,b`
            {"x": {**sticky, "scorers": {"predicted_finish_ms": 0}}},
            {"x": {**sticky, "picker": {"name": "best", "tie_pct": "wide"}}},
            {"x": {**sticky, "filters": [{"name": "hotspot", "no_such_parameter": 1}]}},
            [sticky],
        ):
            resp = httpx_put(gw, "/admin/config", {"policies": json.dumps(bad)})
            assert resp.status_code == 400, (bad, resp.text)
            assert resp.json()["error"]["code"] == "invalid_request"
        for bad_patch in (
            {"policies": "{"},
            {"policies": json.dumps({"x": sticky}), "prefill_strategy": "y"},
        ):
            assert httpx_put(gw, "/admin/config", bad_patch).status_code == 400, bad_patch
        assert gw.get("/admin/config", admin=True).json() == cfg0
        declared = {
            "sticky_rt": {**sticky, "batching": "direct"},
            "fewest_running": {"role": "decode", "scorers": {"decode_running": 1}},
        }
        patch = {
            "policies": json.dumps(declared),
            "prefill_strategy": "sticky_rt",
            "decode_strategy": "fewest_running",
        }
        ok = httpx_put(gw, "/admin/config", patch)
        assert ok.status_code == 200, ok.text
        assert json.loads(ok.json()["config"]["policies"]) == declared

        def effective() -> tuple[str, str, str]:
            e = gw2.get("/admin/config", admin=True).json()["effective"]
            return e["prefill_strategy"], e["decode_strategy"], e["schedule_mode"]

        # the other replica applies it: the policies, the selection and the policy's batching mode
        wait_for(lambda: effective() == ("sticky_rt", "fewest_running", "direct"), 10, what="applied on gw2")
        listed = gw2.get("/admin/policies", admin=True).json()["policies"]
        assert listed["prefill"]["sticky_rt"]["batching"] == "direct"
        assert "fewest_running" in listed["decode"]
        doc = gw2.get("/openapi.json").json()["components"]["schemas"]["ConfigPatch"]["properties"]
        assert "sticky_rt" in doc["prefill_strategy"]["enum"]
        wait_for(lambda: gw2.readyz()["ready"], 60, what="ready")
        done = httpx.post(
            gw2.url + "/v1/generate", json={"prompt": "runtime policy " * 8, "max_new_tokens": 2}, timeout=30
        )
        assert done.status_code == 200, done.text
        # selected: cannot be removed until another is selected
        resp = httpx_put(gw, "/admin/config", {"policies": "{}"})
        assert resp.status_code == 400 and "selected" in resp.json()["error"]["message"]
        back = {"policies": "{}", "prefill_strategy": "cost", "decode_strategy": "kv_headroom"}
        assert httpx_put(gw, "/admin/config", back).status_code == 200
        wait_for(
            lambda: "sticky_rt" not in gw2.get("/admin/policies", admin=True).json()["policies"]["prefill"],
            10,
            what="removed on gw2",
        )
    finally:
        gw2.stop()
        gw.stop()


def httpx_put(gw: Gateway, path: str, body: dict):
    import httpx

    return httpx.put(
        gw.url + path, json=body, headers={"Authorization": "Bearer test-admin-token"}, timeout=5
    )
