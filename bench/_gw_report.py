"""The gateway-overhead benchmark's report: the console tables and summary.md."""

from __future__ import annotations

from typing import Any

from _gw_cluster import MAX_NEW_TOKENS, PROMPT_TOKENS
from _harness import console, pct, r3, table


def errors_of(codes: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in sorted(codes.items()) if k != "ok"}


def e2e_latency(res: dict[str, Any]) -> dict[str, Any]:
    """The sequential phase's latency figures from the load generator's answer (`lg_e2e` or
    `lg_peer_e2e`): through the router, straight to the workers, and the difference."""
    g, d = res["gateway_ms"], res["direct_ms"]
    return {
        "gateway_p50_ms": r3(pct(g, 50)),
        "gateway_p99_ms": r3(pct(g, 99)),
        "direct_p50_ms": r3(pct(d, 50)),
        "direct_p99_ms": r3(pct(d, 99)),
        "direct_client_cpu_ms": r3(res["direct_client_cpu_ms"]) if "direct_client_cpu_ms" in res else None,
        "added_p50_ms": r3(pct(g, 50) - pct(d, 50)),
        "added_p99_ms": r3(pct(g, 99) - pct(d, 99)),
        # Per replica the requests were sent to (`gateway_url`: FlexLB's sequential phase): with 2
        # replicas, 1P+1D, those sent to the prefill worker's owner hand off in process and the
        # others cross replicas, so the pair splits the median by path (issue 20).
        "added_p50_ms_by_url": [
            r3(pct([x for x, u in zip(g, res["gateway_url"], strict=True) if u == k], 50) - pct(d, 50))
            for k in sorted(set(res.get("gateway_url", [])))
        ],
        "gateway_errors": errors_of(res["gateway_codes"]),
        "direct_errors": errors_of(res["direct_codes"]),
    }


def _yes(b: bool) -> str:
    return "yes" if b else "NO"


def _err(d: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in d.items()) or "0"


def render(results: dict[str, Any]) -> None:
    ol = results.get("open_loop")
    if ol:
        cols = [
            ("sched/sent/ok", f"{ol['scheduled']}/{ol['sent']}/{ol['ok']}"),
            ("errors", _err(ol["errors"])),
            ("lat p50/p99 ms", f"{ol['latency_p50_ms']:.1f}/{ol['latency_p99_ms']:.1f}"),
            ("origin p50 ms (<=1)", f"{ol['origin_p50_ms']:.3f} {_yes(ol['meets']['origin_p50'])}"),
            ("origin p99 ms (<=5)", f"{ol['origin_p99_ms']:.3f} {_yes(ol['meets']['origin_p99'])}"),
            ("hand-off p50 ms (<=2)", f"{ol['handoff_p50_ms']:.3f} {_yes(ol['meets']['handoff_p50'])}"),
            ("hand-off p99 ms", f"{ol['handoff_p99_ms']:.3f}"),
            ("redis/req raw", f"{ol['redis_cmds_per_req_raw']}"),
            ("redis/req net (<=12)", f"{ol['redis_cmds_per_req_net']} {_yes(ol['meets']['redis_net'])}"),
            ("gw CPU ms/req raw/net", f"{ol['gateway_cpu_ms_per_req']}/{ol['gateway_cpu_ms_per_req_net']}"),
            ("cores gw/wk/redis/client", _cores(ol)),
            ("deaths", str(ol.get("deaths_during", 0))),
        ]
        title = f"1. open loop {ol['rate']:g} req/s x {ol['duration_s']:g} s, 2 replicas"
        t = table(title, [name for name, _ in cols])
        t.add_row(*(v for _, v in cols))
        console.print(t)
    e = results.get("e2e")
    if e:
        t = table(
            f"2. end-to-end, {e['n']} sequential requests each "
            f"({PROMPT_TOKENS} tokens in, {MAX_NEW_TOKENS} out)",
            ("path", "p50 ms", "p99 ms", "errors"),
        )
        t.add_row(
            "gateway", f"{e['gateway_p50_ms']:.2f}", f"{e['gateway_p99_ms']:.2f}", _err(e["gateway_errors"])
        )
        t.add_row(
            "direct", f"{e['direct_p50_ms']:.2f}", f"{e['direct_p99_ms']:.2f}", _err(e["direct_errors"])
        )
        t.add_row("added", f"{e['added_p50_ms']:.2f}", f"{e['added_p99_ms']:.2f}", "")
        console.print(t)
    cl = results.get("closed_loop")
    if cl:
        t = table(
            "3. closed loop",
            (
                "clients",
                "req/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "gw CPU ms/req",
                "cores gw/wk/redis/client",
                "deaths",
            ),
        )
        for r in cl:
            t.add_row(
                str(r["concurrency"]),
                f"{r['rps']}",
                f"{r['latency_p50_ms']:.1f}",
                f"{r['latency_p99_ms']:.1f}",
                _err(r["errors"]),
                f"{r['gateway_cpu_ms_per_req']}",
                _cores(r),
                str(r.get("deaths_during", 0)),
            )
        console.print(t)
    for inc in results.get("incidents", []):
        console.print(f"[red]died ({inc['seen']}): {inc['process']} rc={inc['rc']}")
    for k, v in results.get("errors", {}).items():
        console.print(f"[red]{k} failed: {v}")


