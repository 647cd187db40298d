"""The peer routers' sequential phase for bench/router_overhead.py, run in the load generator's
process (`_gw_loadgen.LoadGen`, which imports this module when asked for a `peer_` op).

"Straight to the workers" for a peer is what that router itself sends the facades for one request,
made by the client with no router between (so the difference is the router's own cost):
- sglang-router (P/D): the same body, plus `bootstrap_host`/`bootstrap_port`/`bootstrap_room`,
  to the prefill and the decode facade at once; the answer is the decode facade's.
- vllm-router (P/D): the body with `max_tokens: 1` and `kv_transfer_params.do_remote_decode` to the
  prefill facade, then the body with the `kv_transfer_params` of its answer to the decode facade.
The facades' own exchange (the decode facade fetching and releasing the KV over the prefill
facade's bootstrap port) happens on both paths alike.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import numpy as np
from _gw_loadgen import _Clients, _n_out, _one, _peer_doc
from lean_http import HttpError


def _code(status: int, raw: bytes, max_new: int | None) -> tuple[str, dict[str, Any]]:
    """('ok' or an error code, the parsed answer); `max_new=None` skips the token count."""
    try:
        o = json.loads(raw)
    except ValueError:
        return ("bad_json" if status == 200 else f"http_{status}"), {}
    if status != 200:
        return f"http_{status}", o
    if max_new is not None and _n_out(o, "completions") != max_new:
        return "bad_output", o
    return "ok", o


async def _post(client: _Clients, url: str, doc: dict[str, Any]) -> tuple[int, bytes]:
    return await client.pool(url).post("/v1/completions", json.dumps(doc).encode())


async def _direct_sglang(
    client: _Clients, pre: tuple[str, int], dec: str, doc: dict[str, Any], max_new: int
) -> str:
    url, bport = pre
    room = random.getrandbits(63)
    pd = doc | {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    (ps, praw), (ds, draw) = await asyncio.gather(_post(client, url, pd), _post(client, dec, pd))
    pcode, _ = _code(ps, praw, None)
    if pcode != "ok":
        return f"prefill:{pcode}"
    return _code(ds, draw, max_new)[0]


async def _direct_vllm(
    client: _Clients, pre: tuple[str, int], dec: str, doc: dict[str, Any], max_new: int
) -> str:
    ktp = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    ps, praw = await _post(client, pre[0], doc | {"max_tokens": 1, "kv_transfer_params": ktp})
    pcode, po = _code(ps, praw, None)
    if pcode != "ok":
        return f"prefill:{pcode}"
    ds, draw = await _post(client, dec, doc | {"kv_transfer_params": po.get("kv_transfer_params")})
    return _code(ds, draw, max_new)[0]


async def _direct_vllm_calls(
    client: _Clients, pre: tuple[str, int], dec: str, doc: dict[str, Any], max_new: int
) -> str:
    """vllm-router's whole exchange: first `/v1/completions/render` and `/tokenize` on the prefill
    and the decode server, one after the other (the facades answer 404 at once, as vllm-router
    expects from a server without them), then `_direct_vllm`."""
    body = json.dumps(doc).encode()
    for path in ("/v1/completions/render", "/tokenize"):
        for url in (pre[0], dec):
            await client.pool(url).post(path, body)
    return await _direct_vllm(client, pre, dec, doc, max_new)


DIRECT = {"sglang": _direct_sglang, "vllm": _direct_vllm, "vllm_calls": _direct_vllm_calls}


async def lg_peer_e2e(
    urls: list[str],
    style: str,
    prefill: list[tuple[str, int]],
    decode: list[str],
    n: int,
    n_tokens: int,
    max_new: int,
    seed: int,
    also: str | None = None,
) -> dict[str, Any]:
    """n sequential requests through the router interleaved with n straight to the facades by
    `style` (and, with `also`, n more by that style: vllm-router's exchange with its extra calls),
    each a fresh random prompt (no prefix-cache hits on either path); `lg_e2e`'s answer's shape."""
    rng = np.random.default_rng(seed)
    gw_ms: list[float] = []
    gw_codes: Counter[str] = Counter()
    ms: dict[str, list[float]] = {s: [] for s in (style, also) if s}
    codes: dict[str, Counter[str]] = {s: Counter() for s in ms}
    async with _Clients(8) as client:
        for i in range(n):
            doc = _peer_doc(rng, n_tokens, max_new)
            t = time.perf_counter()
            code = await _one(client, urls[i % len(urls)], json.dumps(doc).encode(), max_new, "completions")
            gw_codes[code] += 1
            if code == "ok":
                gw_ms.append((time.perf_counter() - t) * 1000)
            for s in ms:
                doc = _peer_doc(rng, n_tokens, max_new)
                pre, dec = tuple(prefill[i % len(prefill)]), decode[i % len(decode)]
                t = time.perf_counter()
                try:
                    code = await DIRECT[s](client, pre, dec, doc, max_new)  # type: ignore[arg-type]
                except HttpError as exc:
                    code = f"transport:{type(exc).__name__}"
                codes[s][code] += 1
                if code == "ok":
                    ms[s].append((time.perf_counter() - t) * 1000)
    return {
        "gateway_ms": gw_ms,
        "direct_ms": ms[style],
        "also_ms": ms[also] if also else [],
        "gateway_codes": dict(gw_codes),
        "direct_codes": dict(codes[style]),
        "also_codes": dict(codes[also]) if also else {},
    }


OPS = {"peer_e2e": lg_peer_e2e}
