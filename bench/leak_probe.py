"""Does a gateway replica's memory grow with requests served? (docs/benchmarks.md "Growth per
request"). One replica, 1 prefill + 1 decode zero-time worker, an embedded Redis; a closed loop of
`--concurrency` clients sends a mix of distinct requests (native / completions / chat, half
streaming, half with a distinct client request id, a few client disconnects and cancels). After a
warm-up and after each phase the load stops, in-flight requests drain, `--settle` seconds pass, and
the gateway (started with bench/_leak_hook on its PYTHONPATH) writes a gc type histogram, the sizes
of its app containers, RSS and (with --tracemalloc) a tracemalloc snapshot. The report is the growth
per 1,000 requests between snapshots:

    nice -n 10 .venv/bin/python bench/leak_probe.py --phases 1000,5000,15000 --tracemalloc \
        --output /tmp/leak/run1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib
import itertools

from _gw_cluster import KV_TTL_ARGS, WORKER_ARGS, setup_cluster
from _harness import ROOT, Proc, console, start_workers

HOOK = ROOT / "bench" / "_leak_hook"
MEM_SHOWN = {  # the allocator figures printed per phase (all of them go to results.json)
    "uordblks",
    "fordblks",
    "arena",
    "hblkhd",
    "arenas",
    "Threads",
    "RssAnon",
    "py_arenas",
    "py_alloc_bytes",
    "trim_ms",
    "RssAnon_trimmed",
    "fordblks_trimmed",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="1000,5000,15000", help="requests per phase; the first is warm-up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--settle", type=float, default=5.0, help="seconds between drain and snapshot")
    p.add_argument("--tracemalloc", action="store_true", help="tracemalloc in the gateway (slower)")
    p.add_argument("--schedule", choices=["direct", "batching"], default="direct")
    p.add_argument("--output", type=Path, default=Path("/tmp/leak/run"))
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="the workers' KV (a small one fills the cache mirror, which it bounds, within the run)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--trim", action="store_true", help="malloc_trim(0) after each snapshot's figures, then measure again"
    )
    p.add_argument("--no-walk", action="store_true", help="skip the container walk (its peak stays in RSS)")
    p.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="K=V",
        help="extra environment for the gateway (and workers), e.g. MALLOC_ARENA_MAX=2, PYTHONMALLOC=malloc",
    )
    return p.parse_args()


class Load:
    """The request mix; every prompt and client id distinct."""

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.i = 0
        self.codes: dict[str, int] = {}
        self.prefixes = ["".join(self.rng.choice("abcdefghij ") for _ in range(300)) for _ in range(10)]

    async def one(self, c: httpx.AsyncClient) -> None:
        rng, i = self.rng, self.i
        self.i += 1
        kind = rng.choice(["gen", "gen_s", "cmpl", "cmpl_s", "chat", "chat_s"])
        stream = kind.endswith("_s")
        prompt = rng.choice(self.prefixes) + f" req {i} " + uuid.uuid4().hex * rng.randint(1, 4)
        mnt = rng.choice([1, 4, 8, 16])
        rid = f"leak-{i}-{uuid.uuid4().hex[:8]}" if rng.random() < 0.5 else None
        disconnect = rng.random() < 0.03
        cancel = rid is not None and rng.random() < 0.04
        headers: dict[str, str] = {}
        body: dict[str, Any]
        if kind.startswith("gen"):
            path = "/v1/generate"
            body = {"prompt": prompt, "max_new_tokens": mnt, "stream": stream, "timeout_ms": 30000}
            if rid:
                body["request_id"] = rid
        else:
            path = "/v1/completions" if kind.startswith("cmpl") else "/v1/chat/completions"
            body = {"model": "flexlb-sim", "max_tokens": mnt, "stream": stream}
            if kind.startswith("cmpl"):
                body["prompt"] = prompt
            else:
                body["messages"] = [{"role": "user", "content": prompt}]
            if rid:
                headers["x-request-id"] = rid
        canceller = None
        if cancel:

            async def do_cancel() -> None:
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                with contextlib.suppress(httpx.HTTPError):
                    await c.delete(self.url + f"/v1/requests/{rid}")

            canceller = asyncio.create_task(do_cancel())
        code = "?"
        try:
            if stream:
                async with c.stream("POST", self.url + path, json=body, headers=headers) as r:
                    code = str(r.status_code)
                    n = 0
                    async for _line in r.aiter_lines():
                        n += 1
                        if disconnect and n >= 2:
                            code = "disc"
                            break
            elif disconnect:
                try:
                    r = await c.post(self.url + path, json=body, headers=headers, timeout=0.01)
                    code = str(r.status_code)
                except httpx.TimeoutException:
                    code = "disc"
            else:
                r = await c.post(self.url + path, json=body, headers=headers)
                code = str(r.status_code)
        except httpx.HTTPError as e:
            code = type(e).__name__
        self.codes[code] = self.codes.get(code, 0) + 1
        if canceller is not None:
            await canceller

    async def run(self, n: int, concurrency: int) -> float:
        t0 = time.monotonic()
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits) as c:
            left = n

            async def client() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await self.one(c)

            await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.monotonic() - t0


def snapshot(folder: Path, label: str, timeout: float = 120.0) -> dict[str, Any]:
    (folder / f"req-{label}").write_text("")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = folder / f"{label}.json"
        if p.exists():
            return json.loads(p.read_text())
        time.sleep(0.2)
    raise RuntimeError(f"no snapshot {label}")


def diff(a: dict[str, int], b: dict[str, int], per: float, top: int) -> list[tuple[str, float, int]]:
    keys = set(a) | set(b)
    d = [(k, (b.get(k, 0) - a.get(k, 0)) / per, b.get(k, 0)) for k in keys]
    d = [x for x in d if x[1] != 0]
    d.sort(key=lambda x: -abs(x[1]))
    return [(k, round(v, 2), n) for k, v, n in d[:top]]


def tm_diff(folder: Path, a: str, b: str, per: float, top: int = 15) -> list[tuple[str, float, int]]:
    p, q = folder / f"{a}.tm", folder / f"{b}.tm"
    if not (p.exists() and q.exists()):
        return []
    sa = tracemalloc.Snapshot.load(str(p))
    sb = tracemalloc.Snapshot.load(str(q))
    out = []
    for st in sb.compare_to(sa, "lineno")[:top]:
        fr = st.traceback[0]
        out.append(
            (
                f"{fr.filename.replace(str(ROOT) + '/', '')}:{fr.lineno}",
                round(st.size_diff / 1024 / per, 2),
                st.count_diff,
            )
        )
    return out


def main() -> int:
    args = parse_args()
    out: Path = args.output
    snaps = out / "snaps"
    snaps.mkdir(parents=True, exist_ok=True)
    for stale in snaps.iterdir():  # an earlier run's requests would be answered at start-up
        stale.unlink()
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH", "")]))
    os.environ["LEAK_DIR"] = str(snaps)
    if args.tracemalloc:
        os.environ["LEAK_TRACEMALLOC"] = "1"
    if args.trim:
        os.environ["LEAK_TRIM"] = "1"
    if args.no_walk:
        os.environ["LEAK_WALK"] = "0"
    for kv_env in args.gateway_env:
        k, _, v = kv_env.partition("=")
        os.environ[k] = v
    phases = [int(x) for x in args.phases.split(",")]
    cluster = f"leak-{uuid.uuid4().hex[:8]}"
    from app.state.embedded_redis import start_embedded_redis

    emb = start_embedded_redis(cluster, idle_s=3600)
    procs: list[Proc] = []
    results: dict[str, Any] = {
        "loadavg_before": os.getloadavg(),
        "phases": phases,
        "args": vars(args) | {"output": str(out)},
    }
    ns = argparse.Namespace(
        prefill=1, decode=1, replicas=1, gateway_procs=1, gateway_log_level="INFO", schedule=args.schedule
    )
    try:
        kv = ["--kv-capacity-tokens", str(args.kv_capacity_tokens)] if args.kv_capacity_tokens else []
        wargs = [*WORKER_ARGS, *KV_TTL_ARGS, *kv]
        workers = start_workers([("prefill", wargs), ("decode", wargs)], log_dir)
        procs.extend(workers)
        gws, _workers = setup_cluster(ns, log_dir, emb.url, cluster, procs, results, workers)
        gw = gws[0]
        load = Load(gw.url, args.seed)
        snaps_got = []
        served = 0
        for k, n in enumerate(phases):
            wall = asyncio.run(load.run(n, args.concurrency))
            served += n
            time.sleep(args.settle)
            s = snapshot(snaps, f"p{k}")
            s["served"] = served
            s["wall_s"] = round(wall, 1)
            s["codes"] = dict(load.codes)
            snaps_got.append(s)
            console.print(
                f"phase {k}: {n} req in {wall:.1f} s, served {served}, objects {s['gc_objects']}, "
                f"rss {s['rss_kib']} KiB, tm {s.get('tracemalloc_kib')} KiB, codes {load.codes}"
            )
            m = s.get("mem", {})
            console.print(f"  mem {json.dumps({k: v for k, v in m.items() if k in MEM_SHOWN})}")
        rows = []
        for a, b in itertools.pairwise(snaps_got):
            per = (b["served"] - a["served"]) / 1000
            rows.append(
                {
                    "from": a["served"],
                    "to": b["served"],
                    "objects_per_1k": round((b["gc_objects"] - a["gc_objects"]) / per, 1),
                    "rss_kib_per_1k": round((b["rss_kib"] - a["rss_kib"]) / per, 1),
                    "tm_kib_per_1k": round(
                        (b.get("tracemalloc_kib", 0) - a.get("tracemalloc_kib", 0)) / per, 2
                    ),
                    "mem_kib_per_1k": {
                        k: round((b["mem"][k] - a["mem"].get(k, 0)) / per, 1)
                        for k in b.get("mem", {})
                        if k in a.get("mem", {}) and not k.startswith(("Threads", "arenas", "trim_"))
                    },
                    "types_per_1k": diff(a["hist"], b["hist"], per, 15),
                    "containers_per_1k": diff(a["sizes"], b["sizes"], per, 15),
                    "tracemalloc_per_1k": tm_diff(snaps, a["label"], b["label"], per),
                }
            )
        results["rows"] = rows
        results["snaps"] = [{k: v for k, v in s.items() if k not in ("hist", "sizes")} for s in snaps_got]
    finally:
        for p in procs:
            p.stop()
        emb.stop()
    results["loadavg_after"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results.get("rows", []), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
