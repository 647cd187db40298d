"""One simulated prefill or decode GPU behind the HTTP API that sglang-router and vllm-router call.

Why a facade rather than a mock: the peer comparison must differ only in the router. The engine
core, its prefix cache (hits computed from the prompt's own blocks), timing profile and decode
continuous batching are FlexLB's `WorkerService` on its engine thread, exactly as inside the Triton
workers; only the transport differs.

What the routers need (learned from their docs and by watching their calls):
- discovery and health: `/health`, `/health_generate`, `/get_server_info`, `/get_model_info`,
  `/v1/models`, `/get_loads`, `/flush_cache`, `/metrics`;
- work: `/generate` (SGLang native) and `/v1/completions` (OpenAI), streamed or not;
- routing: `/tokenize` and `/v1/completions/render` (vllm-router's `cache_aware` scores token ids);
- P/D, SGLang style: the router sends the same request to a prefill and a decode server at once,
  with `bootstrap_host`/`bootstrap_port`/`bootstrap_room`. The prefill facade also listens on its
  bootstrap port; the decode facade asks it there for the room's KV (waiting until prefill ends),
  then models the transfer and decodes.
- P/D, vLLM style: the router first sends the request to prefill with `max_tokens: 1` and
  `kv_transfer_params.do_remote_decode`; the prefill answer carries `kv_transfer_params` naming
  where the KV is (`remote_host`/`remote_port`/`remote_engine_id`), which the router hands to the
  decode server with the original request.

Engine-side batching: queued prompts are dispatched together whenever fewer than two batches are
unfinished (one running, one waiting), as a real engine's scheduler admits every waiting prefill
at its next step; without it the peers would run batch size 1 against FlexLB's batcher.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.protocol.blocks import block_keys
from app.protocol.codes import EngineStatus
from workers.engine.decode import DecodeRequest
from workers.engine.effects import PrefillResult
from workers.engine.prefill import PrefillRequest
from workers.http_facade import roles, wire
from workers.http_facade.wire import TOK, KvInfo
from workers.server.runner import Subscriber
from workers.server.service import WorkerConfig, WorkerService

log = logging.getLogger("flexlb.facade")
MAX_INFLIGHT_BATCHES = 2
KV_WAIT_S = 600.0
STOP_GRACE_S = 5  # seconds a stopping facade gives its open requests


@dataclass
class _Pending:
    req: PrefillRequest
    fut: asyncio.Future[PrefillResult]


@dataclass
class Facade:
    svc: WorkerService
    name: str
    host: str
    port: int
    model: str
    bootstrap_port: int | None = None
    pending: list[_Pending] = field(default_factory=list)
    inflight: int = 0
    rooms: dict[str, asyncio.Future[KvInfo]] = field(default_factory=dict)
    http: httpx.AsyncClient | None = None
    served: int = 0

    # ---- prefill ----------------------------------------------------------------------------
    async def prefill(self, rid: str, ids: list[int]) -> PrefillResult:
        """Queue one prompt for the engine's next batch; its result when that batch ends."""
        keys = block_keys(ids, self.svc.cfg.block_size, model=self.model, tokenizer=TOK.name)
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(PrefillRequest(rid, len(ids), tuple(keys)), fut))
        self._flush()
        return await fut

    def _flush(self) -> None:
        if not self.pending or self.inflight >= MAX_INFLIGHT_BATCHES:
            return
        batch, self.pending = self.pending, []
        self.inflight += 1
        asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[_Pending]) -> None:
        bid = f"b-{uuid.uuid4().hex[:12]}"
        sub = Subscriber(asyncio.get_running_loop())
        futs = {p.req.request_id: p.fut for p in batch}
        try:
            reqs = [p.req for p in batch]
            await self.svc.runner.call(lambda: self.svc._submit_prefill(bid, reqs, sub))
            while True:
                item = await self.svc._next(sub)
                if item is None:
                    break
                kind, payload = item
                if kind == "results":
                    for r in payload:
                        f = futs.pop(r.request_id, None)
                        if f is not None and not f.done():
                            f.set_result(r)
                else:
                    break
        except Exception as exc:  # engine thread gone: fail the members, never hang them
            log.exception("prefill batch failed")
            for f in futs.values():
                if not f.done():
                    f.set_exception(exc)
        finally:
            for f in futs.values():
                if not f.done():
                    f.set_exception(RuntimeError("prefill batch ended without a result"))
            self.inflight -= 1
            self._flush()

    def room(self, key: str) -> asyncio.Future[KvInfo]:
        f = self.rooms.get(key)
        if f is None:
            f = self.rooms[key] = asyncio.get_running_loop().create_future()
        return f

    async def release(self, rid: str) -> str:
        out = await self.svc.runner.call(lambda: self.svc._release(rid))
        return str(out.get("status"))

    # ---- decode -----------------------------------------------------------------------------
    async def fetch_kv(self, host: str, port: int, key: str, via: str) -> KvInfo:
        """Ask the prefill facade for a room's (SGLang) or request's (vLLM) KV; release it there."""
        assert self.http is not None
        base = f"http://{host}:{port}/_facade"
        r = await self.http.get(f"{base}/kv", params={via: key}, timeout=KV_WAIT_S + 5)
        r.raise_for_status()
        info = KvInfo(**r.json())
        if info.status == EngineStatus.OK:
            rel = await self.http.post(f"{base}/release", json={"request_id": info.request_id}, timeout=10)
            if rel.json().get("status") != EngineStatus.OK:
                info.status, info.error = EngineStatus.KV_EXPIRED, "KV handle expired before the fetch"
        return info

    async def decode(self, rid: str, kv: KvInfo, max_new: int) -> AsyncIterator[list[int]]:
        """The first token (from prefill) at once, then the engine's decode chunks."""
        yield [kv.first_token]
        if max_new <= 1:
            return
        svc = self.svc
        sub = Subscriber(asyncio.get_running_loop())
        dreq = DecodeRequest(rid, kv.input_tokens, max_new - 1, first_index=1)
        await svc.runner.call(lambda: svc._submit_decode(dreq, sub))
        finished = False
        try:
            while True:
                item = await svc._next(sub)
                if item is None:
                    raise RuntimeError("decode stream idle or worker stopping")
                kind, ev = item
                if kind == "tokens":
                    yield list(ev.tokens)
                else:
                    finished = True
                    if ev.reason not in ("length", "stop"):
                        raise RuntimeError(f"decode ended {ev.reason}: {ev.error}")
                    return
        finally:
            if not finished:
                svc.runner.call_sync(lambda: svc._route(svc._core_d().cancel(rid, svc.runner.model_now())))


