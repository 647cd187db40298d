"""Dashboards as code: writes grafana/dashboards/{overview,scheduling,workers,cache}.json.

The JSON files are what Grafana provisions (docker compose mounts them); this script is their
source, so a panel is one line here instead of forty lines of JSON, and every query sits next to
its neighbours for review. tests/test_ops_dashboards.py checks the files equal this output, that
every expression parses (promtool) and that every metric used is exported by a gateway or Triton.

    .venv/bin/python grafana/generate.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "flexlb-prometheus"}  # grafana/provisioning/datasources
OUT = Path(__file__).resolve().parent / "dashboards"
R = "$__rate_interval"


def q(phi: float, hist: str, by: str = "", sel: str = "") -> str:
    """Quantile of a histogram over the rate window, summed over replicas (and `by` labels)."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({phi}, sum by ({labels}) (rate({hist}_bucket{sel}[{R}])))"


def ratio(num: str, den: str) -> str:
    """num / den with an empty denominator giving no point instead of a division by zero."""
    return f"({num}) / clamp_min({den}, 1e-9)"


def rate(metric: str, by: str = "", sel: str = "") -> str:
    grp = f"sum by ({by}) " if by else "sum"
    return f"{grp}(rate({metric}{sel}[{R}]))"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (expr, legend)
    kind: str = "timeseries"
    unit: str = "short"
    description: str = ""
    w: int = 12
    h: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


def stat(title: str, expr: str, unit: str = "short", description: str = "") -> Panel:
    return Panel(title, [(expr, "")], kind="stat", unit=unit, description=description, w=4, h=4)


def ts(title: str, *targets: tuple[str, str], unit: str = "short", description: str = "") -> Panel:
    return Panel(title, list(targets), unit=unit, description=description)


