"""Probe a live peer router's prefill choice with crafted prompts (docs/benchmarks.md, "Peer
imitations against the live routers").

Starts 2 prefill + 2 decode HTTP facades and sglang-router or vllm-router (from .venv-peers, as
bench/compare_routers.sh installs it) at `--log-level debug`, all on 127.0.0.1, then sends
sequential `/v1/completions` requests and prints which prefill facade served each and its cached
tokens. Scenarios:

- ``follow``: one prompt (shared prefix + unique tail), then ``--n`` follow-ups with the same
  prefix: a cache-aware router sends them back to the first one's worker.
- ``pair``: two concurrent prompts (one prefix per prefill worker when the router balances), then
  ``--n`` sequential follow-ups of each: tells a cache-aware choice from a load tie.

The router's log (`OUT/router.log`) has its decision records, e.g. sglang-router's "No tree found"
or vllm-router's "Cache prefix decision".

    .venv/bin/python bench/probe_peer_router.py --router sglang --n 12
    .venv/bin/python bench/probe_peer_router.py --router vllm --scenario pair --n 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT

from app.loadgen.prompts import PRINTABLE_COUNT, PRINTABLE_FIRST

PEERS = ROOT / ".venv-peers" / "bin"
VLLM_CLI = ["--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, needle: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and needle in path.read_text():
            return
        time.sleep(0.1)
    raise SystemExit(f"{path}: no {needle!r} within {timeout_s:.0f} s")


def text(tag: str, n: int) -> str:
    """``n`` printable-ASCII characters from ``tag`` alone (the replay's alphabet)."""
    d = hashlib.shake_256(tag.encode()).digest(n)
    return bytes(PRINTABLE_FIRST + b % PRINTABLE_COUNT for b in d).decode()


class Probe:
    """The facades and the router, and one request at a time through them."""

    def __init__(self, router: str, out: Path, extra: list[str]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill: list[int] = []
        args: list[str] = []
        decode: list[str] = []
        for i in range(4):
            port, role = _port(), "prefill" if i < 2 else "decode"
            cmd = [sys.executable, "-m", "workers.http_facade", "--role", role, "--port", str(port)]
            if role == "prefill":
                boot = _port()
                cmd += ["--bootstrap-port", str(boot)]
                self.prefill.append(port)
                args += ["--prefill", f"http://127.0.0.1:{port}"]
                args += [str(boot)] if router == "sglang" else []
            else:
                decode.append(f"http://127.0.0.1:{port}")
            self._spawn(cmd, out / f"facade-{i}.log")
        for u in decode:
            args += ["--decode", u]
        for i in range(4):
            _wait_for(out / f"facade-{i}.log", "facade_ready", 60)
        port = _port()
        common = ["--host", "127.0.0.1", "--port", str(port), *args, "--policy", "cache_aware"]
        if router == "sglang":
            cmd = [str(PEERS / "sglang-router"), "launch", "--pd-disaggregation", *common]
        else:
            cmd = [str(PEERS / "vllm-router"), "--vllm-pd-disaggregation", *common, *VLLM_CLI]
        self._spawn([*cmd, "--log-level", "debug", *extra], out / "router.log")
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(timeout=120)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if self.client.get(self.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("router not healthy within 60 s")

    def _spawn(self, cmd: list[str], log: Path) -> None:
        with log.open("w") as f:
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))

    def send(self, prompt: str, label: str) -> None:
        body = {"model": "flexlb-sim", "prompt": prompt, "max_tokens": 8, "stream": True}
        body["stream_options"] = {"include_usage": True}
        usage: dict[str, Any] = {}
        t0 = time.monotonic()
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    usage = json.loads(line[6:]).get("usage") or usage
            status = r.status_code
        served = str((usage.get("flexlb_workers") or {}).get("prefill"))
        worker = next((i + 1 for i, p in enumerate(self.prefill) if served.endswith(f":{p}")), served)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        print(
            f"{label:>8} {len(prompt):6d} chars  HTTP {status}  prefill worker {worker}  cached {cached}"
            f"  {time.monotonic() - t0:.2f} s",
            flush=True,
        )

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--scenario", choices=["follow", "pair"], default="follow")
    ap.add_argument("--prefix", type=int, default=16384, help="shared characters")
    ap.add_argument("--tail", type=int, default=6000, help="unique characters after the prefix")
    ap.add_argument("--n", type=int, default=3, help="follow-ups (per prefix)")
    ap.add_argument("--router-args", default="", help="extra router flags (word-split)")
    ap.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "probe_peer_router")
    a = ap.parse_args()
    a.output.mkdir(parents=True, exist_ok=True)
    salt = str(os.getpid()) + str(time.time())
    probe = Probe(a.router, a.output, a.router_args.split())
    try:

        def prompt(k: int, i: int) -> str:
            return text(f"{salt}S{k}", a.prefix) + text(f"{salt}T{k}.{i}", a.tail)

        if a.scenario == "follow":
            for i in range(a.n + 1):
                probe.send(prompt(0, i), "first" if i == 0 else f"follow{i}")
        else:
            firsts = [threading.Thread(target=probe.send, args=(prompt(k, 0), f"first{k}")) for k in (0, 1)]
            for t in firsts:
                t.start()
                time.sleep(0.05)
            for t in firsts:
                t.join()
            for i in range(1, a.n + 1):
                for k in (0, 1):
                    probe.send(prompt(k, i), f"f{k}.{i}")
    finally:
        probe.close()
    print(f"router log: {a.output / 'router.log'}")


if __name__ == "__main__":
    main()
