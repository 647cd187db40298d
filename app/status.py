"""`flexlb status`: one screen on a running cluster, refreshed every second.

What a person looks at before opening Grafana: which replicas are up and which is master, who
owns which worker, each worker's health, queue, owed ms, KV use and prefix-cache hit ratio, the
API request rate and the error answers by code. It reads only what the gateways already serve:
`/readyz` and `/metrics` of every replica (no token needed) and `/admin/workers` of one (the admin
token; without it the worker columns that need it are left blank and the frame says so).

The replicas shown are the cluster's, not only those given: every replica's `/readyz` names the
live members (by heartbeat), and with the admin token `/admin/leases` gives their addresses, so
`--url` of one replica still probes the others; a live member that cannot be probed (no token)
is listed as such instead of being left out (the header said "1/1 replicas up" of a 3-replica
cluster).

Rates need two samples, so a frame compares the last two; `--once` takes two samples `--interval`
apart, prints one frame and exits (for scripts and tests). The replicas come from `--url`
(repeatable) or from the local stack's `logs/latest/stack.json`, whose folder also holds the admin
token `flexlb up` generated (`admin_token`, mode 0600).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

DEFAULT_STACK = Path("logs/latest/stack.json")


@dataclass
class ReplicaView:
    url: str
    ok: bool = False
    error: str = ""
    ready: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, float] = field(default_factory=dict)  # "2xx".. -> API answers (counter)
    errors: dict[str, float] = field(default_factory=dict)  # error code -> error answers (counter)
    worker_input: dict[str, float] = field(default_factory=dict)  # worker -> prompt tokens (counter)
    worker_cached: dict[str, float] = field(default_factory=dict)
    probed: bool = True  # False: a live member (by heartbeat) another replica named, not reached here


@dataclass
class Sample:
    at: float
    replicas: list[ReplicaView]
    workers: dict[str, dict[str, Any]] | None  # /admin/workers, None without a token
    admin_error: str = ""


def _parse_metrics(text: str, view: ReplicaView) -> None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "flexlb_http_requests_total" and s.labels.get("handler", "").startswith("/v1/"):
                st = s.labels.get("status", "")
                view.requests[st] = view.requests.get(st, 0.0) + s.value
            elif s.name == "flexlb_rejections_total":
                view.errors[s.labels.get("reason", "")] = s.value
            elif s.name == "flexlb_worker_prefill_input_tokens_total":
                view.worker_input[s.labels["worker"]] = s.value
            elif s.name == "flexlb_worker_prefill_cached_tokens_total":
                view.worker_cached[s.labels["worker"]] = s.value


async def _replica(http: httpx.AsyncClient, url: str) -> ReplicaView:
    v = ReplicaView(url)
    try:
        ready, metrics = await asyncio.gather(http.get(url + "/readyz"), http.get(url + "/metrics"))
        v.ready = ready.json()
        _parse_metrics(metrics.text, v)
        v.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        v.error = f"{type(exc).__name__}: {exc}"[:80]
    return v


async def sample(urls: list[str], token: str | None, timeout_s: float = 2.0) -> Sample:
    """One reading of every replica (in parallel) plus the workers' table from the first that
    answers; never raises for an unreachable replica (it shows as down). Live members the given
    URLs did not cover are probed too when the admin token tells their addresses, else listed as
    live but not probed."""
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        views = list(await asyncio.gather(*(_replica(http, u) for u in urls)))
        workers = None
        members: dict[str, str] = {}  # live replica id -> address, from /admin/leases
        err = "no admin token (--admin-token or FLEXLB_ADMIN_TOKEN): queue, owed, KV left blank"
        if token:
            err = "no replica answered"
            auth = {"Authorization": f"Bearer {token}"}
            for v in views:
                if not v.ok:
                    continue
                try:
                    r, leases = await asyncio.gather(
                        http.get(v.url + "/admin/workers", headers=auth),
                        http.get(v.url + "/admin/leases", headers=auth),
                    )
                except httpx.HTTPError as exc:
                    err = str(exc)
                    continue
                if r.status_code == 200:
                    workers, err = r.json().get("workers", {}), ""
                    if leases.status_code == 200:
                        for rid, d in (leases.json().get("replicas") or {}).items():
                            if d.get("address"):
                                members[rid] = str(d["address"])
                    break
                err = f"/admin/workers answered {r.status_code} (wrong admin token?)"
                break
        views += await _others(http, views, members)
    return Sample(time.monotonic(), views, workers, err)


async def _others(
    http: httpx.AsyncClient, views: list[ReplicaView], members: dict[str, str]
) -> list[ReplicaView]:
    """The live members no given URL answered for: probed at their advertised address when known,
    else a row that says they are live by heartbeat but were not probed."""
    answered = {str(v.ready.get("replica")) for v in views if v.ok}
    given = {v.url.removeprefix("http://").removeprefix("https://") for v in views}
    live = {str(rid) for v in views if v.ok for rid in v.ready.get("live_replicas", [])} | set(members)
    missing = sorted(live - answered)
    probe = [rid for rid in missing if rid in members and members[rid] not in given]
    found = list(await asyncio.gather(*(_replica(http, "http://" + members[rid]) for rid in probe)))
    for rid, v in zip(probe, found, strict=True):
        v.ready.setdefault("replica", rid)  # a live member its address did not answer for: down here
    reached = {str(v.ready.get("replica")) for v in found}
    unprobed = [
        ReplicaView("", ready={"replica": rid}, probed=False)
        for rid in missing
        if rid not in reached and members.get(rid) not in given
    ]
    return found + unprobed


# ---- rendering -------------------------------------------------------------------------------


def _rate(cur: Mapping[str, float], prev: Mapping[str, float] | None, dt: float, keys: set[str]) -> float:
    if prev is None or dt <= 0:
        return 0.0
    return max(0.0, sum(cur.get(k, 0.0) - prev.get(k, 0.0) for k in keys)) / dt


def _f(v: Any, fmt: str = "{:,.0f}") -> str:
    try:
        return fmt.format(float(v))
    except (TypeError, ValueError):
        return "–"


def render(cur: Sample, prev: Sample | None) -> Any:
    """One frame (a rich renderable) from the latest sample and the one before it."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    dt = cur.at - prev.at if prev is not None else 0.0
    prev_by_url = {v.url: v for v in prev.replicas} if prev is not None else {}
    up = [v for v in cur.replicas if v.ok]
    n_unprobed = sum(1 for v in cur.replicas if not v.probed)
    unprobed = f" ({n_unprobed} by heartbeat only: no admin token for their address)" if n_unprobed else ""
    master = next((v.ready.get("replica") for v in up if v.ready.get("master")), None)
    statuses = {c for v in cur.replicas for c in v.requests}
    codes = {c for v in cur.replicas for c in v.errors}
    req_rate = err_rate = 0.0
    err_by_code: dict[str, float] = {}

    reps = Table(box=box.SIMPLE_HEAD, title="replicas", title_justify="left", expand=False)
    for col, just in (("replica", "left"), ("url", "left"), ("state", "left"), ("role", "left")):
        reps.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for col in ("owns", "req/s", "err/s"):
        reps.add_column(col, justify="right", no_wrap=True)
    for v in cur.replicas:
        p = prev_by_url.get(v.url)
        seen = p is not None and p.ok
        req_r = _rate(v.requests, p.requests if seen else None, dt, statuses)  # type: ignore[union-attr]
        err_r = _rate(v.errors, p.errors if seen else None, dt, codes)  # type: ignore[union-attr]
        req_rate += req_r
        err_rate += err_r
        for c in codes:
            err_by_code[c] = err_by_code.get(c, 0.0) + _rate(v.errors, p.errors if seen else None, dt, {c})  # type: ignore[union-attr]
        if not v.probed:
            live = Text("live, not probed", style="yellow")
            reps.add_row(str(v.ready["replica"]), "–", live, "", "", "", "")
            continue
        if not v.ok:
            rid = str(v.ready.get("replica", "?"))
            reps.add_row(rid, v.url, Text("down", style="bold red"), "", "", "", "", end_section=False)
            continue
        ready = v.ready.get("ready")
        state = Text("ready", style="green") if ready else Text("not ready", style="yellow")
        role = "master" if v.ready.get("master") else ""
        reps.add_row(
            str(v.ready.get("replica", "?")),
            v.url.removeprefix("http://"),
            state,
            role,
            str(len(v.ready.get("owned", []))),
            f"{req_r:.1f}",
            f"{err_r:.1f}",
        )

    owners: dict[str, str] = {}
    health: dict[str, str] = {}
    for v in up:
        for w in v.ready.get("owned", []):
            owners[w] = str(v.ready.get("replica"))
        for w, h in v.ready.get("workers", {}).items():
            health.setdefault(w, h)
    inputs: dict[str, float] = {}
    cached: dict[str, float] = {}
    for v in up:  # ownership moves between replicas: each counted what it owned
        for w, n in v.worker_input.items():
            inputs[w] = inputs.get(w, 0.0) + n
        for w, n in v.worker_cached.items():
            cached[w] = cached.get(w, 0.0) + n

    wt = Table(box=box.SIMPLE_HEAD, title="workers", title_justify="left")
    wt.add_column("worker", no_wrap=True)
    wt.add_column("health")
    wt.add_column("owner", overflow="fold")
    for col in ("queue", "running", "owed ms", "KV used", "hit"):
        wt.add_column(col, justify="right", no_wrap=True)
    names = sorted(set(health) | set(cur.workers or {}), key=lambda w: (not w.startswith("prefill"), w))
    for w in names:
        snap = (cur.workers or {}).get(w, {}).get("snapshot", {}) if cur.workers is not None else {}
        h = str(snap.get("health") or health.get(w, "unknown"))
        style = {"up": "green", "down": "bold red"}.get(h, "yellow")
        owner = owners.get(w) or str((cur.workers or {}).get(w, {}).get("owner") or "–")
        kv = "–"
        if snap.get("kv_total_tokens"):
            total, free = float(snap["kv_total_tokens"]), float(snap.get("kv_free_tokens", 0))
            kv = f"{100 * (total - free) / total:.0f}% of {total / 1000:,.0f}K"
        hit = f"{100 * cached.get(w, 0.0) / inputs[w]:.0f}%" if inputs.get(w) else "–"
        wt.add_row(
            w,
            Text(h, style=style),
            owner,
            _f(snap.get("queue_len")),
            _f(snap.get("running")) if w.startswith("decode") else _f(snap.get("inflight_batches")),
            _f(snap.get("owed_ms")),
            kv,
            hit,
        )

    head = Text.assemble(
        ("FlexLB ", "bold"),
        f"{len(up) + n_unprobed}/{len(cur.replicas)} replicas up{unprobed} · master {master or '—'} · ",
        (f"{req_rate:.1f} req/s", "bold"),
        " · ",
        (f"{err_rate:.1f} errors/s", "bold red" if err_rate else ""),
    )
    parts: list[Any] = [head]
    if err_by_code:
        worst = sorted(((r, c) for c, r in err_by_code.items() if r > 0), reverse=True)[:4]
        if worst:
            parts.append(Text("errors: " + ", ".join(f"{c} {r:.1f}/s" for r, c in worst), style="red"))
    parts += [reps, wt]
    if cur.admin_error:
        parts.append(Text(cur.admin_error, style="dim"))
    return Group(*parts)


# ---- command ---------------------------------------------------------------------------------


def resolve_targets(urls: list[str], stack: Path, token: str | None) -> tuple[list[str], str | None]:
    """The replica URLs and token: given ones first, else the local stack's manifest and token."""
    if not urls and stack.exists():
        doc = json.loads(stack.read_text())
        urls = [str(g["url"]) for g in doc.get("gateways", []) if g.get("url")]
        tok = stack.parent / "admin_token"
        if token is None and tok.exists():
            token = tok.read_text().strip() or None
    return [u.rstrip("/") for u in urls] or ["http://127.0.0.1:8000"], token


def run_status(urls: list[str], token: str | None, *, once: bool, interval_s: float) -> int:
    from rich.console import Console

    console = Console()

    async def frames() -> int:
        prev = await sample(urls, token)
        if once:
            await asyncio.sleep(interval_s)
            cur = await sample(urls, token)
            console.print(render(cur, prev))
            return 0 if any(v.ok for v in cur.replicas) else 1
        from rich.live import Live

        with Live(render(prev, None), console=console, auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(interval_s)
                cur = await sample(urls, token)
                live.update(render(cur, prev), refresh=True)
                prev = cur

    try:
        return asyncio.run(frames())
    except KeyboardInterrupt:
        return 0