def create_app(f: Facade) -> FastAPI:
    app = FastAPI()
    role = f.svc.cfg.role

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "model_path": f.model,
            "served_model_name": f.model,
            "tokenizer_path": None,
            "disaggregation_mode": role,
            "disaggregation_bootstrap_port": f.bootstrap_port,
            "page_size": f.svc.cfg.block_size,
            "dp_size": 1,
            "tp_size": 1,
            "version": "flexlb-facade",
        }

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": f.model, "tokenizer_path": None, "is_generation": True}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f.model, "object": "model", "owned_by": "flexlb-facade"}]}

    @app.get("/get_loads")
    async def loads() -> dict[str, Any]:
        kv = f.svc.core.kv_view()
        return {"num_reqs": f.served, "num_waiting_reqs": len(f.pending), **kv}

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/v1/completions/render")
    @app.post("/tokenize")
    async def render(request: Request) -> Response:
        try:
            doc = wire.rendered(await request.json(), request.url.path, f.svc.profile.max_context_tokens)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": {"message": str(exc), "code": "invalid_request"}}, status_code=400)
        return JSONResponse(doc)

    @app.get("/_facade/status")
    async def status() -> dict[str, Any]:
        r = f.svc.runner
        return {
            "name": f.name,
            "role": role,
            "time_scale": r.time_scale,
            "block_size": f.svc.cfg.block_size,
            "lag_ms": r.lag_ms,
            "max_lag_ms": r.max_lag_ms,
            **f.svc.core.kv_view(),
        }

    @app.get("/_facade/kv")
    async def kv(room: str | None = None, request_id: str | None = None) -> dict[str, Any]:
        key = f"room:{room}" if room is not None else f"rid:{request_id}"
        fut = f.room(key)
        try:
            info = await asyncio.wait_for(asyncio.shield(fut), KV_WAIT_S)
        except TimeoutError:
            f.rooms.pop(key, None)
            return KvInfo("", 0, 0, 0, f.name, "timeout", "prefill never arrived").as_dict()
        f.rooms.pop(key, None)
        return info.as_dict()

    @app.post("/_facade/release")
    async def release(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"status": await f.release(str(body["request_id"]))}

    async def handle(request: Request, openai: bool) -> Response:
        body = await request.json()
        try:
            ids = wire.prompt_ids(body)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": {"message": str(exc), "code": "invalid_request"}}, status_code=400)
        rid = wire.rid(body, request)
        max_new = wire.max_new(body)
        stream = bool(body.get("stream"))
        f.served += 1
        t0 = time.time()
        if role == "prefill":
            return await roles.serve_prefill(f, body, rid, ids, openai, stream, t0)
        return await roles.serve_decode(f, body, rid, ids, max_new, openai, stream, t0)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await handle(request, openai=False)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, openai=True)

    return app


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket whose accepted connections get TCP_NODELAY from asyncio.

    asyncio sets TCP_NODELAY on accepted sockets only when the listener's protocol is
    IPPROTO_TCP; with protocol 0 replies stalled on Nagle + delayed ACK (~43 ms per exchange,
    ~87 ms per request through the facades' KV fetch and release, issue #20).
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    s.setblocking(False)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.http_facade", description=__doc__.split("\n")[0])
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int, default=None, help="prefill: SGLang bootstrap port")
    p.add_argument("--profile", default="llama3.1-8b-h100")
    p.add_argument("--formula", default=None)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument(
        "--kv-handle-ttl-ms", type=float, default=30_000.0, help="modelled ms a KV waits for decode"
    )
    p.add_argument("--model", default="flexlb-sim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper())
    cfg = WorkerConfig(
        role=a.role,
        host=a.host,
        grpc_port=a.port,
        profile=a.profile,
        formula=a.formula,
        time_scale=a.time_scale,
        block_size=a.block_size,
        kv_capacity_tokens=a.kv_capacity_tokens,
        kv_handle_ttl_ms=a.kv_handle_ttl_ms,
        seed=a.seed,
        model_name=a.model,
    )
    svc = WorkerService(cfg)
    name = f"{a.role}@{a.host}:{a.port}"
    facade = Facade(svc, name, a.host, a.port, a.model, a.bootstrap_port)
    app = create_app(facade)
    socks = [_listen(a.host, a.port)]
    if a.bootstrap_port:
        socks.append(_listen(a.host, a.bootstrap_port))

    async def serve() -> None:
        svc.start()
        facade.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=512))
        ucfg = uvicorn.Config(app, log_level=a.log_level, access_log=False, lifespan="off")
        # A decode facade's KV long-poll (up to KV_WAIT_S) must not keep a stopping facade alive:
        # compare_routers.sh waits for its facades after SIGTERM, and hung on one such poll.
        ucfg.timeout_graceful_shutdown = STOP_GRACE_S
        server = uvicorn.Server(ucfg)
        try:
            print(
                json.dumps(
                    {
                        "event": "facade_ready",
                        "name": name,
                        # the bound port: with --port 0 the only way a caller learns it (the
                        # engine core listens on a port of its own too)
                        "port": socks[0].getsockname()[1],
                        "bootstrap_port": a.bootstrap_port,
                    }
                ),
                flush=True,
            )
            await server.serve(sockets=socks)
        finally:
            await facade.http.aclose()
            svc.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0
