"""Grafana dashboards (grafana/dashboards/*.json): well-formed, generated from grafana/generate.py,
bound to the provisioned datasource, every PromQL expression accepted by `promtool check rules`, and
every metric a panel reads present in a real scrape of a gateway replica or a Triton worker after
traffic. Also the metric hygiene of DESIGN §9 that the dashboards rely on: HTTP metrics, rejections,
batch prediction, cache-hit tokens, per-worker gauges that leave with their worker."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from .gateways import Gateway, start_gateway, wait_for

ROOT = Path(__file__).resolve().parent.parent
DASH_DIR = ROOT / "grafana" / "dashboards"
NAMES = ("overview", "scheduling", "workers", "cache")
PROMTOOL_HINT = "promtool not found: apt-get install -y prometheus (Debian) — .ci/run installs it"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}
_KEYWORDS |= {"offset"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((DASH_DIR / f"{name}.json").read_text())  # type: ignore[no-any-return]


def _exprs() -> list[tuple[str, int, str, str]]:
    """(dashboard, panel id, refId, expr) of every query."""
    return [
        (name, p["id"], t["refId"], t["expr"])
        for name in NAMES
        for p in _load(name)["panels"]
        for t in p["targets"]
    ]


def _concrete(expr: str) -> str:
    """Grafana's variables replaced by what they stand for, so promtool sees plain PromQL."""
    out = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace('"$worker"', '".*"')
    assert "$" not in out, f"unhandled Grafana variable in {expr}"
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers that are not functions, keywords, label names
    (inside `{}` or `by (...)`), ranges or numbers."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:e[+-]?\d+)?", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def _used_metrics() -> set[str]:
    used = {m for *_, e in _exprs() for m in metric_names(e)}
    for name in NAMES:
        for var in _load(name)["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["definition"])
                assert m, var["definition"]
                used.add(m.group(1))
    return used


# ---------------------------------------------------------------------------------------- static
def test_metric_name_extraction() -> None:
    e = (
        'histogram_quantile(0.95, sum by (le, handler) (rate(flexlb_x_bucket{a="b", c=~"$worker"}[1m])))'
        " / clamp_min(sum(rate(flexlb_y_total[1m])), 1e-9) - max by (worker) (nv_z) or on(instance) up"
    )
    assert metric_names(e) == {"flexlb_x_bucket", "flexlb_y_total", "nv_z", "up"}


def test_dashboards_are_the_generator_output_and_well_formed() -> None:
    spec = importlib.util.spec_from_file_location("grafana_generate", ROOT / "grafana" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(gen)
    rendered = gen.render()
    assert sorted(rendered) == sorted(NAMES)
    uids = set()
    for name in NAMES:
        text = (DASH_DIR / f"{name}.json").read_text()
        assert text == rendered[name], f"{name}.json differs from grafana/generate.py: run it and commit"
        d = json.loads(text)
        uids.add(d["uid"])
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        assert len(d["panels"]) >= 6, name
        for p in d["panels"]:
            assert p["targets"], f"{name}/{p['title']} has no query"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24
    assert len(uids) == len(NAMES)


def test_every_panel_uses_the_provisioned_datasource() -> None:
    prov = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {ds["uid"]: ds["type"] for ds in prov["datasources"]}
    for name in NAMES:
        d = _load(name)
        refs = [p["datasource"] for p in d["panels"]]
        refs += [t["datasource"] for p in d["panels"] for t in p["targets"]]
        refs += [v["datasource"] for v in d["templating"]["list"] if "datasource" in v]
        for ref in refs:
            assert uids.get(ref["uid"]) == ref["type"], f"{name}: datasource {ref} is not provisioned"


def test_every_expression_parses_with_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_HINT)
    rules = [
        {"record": f"dash:{name}:p{pid}_{ref}", "expr": _concrete(expr)} for name, pid, ref, expr in _exprs()
    ]
    assert len(rules) > 40
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout
    # and the check is real: a broken expression fails it
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "a:b", "expr": "sum(rate(x[1m])"}]}]})
    )
    bad = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


