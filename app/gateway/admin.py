"""Admin API (bearer `FLEXLB_ADMIN_TOKEN`): workers, leases, runtime config. Changes go to Redis,
so they persist and apply on every replica (upstream lesson 10)."""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from app import metrics as M
from app.cluster.leases import parse_lease
from app.cluster.registry import BadWorkerSpec, parse_workers
from app.gateway.errors import ApiError
from app.gateway.replica import Replica, batcher_config_from
from app.protocol.blocks import block_keys
from app.scheduling.formula import FormulaError, compile_formula

RUNTIME_KEYS: dict[str, type] = {
    "prefill_strategy": str,
    "decode_strategy": str,
    "prefill_time_formula": str,
}
PREFILL_STRATEGIES = {"cost", "least_load", "round_robin", "random", "prefix"}
DECODE_STRATEGIES = {"kv_headroom", "least_load", "round_robin", "random"}


def _replica(request: Request) -> Replica:
    return request.app.state.replica  # type: ignore[no-any-return]


def require_admin(request: Request) -> None:
    token = request.app.state.admin_token
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise ApiError("unauthorized", "admin endpoints need 'Authorization: Bearer <FLEXLB_ADMIN_TOKEN>'")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class AddWorkers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: str = Field(..., description="comma-separated role@host:port")


class ConfigPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill_strategy: str | None = None
    decode_strategy: str | None = None
    prefill_time_formula: str | None = None
    schedule_mode: str | None = None
    batch_algorithm: str | None = None
    batch_max_size: int | None = None
    batch_wait_ms: float | None = None
    max_inflight_batches: int | None = None
    predict_threshold_ms: float | None = None
    max_batch_tokens: int | None = None
    slo_ttft_ms: float | None = None


@router.get("/workers")
async def list_workers(request: Request) -> dict[str, Any]:
    r = _replica(request)
    await r.refresh_registry()
    out = {}
    for wid, info in r.workers.items():
        lease = parse_lease(await r.redis.get(r.keys.owner_lease(wid)))
        out[wid] = {**info, "owner": lease[0] if lease else None, "snapshot": r.snapshots.get(wid, {})}
    return {"workers": out}


@router.post("/workers")
async def add_workers(body: AddWorkers, request: Request) -> dict[str, Any]:
    try:
        specs = parse_workers(body.workers)
    except BadWorkerSpec as exc:
        raise ApiError("invalid_request", str(exc)) from exc
    if not specs:
        raise ApiError("invalid_request", "no workers given")
    r = _replica(request)
    added = await r.registry.add(specs)
    await r.refresh_registry()
    return {"added": added}


@router.delete("/workers/{worker_id}")
async def remove_worker(worker_id: str, request: Request) -> dict[str, Any]:
    r = _replica(request)
    if not await r.registry.remove(worker_id):
        raise ApiError("not_found", f"unknown worker {worker_id!r}")
    await r.refresh_registry()
    return {"removed": worker_id}


@router.post("/workers/{worker_id}/drain")
async def drain_worker(worker_id: str, request: Request) -> dict[str, Any]:
    r = _replica(request)
    if not await r.registry.drain(worker_id):
        raise ApiError("not_found", f"unknown worker {worker_id!r}")
    return {"draining": worker_id}


@router.get("/leases")
async def leases(request: Request) -> dict[str, Any]:
    r = _replica(request)
    master = parse_lease(await r.redis.get(r.keys.master_lease))
    owners = {}
    for wid in r.workers:
        lease = parse_lease(await r.redis.get(r.keys.owner_lease(wid)))
        owners[wid] = {"holder": lease[0], "fence": lease[1]} if lease else None
    return {
        "master": {"holder": master[0], "fence": master[1]} if master else None,
        "owners": owners,
        "live_replicas": await r.membership.live_members(),
    }


class CacheMatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_ids: list[int] = Field(..., min_length=1)


