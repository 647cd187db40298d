"""Benchmark of the real model engine (`--engine hf`, docs/worker-protocol.md §13).

Why: the real engine's claims are that a batch is one forward pass (so batching pays), that decode
steps run batched (continuous batching, not one sequence after another), that KV moves between the
workers fast enough to matter little, and that a prefix hit saves real compute. Each is measured:

- prefill tokens/s at batch 1 and 8 (`HfModel.prefill`, the engine's forward pass);
- decode tokens/s at 1 / 8 / 32 streams, batched (one forward pass per step for all) versus
  one-at-a-time (a forward pass per sequence per step);
- KV transfer MB/s over the real side channel (`KvClaimServer`/`KvClaimClient` on localhost TCP,
  encode + send + receive + checks + decode of kv_frames);
- TTFT of a prefix-hit request versus a miss, through a real prefill worker (`flexlb worker
  --engine hf`) and the gRPC client: the prefill call's send → `results`.

Models: the tiny one (`flexlb make-tiny-model`: 2 layers, hidden 128) and a ~76M-parameter random
Llama (12 layers, hidden 768), both written here by `save_pretrained`.

    nice -n 10 .venv/bin/python bench/real_engine.py [--quick] [--device cpu|cuda] [--dtype ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engine.hf_model import HfModel, Sampling, make_tiny_model  # noqa: E402
from workers.server import kv_frames  # noqa: E402
from workers.server.kv_channel import KvClaimClient, KvClaimServer  # noqa: E402

MODELS = {
    "tiny": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2},
    "76m": {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 4, "intermediate": 2048},
}


def timed(fn: Any, repeat: int) -> float:
    """Median wall seconds of `repeat` calls (after one warm-up)."""
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def prompts(n: int, length: int, salt: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(salt)
    return [rng.integers(32, 127, length).tolist() for _ in range(n)]


def bench_prefill(m: HfModel, length: int, repeat: int) -> dict[str, float]:
    out = {}
    for b in (1, 8):
        ps = prompts(b, length, b)
        s = timed(lambda ps=ps: m.prefill([(None, p) for p in ps]), repeat)
        out[f"batch{b}_tok_s"] = round(b * length / s, 1)
    return out


def bench_decode(m: HfModel, ctx: int, steps: int) -> dict[str, float]:
    out = {}
    for n in (1, 8, 32):
        res = m.prefill([(None, p) for p in prompts(n, ctx, 100 + n)])
        kvs = [kv for _, kv in res]

        def batched(kvs: list[torch.Tensor] = kvs, n: int = n) -> float:
            b = m.new_decode_batch([str(i) for i in range(n)], kvs, [65] * n)
            t0 = time.perf_counter()
            for _ in range(steps):
                lg = m.decode_step(b)
                b.last = torch.argmax(lg, dim=-1).tolist()
            return time.perf_counter() - t0

        def one_at_a_time(kvs: list[torch.Tensor] = kvs, n: int = n) -> float:
            bs = [m.new_decode_batch([str(i)], [kv], [65]) for i, kv in enumerate(kvs)]
            t0 = time.perf_counter()
            for _ in range(steps):
                for b in bs:
                    lg = m.decode_step(b)
                    b.last = torch.argmax(lg, dim=-1).tolist()
            return time.perf_counter() - t0

        batched()  # warm-up
        out[f"streams{n}_batched_tok_s"] = round(
            n * steps / statistics.median(batched() for _ in range(3)), 1
        )
        out[f"streams{n}_sequential_tok_s"] = round(n * steps / one_at_a_time(), 1)
    return out


async def _transfer(m: HfModel, tokens: int, repeat: int) -> dict[str, float]:
    kv = m.prefill([(None, prompts(1, tokens, 7)[0])])[0][1]
    frame = kv_frames.encode(kv_frames.KvFrame("r", kv, 1, Sampling()))

    async def fetch(rid: str, epoch: str) -> tuple[str, bytes | None]:
        data = await asyncio.to_thread(kv_frames.encode, kv_frames.KvFrame(rid, kv, 1, Sampling()))
        return "ok", data

    async def never(*_: Any) -> str:
        return "unknown_request"

    server = KvClaimServer(never, fetch)
    await server.start("127.0.0.1", 0)
    client = KvClaimClient(lambda _peer: _endpoint(server), never, timeout_s=60)
    times = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        status, data = await client.fetch("peer", f"r{i}", "")
        assert status == "ok" and data is not None
        got = await asyncio.to_thread(kv_frames.decode, data)
        assert got.kv.shape == kv.shape
        if i:
            times.append(time.perf_counter() - t0)
    await client.close()
    await server.close()
    return {
        "tokens": tokens,
        "frame_mb": round(len(frame) / 1e6, 3),
        "mb_s": round(len(frame) / 1e6 / statistics.median(times), 1),
        "ms": round(statistics.median(times) * 1000, 2),
    }


async def _endpoint(server: KvClaimServer) -> str:
    return f"127.0.0.1:{server.port}"


def bench_ttft(
    model_dir: Path, length: int, repeat: int, tmp: Path, device: str, dtype: str
) -> dict[str, Any]:
    """Through a real prefill worker: a miss, then a request sharing all but the last block."""
    sys.path.insert(0, str(ROOT / "tests"))
    from app.rpc.worker_client import WorkerClient
    from tests.conftest import start_worker

    w = start_worker(
        "prefill", tmp, "--engine", "hf", "--model", str(model_dir), "--block-size", "64",
        "--device", device, "--dtype", dtype, "--kv-handle-ttl-ms", "1000",
    )  # fmt: skip

    async def one(c: WorkerClient, bid: str, p: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        cached = 0
        async for ev in c.prefill(bid, w.epoch, [(bid, np.array(p, dtype=np.int32))]):
            if ev.event == "results":
                cached = int(ev.results[0]["cached_tokens"])
        return time.perf_counter() - t0, cached

    async def run() -> dict[str, Any]:
        c = WorkerClient(w.address)
        miss, hit, hit_cached = [], [], 0
        try:
            await one(c, "warm", prompts(1, length, 999)[0])
            for i in range(repeat):
                base = prompts(1, length, 1000 + i)[0]
                t, _ = await one(c, f"miss{i}", base)
                miss.append(t)
                t, hit_cached = await one(c, f"hit{i}", base[:-8] + [65] * 8)
                hit.append(t)
        finally:
            await c.close()
        return {
            "prompt_tokens": length,
            "hit_cached_tokens": hit_cached,
            "miss_ms": round(statistics.median(miss) * 1000, 2),
            "hit_ms": round(statistics.median(hit) * 1000, 2),
        }

    try:
        return asyncio.run(run())
    finally:
        w.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats and shorter prompts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--models", default="tiny,76m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the box is shared)")
    ap.add_argument("--output", default=str(ROOT / "bench" / "out" / "real_engine"))
    args = ap.parse_args()
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    repeat = 2 if args.quick else 5
    results: dict[str, Any] = {
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="flexlb-real-engine-") as tmp:
        for name in args.models.split(","):
            shape = MODELS[name]
            big = name != "tiny"
            d = make_tiny_model(Path(tmp) / name, seed=0, **shape)
            m = HfModel(d, device=args.device, dtype=args.dtype, threads=args.threads)
            length = 128 if (args.quick or big) else 512
            r: dict[str, Any] = {"params": m.params, "kv_bytes_per_token": m.kv_bytes_per_token}
            print(f"[{name}] {m.params / 1e6:.1f}M params", flush=True)
            r["prefill"] = {"prompt_tokens": length, **bench_prefill(m, length, repeat)}
            print(f"[{name}] prefill {r['prefill']}", flush=True)
            steps = 8 if args.quick else 32
            r["decode"] = {"context": 128, "steps": steps, **bench_decode(m, 128, steps)}
            print(f"[{name}] decode {r['decode']}", flush=True)
            r["kv_transfer"] = asyncio.run(_transfer(m, 1024, repeat))
            print(f"[{name}] kv transfer {r['kv_transfer']}", flush=True)
            r["ttft"] = bench_ttft(
                d, 1024 if not args.quick else 512, repeat, Path(tmp), args.device, args.dtype
            )
            print(f"[{name}] ttft {r['ttft']}", flush=True)
            results["models"][name] = r
            del m
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