def _cores(d: dict[str, Any]) -> str:
    return "/".join(
        f"{d.get(k, float('nan')):.2f}"
        for k in ("gateways_cores", "workers_cores", "redis_cores", "client_cores")
    )


def summary_md(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        "# Gateway overhead summary",
        "",
        f"{results['started_at']}, {'quick' if cfg['quick'] else 'full'} run, {cfg['cpus']} CPUs, "
        f"load average before/after {cfg['loadavg_before']} / {results.get('loadavg_after')}, "
        f"{cfg['redis']} Redis, schedule `{cfg.get('schedule', 'batching')}`. "
        f"Workers: `{' '.join(cfg['worker_args'])}`. "
        f"Ownership: {results.get('ownership')}.",
        "",
    ]
    ol = results.get("open_loop")
    if ol:
        m = ol["meets"]
        lines += [
            f"## 1. Open loop, {ol['rate']:g} req/s for {ol['duration_s']:g} s over 2 replicas",
            "",
            "| metric | value | target |",
            "|---|---|---|",
            f"| scheduled / sent / ok | {ol['scheduled']} / {ol['sent']} / {ol['ok']} | |",
            f"| errors | {_err(ol['errors'])} | 0 |",
            f"| client latency p50 / p99 ms | {ol['latency_p50_ms']:.2f} / {ol['latency_p99_ms']:.2f} | |",
            f"| origin overhead p50 ms | {ol['origin_p50_ms']:.3f} | <= 1 ({_yes(m['origin_p50'])}) |",
            f"| origin overhead p99 ms | {ol['origin_p99_ms']:.3f} | <= 5 ({_yes(m['origin_p99'])}) |",
            f"| hand-off latency p50 ms | {ol['handoff_p50_ms']:.3f} | <= 2 ({_yes(m['handoff_p50'])}) |",
            f"| hand-off latency p99 ms | {ol['handoff_p99_ms']:.3f} | |",
            f"| Redis commands / request, raw | {ol['redis_cmds_per_req_raw']} | |",
            f"| Redis commands / request, net of idle | {ol['redis_cmds_per_req_net']} | "
            f"<= 12 ({_yes(m['redis_net'])}) |",
            f"| gateway CPU ms / request, raw / net of idle | {ol['gateway_cpu_ms_per_req']} / "
            f"{ol['gateway_cpu_ms_per_req_net']} | |",
            f"| completions / s (first send to last answer) | {ol['completed_per_s']} | |",
            f"| cores: gateways / workers / redis / client | {_cores(ol)} | |",
            f"| worker deaths during the phase | {ol.get('deaths_during', 0)} | 0 |",
            "",
            f"Idle Redis rate {results['idle']['total_per_s']} commands/s and idle gateway CPU "
            f"{results['idle']['gateways_cores']} cores (both replicas, "
            f"{results['idle']['window_s']} s window), subtracted over the "
            f"{ol['redis_window_s']} s loaded window.",
            "",
        ]
    e = results.get("e2e")
    if e:
        lines += [
            f"## 2. End-to-end, {e['n']} sequential requests per path",
            "",
            "| path | p50 ms | p99 ms | errors |",
            "|---|---|---|---|",
            f"| gateway | {e['gateway_p50_ms']:.2f} | {e['gateway_p99_ms']:.2f} | "
            f"{_err(e['gateway_errors'])} |",
            f"| direct to workers | {e['direct_p50_ms']:.2f} | {e['direct_p99_ms']:.2f} | "
            f"{_err(e['direct_errors'])} |",
            f"| added by the gateway | {e['added_p50_ms']:.2f} | {e['added_p99_ms']:.2f} | |",
            "",
            f"Unloaded origin overhead p50 {e['unloaded_origin_p50_ms']} ms, hand-off p50 "
            f"{e['unloaded_handoff_p50_ms']} ms. Worker deaths during the phase: "
            f"{e.get('deaths_during', 0)}.",
            "",
        ]
    cl = results.get("closed_loop")
    if cl:
        lines += [
            "## 3. Closed loop",
            "",
            "| clients | req/s | p50 ms | p99 ms | errors | gateway CPU ms/req | deaths during |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['concurrency']} | {r['rps']} | {r['latency_p50_ms']:.1f} | {r['latency_p99_ms']:.1f} | "
            f"{_err(r['errors'])} | {r['gateway_cpu_ms_per_req']} | {r.get('deaths_during', 0)} |"
            for r in cl
        ]
        lines.append("")
    for inc in results.get("incidents", []):
        lines.append(f"**died** ({inc['seen']}): {inc['process']} rc={inc['rc']}: `{inc['log_tail'][-300:]}`")
    if results.get("incidents"):
        lines.append("")
    for k, v in results.get("errors", {}).items():
        lines.append(f"**{k} failed:** {v}")
    return "\n".join(lines) + "\n"


# END
