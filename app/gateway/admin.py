"""Admin API (bearer `FLEXLB_ADMIN_TOKEN`): workers, leases, runtime config. Changes go to Redis,
so they persist and apply on every replica (upstream lesson 10)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from redis.exceptions import RedisError

from app import metrics as M
from app.api.schemas import INTEGRAL, TokenIds
from app.cluster.leases import parse_lease
from app.cluster.registry import BadWorkerSpec, parse_workers
from app.gateway.errors import ApiError, check_token_ids
from app.gateway.replica import Replica, batcher_config_from
from app.protocol.blocks import block_keys
from app.scheduling.formula import FormulaError, compile_formula
from app.scheduling.policy import DECODE, PREFILL, runtime_book
from app.security.apikeys import TENANT, KeyStore, check_tenant
from app.state.text import to_str as _s


def _replica(request: Request) -> Replica:
    return request.app.state.replica  # type: ignore[no-any-return]


async def require_admin(request: Request) -> None:
    """The cluster's one admin token (app/security/admin_token.py says how replicas agree on it)."""
    auth = request.app.state.admin_auth
    if auth.digest is None:  # Redis was unreachable at start: agree now
        try:
            await auth.resolve(_replica(request).redis)
        except RedisError as exc:
            raise ApiError("state_unavailable", "admin token not known yet", retry_after_s=1) from exc
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not auth.check(given):
        raise ApiError("unauthorized", "admin endpoints need 'Authorization: Bearer <FLEXLB_ADMIN_TOKEN>'")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


#: One `role@host:port` (port 1-65535), as the schema publishes it and `parse_worker` reads it.
_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_HOST = r"([A-Za-z0-9._\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])"  # a name, IPv4, or [IPv6]
_SPEC = rf"(prefill|decode)@{_HOST}:{_PORT}"
WORKERS_PATTERN = rf"^{_SPEC}(,{_SPEC})*$"


class AddWorkers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: str = Field(
        ..., pattern=WORKERS_PATTERN, description="comma-separated role@host:port, role prefill or decode"
    )


