"""What the replay needs to know about the gateway it drives, read from the admin API.

- the prefill workers' KV block size (must tile the trace's blocks) and KV capacity (the pooled-LRU
  bound is one LRU of the whole cluster's capacity);
- the routing policy and schedule mode in force, which name the run's results;
- the workers' time scale and how far their engine threads fell behind the modelled schedule
  (`lag_ms` / `max_lag_ms` from the worker status, copied into each worker's snapshot by its owner).

Everything here is read-only: the bench never reconfigures the cluster it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.loadgen.plan import Limits


class GatewayError(RuntimeError):
    """The gateway cannot be benchmarked (unreachable, admin token refused, no workers)."""


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: str
    block_size: int
    kv_total_tokens: int
    time_scale: float
    health: str
    lag_ms: float
    max_lag_ms: float
    epoch: str = ""


@dataclass(frozen=True)
class GatewayInfo:
    url: str
    prefill_strategy: str
    decode_strategy: str
    schedule_mode: str
    batch_algorithm: str
    workers: tuple[WorkerView, ...]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill(self) -> list[WorkerView]:
        return [w for w in self.workers if w.role == "prefill"]

    @property
    def policy_name(self) -> str:
        """`cost+batch` / `round_robin+direct`: the strategy and whether the owners batch."""
        return f"{self.prefill_strategy}+{self.schedule_mode}"

    @property
    def limits(self) -> Limits:
        """The gateway's request limits as its admin API reports them; the defaults of its settings
        for a gateway that does not (an older one, or a peer router)."""
        eff = self.config.get("effective") or {}
        d = Limits()
        return Limits(
            int(eff.get("max_new_tokens_limit") or d.max_output_tokens),
            int(eff.get("max_context_tokens") or d.max_context_tokens),
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return sum(w.kv_total_tokens for w in self.prefill)

    @property
    def time_scales(self) -> list[float]:
        return sorted({w.time_scale for w in self.workers})


def _f(x: Any, default: float = 0.0) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


def parse_workers(body: dict[str, Any]) -> tuple[WorkerView, ...]:
    """`GET /admin/workers` → views. Snapshot values arrive as strings (a Redis hash) or numbers."""
    out = []
    for wid, info in sorted((body.get("workers") or {}).items()):
        snap = info.get("snapshot") or {}
        role = str(info.get("role") or snap.get("role") or wid.split("@", 1)[0])
        out.append(
            WorkerView(
                worker_id=wid,
                role=role,
                block_size=int(_f(snap.get("block_size"), 0)),
                kv_total_tokens=int(_f(snap.get("kv_total_tokens"), 0)),
                time_scale=_f(snap.get("time_scale"), 1.0),
                health=str(snap.get("health", "unknown")),
                lag_ms=_f(snap.get("lag_ms")),
                max_lag_ms=_f(snap.get("max_lag_ms")),
                epoch=str(snap.get("epoch", "")),
            )
        )
    return tuple(out)


class AdminClient:
    """The few admin calls the bench makes, with errors turned into one clear message."""

    def __init__(self, client: httpx.AsyncClient, url: str, token: str | None) -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def _get(self, path: str) -> dict[str, Any]:
        try:
            resp = await self.client.get(self.url + path, headers=self.headers, timeout=10.0)
        except httpx.HTTPError as exc:
            raise GatewayError(f"gateway {self.url} unreachable: {exc!r}") from exc
        if resp.status_code == 401:
            raise GatewayError(
                f"the gateway refused the admin token on {path}: pass --admin-token or set "
                "FLEXLB_ADMIN_TOKEN (the bench reads worker block sizes, KV capacity and lag there)"
            )
        if resp.status_code != 200:
            raise GatewayError(f"GET {path} answered {resp.status_code}: {resp.text[:300]}")
        return resp.json()  # type: ignore[no-any-return]

    async def workers(self) -> tuple[WorkerView, ...]:
        return parse_workers(await self._get("/admin/workers"))

    async def info(self) -> GatewayInfo:
        cfg_body, workers = await asyncio.gather(self._get("/admin/config"), self.workers())
        stored = cfg_body.get("config") or {}
        eff = cfg_body.get("effective") or {}
        if not any(w.role == "prefill" for w in workers):
            raise GatewayError("the gateway has no prefill worker registered")

        def pick(key: str, default: str) -> str:
            # The stored hash is the cluster's truth and a just-made change is there first; the
            # replica's effective view fills in what was never changed (its settings' defaults).
            return str(stored.get(key) or eff.get(key) or default)

        return GatewayInfo(
            url=self.url,
            prefill_strategy=pick("prefill_strategy", "cost"),
            decode_strategy=pick("decode_strategy", "kv_headroom"),
            schedule_mode=pick("schedule_mode", "batch"),
            batch_algorithm=pick("batch_algorithm", "window"),
            workers=workers,
            config={"stored": stored, "effective": eff},
        )


class FacadeStatus:
    """Worker views read straight from simulated workers' HTTP facades (`GET /_facade/status`),
    for runs through a third-party router, which has no FlexLB admin API."""

    def __init__(self, client: httpx.AsyncClient, urls: list[str], block_size: int) -> None:
        self.client = client
        self.urls = [u.rstrip("/") for u in urls]
        self.block_size = block_size

    async def workers(self) -> tuple[WorkerView, ...]:
        out = []
        for u in self.urls:
            try:
                d = (await self.client.get(u + "/_facade/status", timeout=5.0)).json()
            except (httpx.HTTPError, ValueError) as exc:
                raise GatewayError(f"facade {u} unreachable: {exc!r}") from exc
            out.append(
                WorkerView(
                    worker_id=str(d.get("name", u)),
                    role=str(d.get("role", "")),
                    block_size=self.block_size,
                    kv_total_tokens=int(_f(d.get("kv_total_tokens"), 0)),
                    time_scale=_f(d.get("time_scale"), 1.0),
                    health="up",
                    lag_ms=_f(d.get("lag_ms")),
                    max_lag_ms=_f(d.get("max_lag_ms")),
                )
            )
        return tuple(out)

    async def info(self, url: str, policy_name: str) -> GatewayInfo:
        """A stand-in for a gateway's info: the policy is whatever the caller names it."""
        workers = await self.workers()
        if not any(w.role == "prefill" for w in workers):
            raise GatewayError("no prefill facade among --facade-status URLs")
        strategy, _, mode = policy_name.partition("+")
        return GatewayInfo(
            url=url,
            prefill_strategy=strategy,
            decode_strategy="(router's)",
            schedule_mode=mode or "engine",
            batch_algorithm="(engine)",
            workers=workers,
            config={"peer": policy_name},
        )


