"""The runtime config a replica runs under: the policies (built-in, FLEXLB_POLICIES and those
declared with `PUT /admin/config`), the selected prefill and decode policies, the prefill-time
formula and the owners' batcher knobs. Admin changes are stored in Redis (the config hash) and every
replica applies them when the hash's version moves; this service owns that read."""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

from app.config import Settings
from app.scheduling.batcher import BatcherConfig
from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, Formula, compile_formula
from app.scheduling.policy import DECODE, PREFILL, Policy, PolicyBook, batching_config, runtime_book
from app.security.apikeys import Limits, parse_tenant_limits
from app.state.keys import Keys
from app.state.text import to_str as _s

__all__ = ["BATCHER_KEYS", "RuntimeConfig", "batcher_config_from"]

log = logging.getLogger("flexlb.replica")

BATCHER_KEYS = {
    "schedule_mode": ("mode", str),
    "batch_algorithm": ("algorithm", str),
    "batch_max_size": ("max_size", int),
    "batch_wait_ms": ("wait_ms", float),
    "max_inflight_batches": ("max_inflight_batches", int),
    "predict_threshold_ms": ("predict_threshold_ms", float),
    "max_batch_tokens": ("max_batch_tokens", int),
    "slo_ttft_ms": ("slo_ttft_ms", float),
    "priority_starvation_ms": ("starvation_ms", float),
}


def batcher_config_from(cfg: dict[str, str]) -> BatcherConfig:
    """The runtime config's batcher knobs over the defaults (validated; raises ValueError)."""
    kw: dict[str, Any] = {}
    for key, (name, typ) in BATCHER_KEYS.items():
        if key in cfg:
            kw[name] = typ(cfg[key])
    bc = BatcherConfig(**kw)
    bc.validate()
    return bc


class RuntimeConfig:
    """What the request path and the owners read per decision: `formula`, `policies`,
    `prefill_strategy`, `decode_strategy`, `batcher_config`, `admission`, `tenant_limits`;
    `version` is the config hash's version last applied (-1: never read)."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys) -> None:
        self.settings = settings
        self._redis = redis
        self._keys = keys
        self.version = -1
        # SLO admission's knobs (FLEXLB_ADMISSION*): settings only, checked at start.
        self.admission = settings.admission_config()
        self.admission.validate()
        self.formula: Formula = compile_formula(settings.prefill_time_formula or DEFAULT_PREFILL_FORMULA)
        # Built-in policies plus those declared in FLEXLB_POLICIES and, once the runtime config is
        # read, in its `policies` (PUT /admin/config); the admin API validates names against these.
        self.policies: PolicyBook = runtime_book(settings.policies, None)
        self.prefill_strategy = self._make_prefill(settings.prefill_strategy)
        self.decode_strategy = self.policies.build(DECODE, settings.decode_strategy)
        self.batcher_config = self._batching(BatcherConfig(), {})
        self.tenant_limits: dict[str, Limits] = {}  # runtime config `tenant_limits` (app/security)

    def _make_prefill(self, name: str) -> Policy:
        """Every prefill policy gets the formula, so its choice carries the predicted ms that the
        hand-off adds to the worker's queued time, whatever the policy."""
        return self.policies.build(PREFILL, name, self.formula)

    def _batching(self, bc: BatcherConfig, cfg: dict[str, str]) -> BatcherConfig:
        """The selected prefill policy's batching mode (a declared policy may name one) over the
        runtime config's knobs, unless the runtime config sets the mode or algorithm itself."""
        mode = self.prefill_strategy.batching
        if mode is None or {"schedule_mode", "batch_algorithm"} & cfg.keys():
            return bc
        return batching_config(mode, bc.slo_ttft_ms, bc)

    async def refresh(self) -> bool:
        """Read the config hash; apply it when its version moved. True when it was applied."""
        raw = await self._redis.hgetall(self._keys.config)
        cfg = {_s(k): _s(v) for k, v in raw.items()}
        version = int(cfg.get("version", 0))
        if version == self.version:
            return False
        self.version = version
        try:
            self.policies = runtime_book(self.settings.policies, cfg.get("policies"))
        except (ValueError, TypeError) as exc:  # PUT /admin/config validated it: only a hand edit fails
            log.error("runtime config v%d: policies ignored: %s", version, exc)
        if "prefill_time_formula" in cfg:
            self.formula = compile_formula(cfg["prefill_time_formula"])
        self.prefill_strategy = self._make_prefill(
            cfg.get("prefill_strategy", self.settings.prefill_strategy)
        )
        self.decode_strategy = self.policies.build(
            DECODE, cfg.get("decode_strategy", self.settings.decode_strategy)
        )
        self.batcher_config = self._batching(batcher_config_from(cfg), cfg)
        try:
            self.tenant_limits = parse_tenant_limits(cfg.get("tenant_limits"))
        except ValueError as exc:  # validated on write; keep the limits we have
            log.error("runtime config tenant_limits ignored: %s", exc)
        if version:
            log.info("runtime config v%d applied: %s", version, cfg)
        return True