#: A runtime-declared policy's name: usable in `flexlb simulate --policy NAME[@BATCHING],...` too.
POLICY_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ConfigPatch(BaseModel):
    """Runtime config: every field optional, none null, at least one given. The ranges are the
    batcher's (BatcherConfig.validate), so a schema-valid patch is an applied one."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})
    # The published document lists the policy names this replica accepts (its registry) as enums.
    prefill_strategy: str = Field(None)
    decode_strategy: str = Field(None)
    policies: str = Field(
        None,
        max_length=65_536,
        json_schema_extra={"format": "flexlb-policies"},
        description=(
            "policies declared at runtime: JSON text, name → {role, filters, scorers, picker, "
            "batching}, the format of FLEXLB_POLICIES (app/scheduling/policy.py; names "
            "[A-Za-z0-9_.-], 1-64 characters); replaces the previously declared set ('{}' removes "
            "them); checked against the plugin registry (GET /admin/policies); every replica applies it"
        ),
    )
    prefill_time_formula: str = Field(
        None,
        json_schema_extra={"format": "flexlb-formula"},
        description="prefill time in ms, the formula language of app/scheduling/formula.py",
    )
    schedule_mode: Literal["batch", "direct"] = Field(None)
    batch_algorithm: Literal["fixed_window", "slo"] = Field(None)
    batch_max_size: Annotated[StrictInt, Field(ge=1, le=1024), INTEGRAL] = Field(None)
    batch_wait_ms: float = Field(None, ge=0, le=60_000, strict=True)
    max_inflight_batches: Annotated[StrictInt, Field(ge=1, le=64), INTEGRAL] = Field(None)
    predict_threshold_ms: float = Field(None, ge=0, strict=True)
    max_batch_tokens: Annotated[StrictInt, Field(ge=1), INTEGRAL] = Field(None)
    slo_ttft_ms: float = Field(None, gt=0, strict=True)
    priority_starvation_ms: float = Field(
        None, ge=0, le=3_600_000, strict=True, description="modelled ms queued before it outranks every class"
    )


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
        raise ApiError("invalid_request", f"workers: {exc}") from exc
    if not specs:
        raise ApiError("invalid_request", "workers: no workers given")
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
    live = await r.membership.live_members()
    pipe = r.redis.pipeline(transaction=False)
    for rid in live:
        pipe.hgetall(r.keys.member(rid))
    details = await pipe.execute() if live else []
    return {
        "master": {"holder": master[0], "fence": master[1]} if master else None,
        "owners": owners,
        "live_replicas": live,
        # where each live replica serves (its heartbeat's `member` hash): how `flexlb status`
        # pointed at one replica finds the others
        "replicas": {rid: {_s(k): _s(v) for k, v in d.items()} for rid, d in zip(live, details, strict=True)},
    }


class CacheMatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_ids: TokenIds


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
    vocab = r.tokenizer.vocab_size
    check_token_ids(body.input_ids, vocab, "input_ids")
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
async def stats(request: Request) -> dict[str, Any]:
    """Raw latency samples and Redis command count, for benchmarks (exact percentiles). Read-only:
    clearing the samples is `POST /admin/stats/reset` (a GET never changes state)."""
    if "reset" in request.query_params:
        raise ApiError("invalid_request", "GET /admin/stats is read-only; reset with POST /admin/stats/reset")
    r = _replica(request)
    out = {name: list(ring.values) for name, ring in M.SAMPLES.items()}
    return {"replica": r.replica_id, "redis_commands_total": r.redis_commands_total, "samples": out}


@router.post("/stats/reset")
async def stats_reset(request: Request) -> dict[str, Any]:
    """The samples as `GET /admin/stats` gives them, then cleared: the next read starts afresh."""
    out = await stats(request)
    for ring in M.SAMPLES.values():
        ring.values.clear()
    return out


@router.get("/policies")
async def list_policies(request: Request) -> dict[str, Any]:
    """The policies and plugins this replica's registry holds (names valid in `PUT /admin/config`)."""
    return _replica(request).policies.describe()


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


def _runtime_policies(text: str) -> str:
    """The patch's `policies` as stored: its JSON object, names checked, in one canonical form."""
    try:
        declared = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError("invalid_request", f"policies: not JSON ({exc.msg})") from None
    if not isinstance(declared, dict):
        raise ApiError("invalid_request", "policies: expected a JSON object, name → policy")
    for name in declared:
        if not POLICY_NAME.fullmatch(name):
            raise ApiError("invalid_request", f"policies: bad name {name!r} (letters, digits, _ . -; 1-64)")
    return json.dumps(declared, separators=(",", ":"), sort_keys=True)


@router.put("/config")
async def put_config(body: ConfigPatch, request: Request) -> dict[str, Any]:
    """Validate everything, then apply all of it in one transaction (or nothing)."""
    patch = body.model_dump(exclude_none=True)
    if not patch:
        raise ApiError("invalid_request", "request body: nothing to change (give at least one field)")
    r = _replica(request)
    current = {_s(k): _s(v) for k, v in (await r.redis.hgetall(r.keys.config)).items()}
    if "policies" in patch:
        patch["policies"] = _runtime_policies(patch["policies"])
    # Names are checked against the policies the config will hold: the stored ones (another
    # replica may have changed them since this one last applied the config) or the patch's.
    try:
        book = runtime_book(r.settings.policies, patch.get("policies", current.get("policies")))
    except (ValueError, TypeError) as exc:  # plugins check their parameters' types by using them
        raise ApiError("invalid_request", f"policies: {exc}") from exc
    for key, role in (("prefill_strategy", PREFILL), ("decode_strategy", DECODE)):
        known = book.names(role)
        if key in patch and patch[key] not in known:
            raise ApiError("invalid_request", f"{key}: must be one of {known}")
        selected = current.get(key, getattr(r.settings, key))
        if key not in patch and selected not in known:
            raise ApiError(
                "invalid_request", f"policies: {key} {selected!r} is selected; select another one first"
            )
    if "prefill_time_formula" in patch:
        try:
            compile_formula(patch["prefill_time_formula"])
        except FormulaError as exc:
            raise ApiError("invalid_request", f"prefill_time_formula: {exc}") from exc
    try:
        batcher_config_from({**current, **{k: str(v) for k, v in patch.items()}})
    except (ValueError, TypeError) as exc:
        raise ApiError("invalid_request", f"batcher: {exc}") from exc
    async with r.redis.pipeline(transaction=True) as p:
        p.hset(r.keys.config, mapping=patch)
        p.hincrby(r.keys.config, "version", 1)
        await p.execute()
    return await get_config(request)