@dataclass
class LagMonitor:
    """Samples the workers' engine lag while the run lasts.

    `lag_ms` is how late (wall ms) a worker's engine thread woke for its last due event, so a
    sample series says how far results trailed the modelled schedule during the run; `max_lag_ms`
    is the worst since the worker started, so only its growth during the run is ours (a shared
    worker may carry an old spike from before).
    """

    admin: AdminClient | FacadeStatus
    interval_s: float = 1.0
    samples: list[float] = field(default_factory=list)
    max_before: dict[str, float] = field(default_factory=dict)
    max_after: dict[str, float] = field(default_factory=dict)
    failures: int = 0
    # A worker that restarted (new epoch) or was not `up` in some sample served part of the run
    # short-handed: the run says nothing about the policy then (a prefill worker lost mid-run
    # once made a comparison look 10x worse).
    epochs: dict[str, set[str]] = field(default_factory=dict)
    not_up: dict[str, str] = field(default_factory=dict)

    async def _sample(self) -> dict[str, float]:
        ws = await self.admin.workers()
        self.samples.extend(w.lag_ms for w in ws)
        for w in ws:
            if w.epoch:
                self.epochs.setdefault(w.worker_id, set()).add(w.epoch)
            if w.health != "up":
                self.not_up.setdefault(w.worker_id, w.health)
        return {w.worker_id: w.max_lag_ms for w in ws}

    def worker_incidents(self) -> list[str]:
        out = [f"{w} restarted during the run" for w, e in sorted(self.epochs.items()) if len(e) > 1]
        out += [f"{w} was {h} during the run" for w, h in sorted(self.not_up.items())]
        return out

    async def start(self) -> None:
        try:
            self.max_before = await self._sample()
        except GatewayError:
            self.failures += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            try:
                self.max_after = await self._sample()
            except GatewayError:
                self.failures += 1

    def run_max_lag_ms(self) -> float:
        """Worst lag seen during the run: sampled values, plus any max that grew meanwhile."""
        grew = [v for w, v in self.max_after.items() if v > self.max_before.get(w, 0.0) + 1e-9]
        return max([*self.samples, *grew, 0.0])

    def mean_lag_ms(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0
