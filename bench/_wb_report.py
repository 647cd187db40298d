"""The workers benchmark's report: the console tables and summary.md."""

from __future__ import annotations

from math import nan
from typing import Any

from _harness import console, table
from _wb_decode import DELIVERY_TARGET
from _wb_ops import OVERHEAD_TARGET_MS


def _cores(d: dict[str, Any]) -> str:
    """CPU cores used by the worker's process tree / by this client while measuring."""
    return f"{d.get('worker_cores', nan):.2f}/{d.get('client_cores', nan):.2f}"


def render(results: dict[str, Any]) -> None:
    tp = results.get("prefill_throughput")
    if isinstance(tp, list):
        t = table(
            f"(a) prefill throughput, formula 0, {results['config']['concurrency']} streams in flight",
            (
                "batch",
                "prompt",
                "batches/s",
                "requests/s",
                "p50 ms",
                "p99 ms",
                "not ok",
                "cached",
                "cores w/c",
            ),
        )
        for r in tp:
            t.add_row(
                str(r["batch_size"]),
                str(r["prompt_tokens"]),
                f"{r['batches_per_s']:.1f}",
                f"{r['requests_per_s']:.1f}",
                f"{r['latency_p50_ms']:.1f}",
                f"{r['latency_p99_ms']:.1f}",
                str(r["not_ok"]),
                str(r["cached_tokens"]),
                _cores(r),
            )
        console.print(t)
    ov = results.get("prefill_overhead")
    if isinstance(ov, dict) and "added_ms_p50" in ov:
        t = table(
            f"(b) prefill path overhead, formula {ov['formula']}, batch {ov['batch_size']} x "
            f"{ov['prompt_tokens']}, sequential (target <= {OVERHEAD_TARGET_MS:g} ms)",
            (
                "batches",
                "modelled ms",
                "wall p50",
                "client hashes p50",
                "client hashes p99",
                "keys carried p50/p99",
                "token ids p50/p99",
                "send->accepted",
                "accepted->results -modelled",
                "results->final",
                "cores w/c",
                "ok",
            ),
        )
        t.add_row(
            str(ov["batches"]),
            f"{ov['modelled_ms_p50']:.1f}",
            f"{ov['wall_ms_p50']:.1f}",
            f"{ov['added_ms_p50']:.2f}",
            f"{ov['added_ms_p99']:.2f}",
            f"{ov.get('added_keys_given_ms_p50', nan):.2f}/{ov.get('added_keys_given_ms_p99', nan):.2f}",
            f"{ov.get('added_token_ids_ms_p50', nan):.2f}/{ov.get('added_token_ids_ms_p99', nan):.2f}",
            f"{ov['send_to_accepted_ms_p50']:.2f}",
            f"{ov['accepted_to_results_minus_modelled_ms_p50']:.2f}",
            f"{ov['results_to_final_ms_p50']:.2f}",
            _cores(ov),
            "yes" if ov["meets_target"] else "NO",
        )
        console.print(t)
    dec = results.get("decode_delivery")
    if isinstance(dec, list):
        t = table(
            f"(c) decode delivery, llama3.1-8b-h100, time scale 1 (target >= {DELIVERY_TARGET:.0%})",
            (
                "streams",
                "delivered tok/s",
                "modelled tok/s",
                "ratio",
                "chunk cfg",
                "chunk p50",
                "chunk p99",
                "tok/chunk",
                "lag p50",
                "lag p99",
                "cut",
                "cores w/c",
                "bad",
                "ok",
            ),
        )
        for d in dec:
            t.add_row(
                str(d["streams"]),
                f"{d['delivered_tokens_per_s']:.0f}",
                f"{d['modelled_tokens_per_s']:.0f}",
                f"{d['ratio']:.1%}",
                f"{d['chunk_interval_cfg_ms']:g}",
                f"{d['chunk_interval_p50_ms']:.1f}",
                f"{d['chunk_interval_p99_ms']:.1f}",
                f"{d['tokens_per_chunk_p50']:.0f}",
                f"{d['delivery_lag_p50_ms']:.1f}",
                f"{d['delivery_lag_p99_ms']:.1f}",
                f"{d['truncated_streams']}/{d['streams'] * d['reps']}",
                _cores(d),
                str(d["bad_streams"] + d["token_mismatch_streams"]),
                "yes" if d["meets_target"] else "NO",
            )
        console.print(t)
    for k, v in results.get("errors", {}).items():
        console.print(f"[red]{k} failed: {v}")


def summary_md(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        "# Worker bench summary",
        "",
        f"{results['started_at']}, {'quick' if cfg['quick'] else 'full'} run, {cfg['cpus']} CPUs, "
        f"load average before/after {cfg['loadavg_before']} / {results.get('loadavg_after')}.",
        "",
    ]
    tp = results.get("prefill_throughput")
    if isinstance(tp, list):
        lines += [
            f"## (a) Prefill throughput (formula 0, {cfg['concurrency']} streams in flight)",
            "",
            "| batch | prompt | batches/s | requests/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch_size']} | {r['prompt_tokens']} | {r['batches_per_s']:.1f} | "
            f"{r['requests_per_s']:.1f} | {r['latency_p50_ms']:.1f} | {r['latency_p99_ms']:.1f} |"
            for r in tp
        ]
        lines.append("")
    ov = results.get("prefill_overhead")
    if isinstance(ov, dict) and "added_ms_p50" in ov:
        lines += [
            f"## (b) Prefill path overhead (formula {ov['formula']}, batch {ov['batch_size']} x "
            f"{ov['prompt_tokens']})",
            "",
            f"Added wall ms over the modelled {ov['modelled_ms_p50']:.0f} ms, the gateway's path "
            f"(block keys carried from routing in the hand-off entry): median "
            f"**{ov.get('added_keys_given_ms_p50', nan):.2f}** (target <= {OVERHEAD_TARGET_MS:g} ms: "
            f"{'met' if ov['meets_target'] else 'NOT met'}). With the client hashing the keys: "
            f"median {ov['added_ms_p50']:.2f}, p99 {ov['added_ms_p99']:.2f}. Medians: send to `accepted` "
            f"{ov['send_to_accepted_ms_p50']:.2f} ms, `accepted` to `results` beyond the modelled time "
            f"{ov['accepted_to_results_minus_modelled_ms_p50']:.2f} ms, `results` to `final` "
            f"{ov['results_to_final_ms_p50']:.2f} ms (client hashing). Keys carried: p99 "
            f"{ov.get('added_keys_given_ms_p99', nan):.2f}; with token ids (the path before block "
            f"keys): median {ov.get('added_token_ids_ms_p50', nan):.2f}, "
            f"p99 {ov.get('added_token_ids_ms_p99', nan):.2f}.",
            "",
        ]
    dec = results.get("decode_delivery")
    if isinstance(dec, list):
        lines += [
            "## (c) Decode delivery (llama3.1-8b-h100, time scale 1)",
            "",
            "| streams | delivered tok/s | modelled tok/s | ratio | chunk p50 ms (cfg) | lag p50 ms |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {d['streams']} | {d['delivered_tokens_per_s']:.0f} | {d['modelled_tokens_per_s']:.0f} | "
            f"{d['ratio']:.1%} | {d['chunk_interval_p50_ms']:.1f} ({d['chunk_interval_cfg_ms']:g}) | "
            f"{d['delivery_lag_p50_ms']:.1f} |"
            for d in dec
        ]
        lines.append("")
    for k, v in results.get("errors", {}).items():
        lines.append(f"**{k} failed:** {v}")
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------