# ---- API keys and tenant limits (app/security) ------------------------------------------------
#: A tenant name in a path, or `*` (the default of tenants without an entry).
TenantPath = Annotated[str, PathParam(pattern=rf"^(\*|{TENANT.pattern.strip('^$')})$")]
#: Limits as the published schema has them: never null, never a boolean or a string.
_Count = Annotated[StrictInt, Field(ge=0), INTEGRAL]


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(..., pattern=TENANT.pattern, description="tenant the key belongs to")
    rps: float = Field(None, ge=0, strict=True, description="tenant limit: requests per second (0 = none)")
    tpm: _Count = Field(None, description="tenant limit: prompt + output tokens per minute (0 = none)")
    max_concurrent: _Count = Field(None, description="tenant limit: requests in flight (0 = none)")
    max_priority: Literal["bulk", "default", "interactive", "system"] = Field(
        None, description="highest x-flexlb-priority class the tenant's requests get"
    )


class TenantLimitsPatch(BaseModel):
    """Every field optional, none null, at least one given."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})
    rps: float = Field(None, ge=0, strict=True)
    tpm: _Count = Field(None)
    max_concurrent: _Count = Field(None)
    max_priority: Literal["bulk", "default", "interactive", "system"] = Field(None)
    disabled: StrictBool = Field(None)


def _key_store(request: Request) -> KeyStore:
    return request.app.state.tenants.keys  # type: ignore[no-any-return]


@router.post("/keys")
async def add_key(body: NewKey, request: Request) -> dict[str, Any]:
    """A new API key for a tenant; the key is in this answer only (Redis keeps its hash)."""
    ks = _key_store(request)
    limits = body.model_dump(exclude_none=True, exclude={"tenant"})
    try:
        check_tenant(body.tenant)
        if limits:
            await ks.merge_limits(body.tenant, limits)
        key, rec = await ks.add(body.tenant)
    except ValueError as exc:
        raise ApiError("invalid_request", str(exc)) from exc
    return {"key": key, "id": rec.id, "tenant": rec.tenant, "created_ms": rec.created_ms}


@router.get("/keys")
async def list_keys(request: Request) -> dict[str, Any]:
    return {"keys": [asdict(r) for r in await _key_store(request).list()]}


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, request: Request) -> dict[str, Any]:
    """Every replica refuses the key within its lookup cache's lifetime (0.25 s)."""
    gone = await _key_store(request).revoke(key_id=key_id)
    if not gone:
        raise ApiError("not_found", f"unknown key id {key_id!r}")
    return {"revoked": [asdict(r) for r in gone]}


@router.put("/tenants/{tenant}/limits")
async def put_tenant_limits(tenant: TenantPath, body: TenantLimitsPatch, request: Request) -> dict[str, Any]:
    """Change some of a tenant's limits (`*`: the default of tenants without an entry); applied
    live on every replica through the runtime config."""
    patch = body.model_dump(exclude_none=True)
    if not patch:
        raise ApiError("invalid_request", "nothing to change")
    try:
        table = await _key_store(request).merge_limits(tenant, patch)
    except ValueError as exc:
        raise ApiError("invalid_request", str(exc)) from exc
    return {"tenant_limits": {name: asdict(lim) for name, lim in table.items()}}