def dashboard(
    uid: str, title: str, panels: list[Panel], variables: list[dict[str, Any]] | None = None
) -> dict:
    out, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(panels, start=1):
        if x + p.w > 24:
            x, y, row_h = 0, y + row_h, 0
        panel: dict[str, Any] = {
            "id": i,
            "type": p.kind,
            "title": p.title,
            "description": p.description,
            "datasource": DATASOURCE,
            "gridPos": {"x": x, "y": y, "w": p.w, "h": p.h},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": (
                {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"}
                if p.kind == "stat"
                else {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
            ),
            "targets": [
                {"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": e, "legendFormat": leg}
                for j, (e, leg) in enumerate(p.targets)
            ],
            **p.extra,
        }
        out.append(panel)
        x += p.w
        row_h = max(row_h, p.h)
    return {
        "uid": uid,
        "title": title,
        "tags": ["flexlb"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "links": [{"type": "dashboards", "tags": ["flexlb"], "title": "FlexLB", "asDropdown": False}],
        "annotations": {"list": []},
        "templating": {"list": variables or []},
        "panels": out,
    }


WORKER_VAR = {
    "name": "worker",
    "label": "worker",
    "type": "query",
    "datasource": DATASOURCE,
    "query": {"query": "label_values(flexlb_worker_up, worker)", "refId": "worker"},
    "definition": "label_values(flexlb_worker_up, worker)",
    "refresh": 2,
    "includeAll": True,
    "multi": True,
    "allValue": ".*",
    "current": {"text": "All", "value": "$__all"},
}
W = '{worker=~"$worker"}'


def overview() -> dict:
    req = "sum(rate(flexlb_requests_total[$__rate_interval]))"
    return dashboard(
        "flexlb-overview",
        "FlexLB / Overview",
        [
            stat("Requests/s", req, "reqps"),
            stat(
                "Error ratio",
                ratio('sum(rate(flexlb_requests_total{code!="ok"}[$__rate_interval]))', req),
                "percentunit",
                "Finished requests whose outcome code is not ok",
            ),
            stat("TTFT p95", q(0.95, "flexlb_ttft_seconds"), "s"),
            stat("TPOT p95", q(0.95, "flexlb_tpot_seconds"), "s"),
            stat("Workers up", "sum(max by (worker) (flexlb_worker_up))", description="Owner's health view"),
            stat("Live replicas", "max(flexlb_live_replicas)", description="As the master replica sees them"),
            ts(
                "Requests by endpoint and code",
                (rate("flexlb_requests_total", "endpoint, code"), "{{endpoint}} {{code}}"),
                unit="reqps",
            ),
            ts(
                "Request ids sent again",
                (rate("flexlb_request_id_reused_total", "result"), "{{result}}"),
                unit="reqps",
                description="A client's retry under the id of an ended request: retry = a new attempt "
                "(the stored outcome invited it), replay = the stored outcome",
            ),
            ts(
                "Rejections by reason",
                (rate("flexlb_rejections_total", "reason"), "{{reason}}"),
                unit="reqps",
                description="Error responses sent before any streaming: 429 overloaded, 503 no_worker, ...",
            ),
            ts(
                "Time to first token",
                (q(0.5, "flexlb_ttft_seconds"), "p50"),
                (q(0.95, "flexlb_ttft_seconds"), "p95"),
                (q(0.99, "flexlb_ttft_seconds"), "p99"),
                unit="s",
            ),
            ts(
                "Time per output token",
                (q(0.5, "flexlb_tpot_seconds"), "p50"),
                (q(0.95, "flexlb_tpot_seconds"), "p95"),
                unit="s",
            ),
            ts(
                "End-to-end latency",
                (q(0.5, "flexlb_e2e_seconds"), "p50"),
                (q(0.95, "flexlb_e2e_seconds"), "p95"),
                (ratio(rate("flexlb_e2e_seconds_sum"), rate("flexlb_e2e_seconds_count")), "mean"),
                unit="s",
            ),
            ts(
                "HTTP requests by route and status",
                (rate("flexlb_http_requests_total", "handler, status"), "{{handler}} {{status}}"),
                unit="reqps",
            ),
            ts(
                "HTTP latency p95 by route",
                (q(0.95, "flexlb_http_request_duration_seconds", "handler"), "{{handler}}"),
                unit="s",
                description="Whole response, token streams included",
            ),
            ts(
                "Requests per replica",
                (rate("flexlb_requests_total", "instance"), "{{instance}}"),
                unit="reqps",
                description="How evenly the proxy spreads traffic",
            ),
            ts(
                "Redis",
                ("min(flexlb_redis_up)", "up (all replicas)"),
                (q(0.99, "flexlb_redis_latency_seconds"), "ping p99 (s)"),
                (ratio(rate("flexlb_redis_commands_total"), req), "commands per request"),
            ),
            ts(
                "Gateway origin overhead",
                (q(0.99, "flexlb_origin_overhead_seconds"), "origin p99"),
                (q(0.99, "flexlb_handoff_latency_seconds"), "hand-off p99"),
                unit="s",
                description="Arrival to hand-off appended; hand-off appended to the owner's gRPC write",
            ),
        ],
    )


def scheduling() -> dict:
    return dashboard(
        "flexlb-scheduling",
        "FlexLB / Scheduling",
        [
            ts(
                "Batch flushes by reason",
                (rate("flexlb_batch_flushes_total", "reason"), "{{reason}}"),
                unit="ops",
            ),
            ts(
                "Batch size",
                (ratio(rate("flexlb_batch_size_sum"), rate("flexlb_batch_size_count")), "mean"),
                (q(0.95, "flexlb_batch_size"), "p95"),
            ),
            ts(
                "Batcher wait",
                (q(0.5, "flexlb_batch_wait_seconds"), "p50"),
                (q(0.99, "flexlb_batch_wait_seconds"), "p99"),
                unit="s",
            ),
            ts(
                "Predicted vs actual batch time (modelled)",
                (
                    ratio(
                        rate("flexlb_batch_predicted_seconds_sum"),
                        rate("flexlb_batch_predicted_seconds_count"),
                    ),
                    "predicted mean",
                ),
                (
                    ratio(rate("flexlb_batch_actual_seconds_sum"), rate("flexlb_batch_actual_seconds_count")),
                    "actual mean",
                ),
                (q(0.95, "flexlb_batch_actual_seconds"), "actual p95"),
                unit="s",
            ),
            ts(
                "Actual ÷ predicted batch time",
                (q(0.1, "flexlb_batch_time_ratio"), "p10"),
                (q(0.5, "flexlb_batch_time_ratio"), "p50"),
                (q(0.9, "flexlb_batch_time_ratio"), "p90"),
                description="1 = the prefill-time formula matches the worker; above 1 it under-predicts",
            ),
            ts(
                "Batcher refusals",
                (rate("flexlb_batch_refused_total", "code"), "{{code}}"),
                unit="ops",
            ),
            ts(
                "Owed time per worker",
                ("max by (worker) (flexlb_worker_owed_seconds)", "{{worker}}"),
                unit="s",
                description="Predicted (modelled) time of committed, unsettled batches",
            ),
            ts(
                "Queued time per worker",
                ("max by (worker) (flexlb_worker_queued_seconds)", "{{worker}}"),
                unit="s",
                description="Predicted (modelled) time waiting in the worker's hand-off queue",
            ),
            ts(
                "In-flight batches per worker",
                ("max by (worker) (flexlb_worker_inflight_batches)", "{{worker}}"),
            ),
            ts("Queue length per worker", ("max by (worker) (flexlb_worker_queue_len)", "{{worker}}")),
            ts(
                "Fresh-pick moves per replica",
                (rate("flexlb_fresh_pick_moved_total", "instance"), "{{instance}}"),
                unit="ops",
                description="Hand-offs sent to the policy's runner-up, ranked above its pick on live load "
                "(FLEXLB_FRESH_PICK); 0 when off, about half the hand-offs where the two are near-tied",
            ),
            ts(
                "Lease changes",
                (f"sum by (kind, change) (increase(flexlb_lease_changes_total[{R}]))", "{{kind}} {{change}}"),
            ),
            ts(
                "Ownership",
                ("flexlb_owned_workers", "owned by {{instance}}"),
                ("flexlb_is_master", "master {{instance}}"),
            ),
            ts(
                "Hand-offs taken over from a dead owner",
                (f"sum by (outcome) (increase(flexlb_owner_claimed_total[{R}]))", "{{outcome}}"),
            ),
            ts(
                "Replicas",
                ("max(flexlb_live_replicas)", "live"),
                (f"sum(increase(flexlb_reaped_replicas_total[{R}]))", "reaped"),
            ),
        ],
    )


def workers() -> dict:
    tri = "instance, model"
    return dashboard(
        "flexlb-workers",
        "FlexLB / Workers",
        [
            ts(
                "Worker up",
                (f"max by (worker) (flexlb_worker_up{W})", "{{worker}}"),
                description="1 up, 0 down",
            ),
            ts(
                "Missed polls",
                (f"sum by (worker) (increase(flexlb_worker_polls_slow_total{W}[{R}]))", "{{worker}} slow"),
                (
                    f"sum by (worker) (increase(flexlb_worker_polls_failed_total{W}[{R}]))",
                    "{{worker}} failed",
                ),
                description="A failed poll marks the worker down at once; slow ones only after "
                "FLEXLB_DOWN_AFTER_SLOW_POLLS misses in a row",
            ),
            ts(
                "KV cache used",
                (
                    f"1 - max by (worker) (flexlb_worker_kv_free_tokens{W})"
                    f" / clamp_min(max by (worker) (flexlb_worker_kv_total_tokens{W}), 1)",
                    "{{worker}}",
                ),
                unit="percentunit",
            ),
            ts(
                "Decode KV reserved",
                (f"max by (worker) (flexlb_worker_reserved_tokens{W})", "{{worker}}"),
                description="Tokens held for routed, unfinished requests",
            ),
            ts("Decoding sequences", (f"max by (worker) (flexlb_worker_running{W})", "{{worker}}")),
            ts("Queue length", (f"max by (worker) (flexlb_worker_queue_len{W})", "{{worker}}")),
            ts(
                "Restarts (epoch changes)",
                (f"sum by (worker) (increase(flexlb_worker_epoch_changes_total{W}[{R}]))", "{{worker}}"),
                (f"sum(increase(flexlb_dispatch_epoch_retries_total[{R}]))", "batches re-sent"),
                description="A batch refused epoch_mismatch (the owner's view lagged a restart) is sent "
                "once more under the new epoch; adopted requests a restart cut short are re-run "
                "(Hand-offs taken over, outcome rerun)",
            ),
            ts(
                "Triton requests/s",
                (rate("nv_inference_request_success", tri), "{{instance}} {{model}} ok"),
                (rate("nv_inference_request_failure", tri), "{{instance}} {{model}} failed"),
                unit="reqps",
            ),
            ts(
                "Triton mean request duration",
                (
                    ratio(
                        rate("nv_inference_request_duration_us", tri),
                        rate("nv_inference_request_success", tri),
                    )
                    + " / 1e6",
                    "{{instance}} {{model}}",
                ),
                unit="s",
                description="Streams included: decode and control calls last as long as their stream",
            ),
            ts(
                "Triton pending requests",
                (f"sum by ({tri}) (nv_inference_pending_request_count)", "{{instance}} {{model}}"),
            ),
            ts(
                "Worker CPU",
                ("nv_cpu_utilization", "{{instance}}"),
                unit="percentunit",
            ),
        ],
        [WORKER_VAR],
    )


def cache() -> dict:
    routed = ratio(rate("flexlb_routed_cache_hit_tokens_total"), rate("flexlb_routed_prompt_tokens_total"))
    actual = ratio(rate("flexlb_prefill_cached_tokens_total"), rate("flexlb_prefill_input_tokens_total"))
    return dashboard(
        "flexlb-cache",
        "FlexLB / Cache",
        [
            stat("Routed hit ratio", routed, "percentunit", "Prompt tokens the router expected cached"),
            stat("Actual hit ratio", actual, "percentunit", "Prompt tokens the workers found cached"),
            ts(
                "Cache hit ratio",
                (routed, "routed (expected)"),
                (actual, "actual (worker)"),
                unit="percentunit",
            ),
            ts(
                "Prompt tokens/s",
                (rate("flexlb_prefill_input_tokens_total"), "prompt"),
                (rate("flexlb_prefill_cached_tokens_total"), "served from cache"),
                (rate("flexlb_routed_cache_hit_tokens_total"), "expected from cache"),
            ),
            ts(
                "Mirror blocks per worker",
                ("max by (worker) (flexlb_cache_mirror_blocks)", "{{worker}}"),
                description="Block keys each prefill worker holds, as the replicas' mirrors see them",
            ),
            ts(
                "Mirror divergence between replicas",
                (
                    "max by (worker) (flexlb_cache_mirror_blocks)"
                    " - min by (worker) (flexlb_cache_mirror_blocks)",
                    "{{worker}}",
                ),
                description="0 when every replica's mirror agrees; lag shows as short spikes",
            ),
            ts("TTFT p95 (cache effect)", (q(0.95, "flexlb_ttft_seconds"), "p95"), unit="s"),
            ts(
                "Shared speculative records/s",
                (rate("flexlb_shared_speculative_records_total", by="event"), "{{event}}"),
                description=(
                    "Speculative-entry records on the workers' spec streams (FLEXLB_SHARED_SPECULATIVE),"
                    " summed over replicas: published by owners, failed to publish, applied to a"
                    " mirror, skipped (own or stale). On N replicas applied ≈ (N − 1)/N × published;"
                    " all 0 when the setting is off"
                ),
            ),
        ],
    )


DASHBOARDS = {"overview": overview, "scheduling": scheduling, "workers": workers, "cache": cache}


def render() -> dict[str, str]:
    return {
        name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / f"{name}.json").write_text(text)
        print(f"wrote {OUT / name}.json")


if __name__ == "__main__":
    main()