# ---------------------------------------------------------------------------------------- live
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"')


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Series of an exposition by their name as written (prometheus_client's parser would rename
    Triton's counters, which lack the `_total` suffix, to names Prometheus never stores)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


@pytest.fixture(scope="module")
def scraped_gateway(worker_pool, shared_embedded_redis, tmp_path_factory) -> Any:
    """One replica over the session's workers, with traffic of every kind the dashboards show."""
    tmp = tmp_path_factory.mktemp("ops-dash")
    spec = ",".join(f"{w.role}@{w.address}" for ws in worker_pool.values() for w in ws)
    gw = start_gateway(tmp, shared_embedded_redis, f"t-dash-{tmp.name[-6:]}", workers=spec)
    try:
        wait_for(lambda: gw.readyz().get("ready"), 30, 0.2, what="gateway ready")
        yield gw
    finally:
        gw.stop()


def _traffic(gw: Gateway) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 12  # > 1 block: cache hits on repeat
    for _ in range(3):
        r = httpx.post(gw.url + "/v1/generate", json={"prompt": prompt, "max_new_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json={"model": "flexlb-sim", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    assert httpx.post(gw.url + "/v1/generate", json={"max_new_tokens": 4}, timeout=10).status_code == 400


def test_every_dashboard_metric_is_in_a_real_scrape(scraped_gateway: Gateway, workers_reset) -> None:
    gw = scraped_gateway
    _traffic(gw)
    used = _used_metrics()
    assert all(m.startswith(("flexlb_", "nv_")) for m in used), sorted(used)
    triton = [
        f"http://127.0.0.1:{w.ready['metrics_port']}/metrics" for ws in workers_reset.values() for w in ws
    ]

    def missing() -> set[str]:
        have = set(_samples(gw.get("/metrics").text))
        for url in triton:
            have |= set(_samples(httpx.get(url, timeout=5).text))
        return used - have

    last: set[str] = set()

    def none_missing() -> bool:
        nonlocal last
        last = missing()
        return not last

    try:
        wait_for(none_missing, 20, 0.25, what="every dashboard metric exported")
    except AssertionError:
        pytest.fail(f"dashboards use metrics nobody exports: {sorted(last)}")


def test_new_metrics_move_with_traffic(scraped_gateway: Gateway, workers_reset) -> None:
    gw = scraped_gateway
    before = _samples(gw.get("/metrics").text)
    _traffic(gw)

    def moved() -> dict[str, list[tuple[dict[str, str], float]]] | None:
        s = _samples(gw.get("/metrics").text)
        ok = (
            _value(s, "flexlb_batch_actual_seconds_count")
            >= _value(before, "flexlb_batch_actual_seconds_count") + 4
        )
        return s if ok else None

    after = wait_for(moved, 20, 0.2, what="batch results observed")
    delta = {
        k: _value(after, k) - _value(before, k)
        for k in (
            "flexlb_batch_predicted_seconds_count",
            "flexlb_batch_time_ratio_count",
            "flexlb_routed_prompt_tokens_total",
            "flexlb_prefill_input_tokens_total",
            "flexlb_prefill_cached_tokens_total",
            "flexlb_routed_cache_hit_tokens_total",
        )
    }
    assert delta["flexlb_batch_predicted_seconds_count"] >= 4
    assert delta["flexlb_batch_time_ratio_count"] >= 4
    assert delta["flexlb_routed_prompt_tokens_total"] >= 3 * 500
    # what the workers finished is what was dispatched (less only if a batch was retried elsewhere)
    assert 3 * 500 <= delta["flexlb_prefill_input_tokens_total"] <= delta["flexlb_routed_prompt_tokens_total"]
    assert delta["flexlb_prefill_cached_tokens_total"] > 0, "a repeated prompt must hit the cache"
    assert delta["flexlb_routed_cache_hit_tokens_total"] > 0, "the router expected those hits"
    rej = _value(after, "flexlb_rejections_total", reason="invalid_request")
    assert rej - _value(before, "flexlb_rejections_total", reason="invalid_request") == 1
    assert _value(after, "flexlb_rejections_total", reason="overloaded") == 0  # pre-registered, bounded
    http = _value(after, "flexlb_http_requests_total", handler="/v1/generate", method="POST")
    assert http - _value(before, "flexlb_http_requests_total", handler="/v1/generate", method="POST") == 4
    assert _value(after, "flexlb_http_requests_total", handler="/metrics") == 0, "scrapes are not traffic"
    workers = {lab["worker"] for lab, _ in after["flexlb_worker_inflight_batches"]}
    assert {w for w in workers if w.startswith("prefill")} == {
        f"prefill@{w.address}" for w in workers_reset["prefill"]
    }


def test_worker_series_leave_with_the_worker(scraped_gateway: Gateway) -> None:
    gw = scraped_gateway
    ghost = "prefill@127.0.0.1:1"  # nothing listens: its owner marks it down, which is exported
    assert gw.post("/admin/workers", admin=True, json={"workers": ghost}).status_code == 200

    def series() -> list[str]:
        return [ln for ln in gw.get("/metrics").text.splitlines() if f'worker="{ghost}"' in ln]

    wait_for(lambda: any(ln.startswith("flexlb_worker_up{") for ln in series()), 15, what="ghost exported")
    assert (
        httpx.delete(
            f"{gw.url}/admin/workers/{ghost}", headers={"Authorization": "Bearer test-admin-token"}, timeout=5
        ).status_code
        == 200
    )
    wait_for(lambda: not series(), 10, 0.1, what="ghost series removed")
    assert gw.readyz()["ready"], "the real workers kept theirs"
    assert any('worker="prefill@' in ln for ln in gw.get("/metrics").text.splitlines())


def test_operations_doc_lists_every_gateway_metric() -> None:
    import app.gateway.errors  # noqa: F401 - registers the rejection labels
    from app import metrics as M

    doc = (ROOT / "docs" / "operations.md").read_text()
    for collector in list(M.REGISTRY._collector_to_names):
        for fam in collector.describe():
            name = fam.name + ("_total" if fam.type == "counter" else "")
            assert f"`{name}`" in doc, f"docs/operations.md does not list {name} ({fam.type})"
