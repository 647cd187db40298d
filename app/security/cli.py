"""`flexlb keys add|list|revoke`: API keys of a cluster, straight in its Redis (like the gateway:
`--redis-url` / `FLEXLB_REDIS_URL`, `--cluster` / `FLEXLB_CLUSTER`). The same operations are on
the admin API (`/admin/keys`) for operators without Redis access."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import redis.asyncio as aioredis
import typer

from app.security.apikeys import BadTenant, KeyStore

T = TypeVar("T")

keys_app = typer.Typer(no_args_is_help=True, help="API keys and tenant limits (FLEXLB_AUTH=keys)")

RedisUrl = Annotated[str, typer.Option(envvar="FLEXLB_REDIS_URL", help="the cluster's Redis URL")]
Cluster = Annotated[str, typer.Option(envvar="FLEXLB_CLUSTER", help="the cluster's key prefix")]


def _run(redis_url: str, cluster: str, fn: Callable[[KeyStore], Awaitable[T]]) -> T:
    async def go() -> T:
        r = aioredis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
        try:
            return await fn(KeyStore(r, cluster))
        finally:
            await r.aclose()

    return asyncio.run(go())


@keys_app.command("add")
def add(
    tenant: Annotated[str, typer.Option(help="tenant the key belongs to")],
    redis_url: RedisUrl,
    cluster: Cluster = "flexlb",
    rps: Annotated[float | None, typer.Option(help="tenant limit: requests per second")] = None,
    tpm: Annotated[int | None, typer.Option(help="tenant limit: prompt + output tokens per minute")] = None,
    max_concurrent: Annotated[int | None, typer.Option(help="tenant limit: requests in flight")] = None,
    max_priority: Annotated[
        str | None, typer.Option(help="highest x-flexlb-priority: bulk, default, interactive, system")
    ] = None,
) -> None:
    """Create a key for TENANT and print it (once: only its hash is stored). Limits given here
    apply to the whole tenant, live on every replica."""
    given = {"rps": rps, "tpm": tpm, "max_concurrent": max_concurrent, "max_priority": max_priority}
    limits = {k: v for k, v in given.items() if v is not None}

    async def go(ks: KeyStore) -> tuple[str, Any]:
        if limits:
            await ks.merge_limits(tenant, limits)
        return await ks.add(tenant)

    try:
        key, rec = _run(redis_url, cluster, go)
    except (BadTenant, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(key)
    typer.echo(f"id {rec.id}  tenant {rec.tenant}  (store the key now: it is not shown again)", err=True)


@keys_app.command("list")
def list_keys(redis_url: RedisUrl, cluster: Cluster = "flexlb") -> None:
    """Every key's id, tenant and creation time (never the key)."""
    recs = _run(redis_url, cluster, lambda ks: ks.list())
    typer.echo(f"{'ID':<10} {'TENANT':<24} CREATED (UTC)")
    for r in recs:
        when = dt.datetime.fromtimestamp(r.created_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"{r.id:<10} {r.tenant:<24} {when}")


@keys_app.command("revoke")
def revoke(
    redis_url: RedisUrl,
    key_id: Annotated[str | None, typer.Argument(help="the key's id (from `flexlb keys list`)")] = None,
    tenant: Annotated[str | None, typer.Option(help="revoke every key of this tenant")] = None,
    cluster: Cluster = "flexlb",
) -> None:
    """Revoke one key by id, or all of a tenant's; every replica refuses it within 0.25 s."""
    if (key_id is None) == (tenant is None):
        raise typer.BadParameter("give a key id or --tenant, not both")
    gone = _run(redis_url, cluster, lambda ks: ks.revoke(key_id=key_id, tenant=tenant))
    if not gone:
        typer.echo("no such key", err=True)
        raise typer.Exit(1)
    for r in gone:
        typer.echo(f"revoked {r.id} ({r.tenant})")
