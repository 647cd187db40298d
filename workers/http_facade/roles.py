"""The facade's two request roles: prefill (answers with where the KV is) and decode (fetches
that KV from the prefill facade, then streams tokens), in each router's wire shape.

Kept apart from the HTTP app (server.py) so the role logic reads as the peers see it: what a
prefill answer must carry for sglang-router's bootstrap rooms and vllm-router's
`kv_transfer_params`, and what a decode request must find before it can start.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.protocol.codes import EngineStatus
from workers.http_facade import wire
from workers.http_facade.wire import TOK, KvInfo

if TYPE_CHECKING:  # server.py imports this module to serve requests
    from workers.http_facade.server import Facade


async def serve_prefill(
    f: Facade, body: dict[str, Any], rid: str, ids: list[int], openai: bool, stream: bool, t0: float
) -> Response:
    room = body.get("bootstrap_room")
    key = f"room:{room}" if room is not None else f"rid:{rid}"
    fut = f.room(key)
    try:
        res = await f.prefill(rid, ids)
    except Exception as exc:
        if not fut.done():
            fut.set_result(KvInfo(rid, len(ids), 0, 0, f.name, "engine_error", str(exc)))
        return JSONResponse({"error": {"message": str(exc), "code": "engine_error"}}, status_code=500)
    info = KvInfo(rid, res.input_tokens, res.cached_tokens, res.first_token, f.name, res.status, res.error)
    if not fut.done():
        fut.set_result(info)
    if res.status != EngineStatus.OK:
        return JSONResponse({"error": {"message": res.error, "code": res.status}}, status_code=500)
    ktp = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": rid,
        "remote_block_ids": [],
        "remote_host": f.host,
        "remote_port": f.port,
        "tp_size": 1,
    }
    text = TOK.decode([res.first_token])
    usage = wire.usage(len(ids), 1, res.cached_tokens, f.name, None)
    if openai:
        doc = wire.completion(rid, f.model, text, "length", t0) | {"usage": usage, "kv_transfer_params": ktp}
    else:
        doc = {
            "text": text,
            "output_ids": [res.first_token],
            "meta_info": wire.meta(rid, len(ids), 1, res.cached_tokens),
        }
    if not stream:
        return JSONResponse(doc)

    async def one() -> AsyncIterator[bytes]:
        yield wire.sse(doc)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(one(), media_type="text/event-stream")


async def serve_decode(
    f: Facade,
    body: dict[str, Any],
    rid: str,
    ids: list[int],
    max_new: int,
    openai: bool,
    stream: bool,
    t0: float,
) -> Response:
    ktp = body.get("kv_transfer_params") or {}
    try:
        if body.get("bootstrap_room") is not None:
            host = str(body.get("bootstrap_host") or "127.0.0.1")
            kv = await f.fetch_kv(host, int(body["bootstrap_port"]), str(body["bootstrap_room"]), "room")
        elif ktp.get("remote_engine_id"):
            kv = await f.fetch_kv(
                str(ktp.get("remote_host") or "127.0.0.1"),
                int(ktp["remote_port"]),
                str(ktp["remote_engine_id"]),
                "request_id",
            )
        else:
            need = "decode facade needs bootstrap_room or kv_transfer_params"
            return JSONResponse({"error": {"message": need, "code": "invalid_request"}}, status_code=400)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        return JSONResponse(
            {"error": {"message": f"KV fetch failed: {exc!r}", "code": "kv_fetch"}}, status_code=502
        )
    if kv.status != EngineStatus.OK:
        return JSONResponse({"error": {"message": kv.error, "code": kv.status}}, status_code=502)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage")) or not openai
    gen = f.decode(rid, kv, max_new)
    if not stream:
        out: list[int] = []
        try:
            async for toks in gen:
                out.extend(toks)
        except RuntimeError as exc:
            return JSONResponse({"error": {"message": str(exc), "code": "engine_error"}}, status_code=500)
        usage = wire.usage(len(ids), len(out), kv.cached_tokens, kv.prefill_worker, f.name)
        if openai:
            return JSONResponse(
                wire.completion(rid, f.model, TOK.decode(out), "length", t0) | {"usage": usage}
            )
        return JSONResponse(
            {
                "text": TOK.decode(out),
                "output_ids": out,
                "meta_info": wire.meta(rid, len(ids), len(out), kv.cached_tokens),
            }
        )

    async def events() -> AsyncIterator[bytes]:
        out: list[int] = []
        try:
            async for toks in gen:
                out.extend(toks)
                if openai:
                    yield wire.sse(wire.completion(rid, f.model, TOK.decode(toks), None, t0, chunk=True))
                else:
                    yield wire.sse(
                        {
                            "text": TOK.decode(out),
                            "output_ids": toks,
                            "meta_info": wire.meta(rid, len(ids), len(out), kv.cached_tokens),
                        }
                    )
        except RuntimeError as exc:
            yield wire.sse({"error": {"message": str(exc), "code": "engine_error"}})
            return
        if openai:
            yield wire.sse(wire.completion(rid, f.model, "", "length", t0, chunk=True))
            if include_usage:
                usage = wire.usage(len(ids), len(out), kv.cached_tokens, kv.prefill_worker, f.name)
                yield wire.sse(
                    wire.completion(rid, f.model, "", None, t0, chunk=True) | {"choices": [], "usage": usage}
                )
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