@router.get("/cache")
async def cache_view(request: Request) -> dict[str, Any]:
    """This replica's cache-mirror view: per worker the (epoch, version) applied and block count."""
    r = _replica(request)
    out = {}
    for wid in r.prefill_ids():
        epoch, version = r.mirror.version(wid)
        out[wid] = {"epoch": epoch, "version": version, "blocks": r.mirror.size(wid)}
    return {"replica": r.replica_id, "workers": out}


@router.post("/cache/match")
async def cache_match(body: CacheMatch, request: Request) -> dict[str, Any]:
    """Leading blocks of a prompt each prefill worker holds, as this replica's mirror sees them."""
    r = _replica(request)
    prefill = r.prefill_ids()
    block = int(r.snapshots.get(prefill[0], {}).get("block_size", 64) if prefill else 64)
    keys = block_keys(body.input_ids, block, model=r.settings.model, tokenizer=r.tokenizer.name)
    now_ms = time.time() * 1000
    return {
        "replica": r.replica_id,
        "blocks": len(keys),
        "match": r.mirror.match(keys, r.prefill_ids(), now_ms),
    }


@router.get("/stats")
async def stats(request: Request, reset: bool = False) -> dict[str, Any]:
    """Raw latency samples and Redis command count, for benchmarks (exact percentiles)."""
    r = _replica(request)
    out = {name: list(ring.values) for name, ring in M.SAMPLES.items()}
    if reset:
        for ring in M.SAMPLES.values():
            ring.values.clear()
    return {"replica": r.replica_id, "redis_commands_total": r.store.commands_total, "samples": out}


@router.get("/config")
async def get_config(request: Request) -> dict[str, Any]:
    r = _replica(request)
    raw = await r.redis.hgetall(r.keys.config)
    bc = r.batcher_config
    # What this replica runs now (stored overrides over its settings): `flexlb bench` names its
    # results after it, and the stored hash alone omits whatever was never changed.
    effective = {
        "prefill_strategy": r.prefill_strategy.name,
        "decode_strategy": r.decode_strategy.name,
        "schedule_mode": bc.mode,
        "batch_algorithm": bc.algorithm,
        "batch_max_size": bc.max_size,
        "batch_wait_ms": bc.wait_ms,
        "max_inflight_batches": bc.max_inflight_batches,
        # the request limits, so a trace replay can clip or skip what would be refused
        "max_new_tokens_limit": r.settings.max_new_tokens_limit,
        "max_context_tokens": r.settings.max_context_tokens,
    }
    return {"config": {_s(k): _s(v) for k, v in raw.items()}, "effective": effective}


@router.put("/config")
async def put_config(body: ConfigPatch, request: Request) -> dict[str, Any]:
    """Validate everything, then apply all of it in one transaction (or nothing)."""
    patch = body.model_dump(exclude_none=True)
    if not patch:
        raise ApiError("invalid_request", "nothing to change")
    if "prefill_strategy" in patch and patch["prefill_strategy"] not in PREFILL_STRATEGIES:
        raise ApiError("invalid_request", f"prefill_strategy must be one of {sorted(PREFILL_STRATEGIES)}")
    if "decode_strategy" in patch and patch["decode_strategy"] not in DECODE_STRATEGIES:
        raise ApiError("invalid_request", f"decode_strategy must be one of {sorted(DECODE_STRATEGIES)}")
    if "prefill_time_formula" in patch:
        try:
            compile_formula(patch["prefill_time_formula"])
        except FormulaError as exc:
            raise ApiError("invalid_request", f"prefill_time_formula: {exc}") from exc
    r = _replica(request)
    current = {_s(k): _s(v) for k, v in (await r.redis.hgetall(r.keys.config)).items()}
    try:
        batcher_config_from({**current, **{k: str(v) for k, v in patch.items()}})
    except (ValueError, TypeError) as exc:
        raise ApiError("invalid_request", f"batcher: {exc}") from exc
    async with r.redis.pipeline(transaction=True) as p:
        p.hset(r.keys.config, mapping=patch)
        p.hincrby(r.keys.config, "version", 1)
        p.publish(r.keys.registry_events, json.dumps({"config": sorted(patch)}))
        await p.execute()
    return await get_config(request)


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
