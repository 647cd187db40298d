"""What one simulated cluster is: worker counts, engine profile, gateway knobs and the modelled latencies.

Gateway knobs (poll interval, speculative TTL, queue bound, decode strategy, formula) default to the
live gateway's settings (`app.config.Settings`, FLEXLB_* environment), so a simulation studies the
gateway as it is configured unless the command line says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.config import Settings
from app.scheduling.admission import AdmissionConfig
from app.scheduling.batcher import BatcherConfig
from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, UPSTREAM_FITTED_FORMULA, Formula, compile_formula
from app.scheduling.policy import BATCHING_MODES, PolicyBook
from app.scheduling.policy import batching_config as batcher_config
from workers.engine.profiles import EngineProfile, formula_profile, get_profile

__all__ = ["BATCHING", "PROFILES", "SimConfig", "batcher_config", "engine_profile", "gateway_formula"]

PROFILES = ("llama3.1-8b-h100", "fitted")
BATCHING = BATCHING_MODES


def engine_profile(name: str, kv_capacity_tokens: int | None = None) -> EngineProfile:
    """The modelled GPU: the Llama-3.1-8B/H100 roofline, or upstream's fitted prefill formula."""
    if name == "llama3.1-8b-h100":
        return get_profile(name, kv_capacity_tokens=kv_capacity_tokens)
    if name == "fitted":
        if kv_capacity_tokens is None:
            return formula_profile(UPSTREAM_FITTED_FORMULA)
        return formula_profile(UPSTREAM_FITTED_FORMULA, kv_capacity_tokens=kv_capacity_tokens)
    raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")


def gateway_formula(profile: str, override: str | None) -> Formula:
    """The gateway's predictor: the configured formula, else the one that models ``profile``."""
    if override:
        return compile_formula(override)
    return compile_formula(UPSTREAM_FITTED_FORMULA if profile == "fitted" else DEFAULT_PREFILL_FORMULA)


def _settings() -> Settings:
    return Settings()


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8
    decode: int = 8
    replicas: int = 1
    seed: int = 0
    profile: str = "llama3.1-8b-h100"
    formula: str | None = None  # gateway predictor; None → Settings, else the profile's own
    kv_capacity_tokens: int | None = None  # per prefill worker (its prefix cache); None → the profile's
    slo_ttft_ms: float = 3000.0
    decode_strategy: str = field(default_factory=lambda: _settings().decode_strategy)
    # Policies declared in the settings (FLEXLB_POLICIES), on top of the built-in ones.
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _settings().policies)
    poll_interval_ms: float = field(default_factory=lambda: float(_settings().poll_interval_ms))
    speculative_ttl_ms: float = field(default_factory=lambda: float(_settings().speculative_ttl_ms))
    speculative_max_entries: int = field(default_factory=lambda: _settings().speculative_max_entries)
    max_queue_len: int = field(default_factory=lambda: _settings().max_queue_len)
    # Origin → owner: the hand-off stream append plus the owner's blocking read (Redis on loopback).
    handoff_latency_ms: float = 1.0
    # Owner → origin: the reply stream.
    reply_latency_ms: float = 1.0
    kv_handle_ttl_ms: float = 30_000.0
    decode_max_running: int = 256
    # Fleets larger than this route over a candidate shortlist (see app/sim/cluster.py).
    full_scan_max: int = 64
    candidates: int = 16
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    # SLO admission at the origin (app/scheduling/admission.py), as the live gateway's settings.
    admission: AdmissionConfig = field(default_factory=lambda: _settings().admission_config())
    # The prefill policy re-ranks its pick and runner-up on fresh shared load (`Policy.second_look`,
    # power of two choices against herding), as the live hand-off does (`FLEXLB_FRESH_PICK`).
    fresh_pick: bool = field(default_factory=lambda: _settings().fresh_pick)
    # Speculative cache entries published through the owner (DESIGN §11 "replicas see each other"),
    # as the live owner does (`FLEXLB_SHARED_SPECULATIVE`, app/cache/shared_spec.py): the owner adds
    # the prompt's blocks for every replica's mirror when it reads the hand-off, so a replica routing
    # a follow-up sees a prefix another replica just sent and that is not cached yet.
    shared_speculative: bool = field(default_factory=lambda: _settings().shared_speculative)
    # Decode KV per request: max | mean | pXX of learned output lengths (app/scheduling/reserve.py),
    # and the decode engines' admission (reserve | expected: on use, with preemption).
    reserve_output_tokens: str = field(default_factory=lambda: _settings().reserve_output_tokens)
    decode_admission: str = "reserve"
    # Decode workers hold a prompt block that several of their sequences share once, and the
    # origin reserves it once per decode worker (vLLM's / SGLang's paged KV on the decode side;
    # live `FLEXLB_DECODE_SHARED_PREFIX`, app/scheduling/reserve.py `SharedBlockHolds`).
    decode_shared_prefix: bool = field(default_factory=lambda: _settings().decode_shared_prefix)
    # The decode pick ranks a worker by its headroom for this request: plus the tokens of its
    # prompt that the replica's own holds there name (live `FLEXLB_DECODE_PREFER_HELD`,
    # app/scheduling/reserve.py `DecodeHoldMirror`).
    decode_prefer_held: bool = field(default_factory=lambda: _settings().decode_prefer_held)
    # Evaluation only (no live twin): what each replica's decode pick knows of the holds, `own`
    # (its own, as a live origin's `DecodeHoldMirror`: a lower bound with several replicas) or
    # `all` (one mirror shared by every replica: the upper bound of a view that also saw the other
    # replicas' holds). `bench/cliff.py` suffix `+dall`.
    decode_held_view: str = "own"
    # Evaluation only (no live twin): the origin refuses a decode worker whose modelled step
    # (`decode_step_ms` over its holds + this one, each at prompt + reserved output) would exceed
    # this many ms, as a TPOT SLO would; 0 = off. `bench/cliff.py` suffix `+tpot:MS`.
    decode_tpot_slo_ms: float = 0.0

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.replicas < 1:
            raise ValueError("need at least one prefill worker, one decode worker and one replica")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if self.poll_interval_ms <= 0 or self.handoff_latency_ms < 0 or self.reply_latency_ms < 0:
            raise ValueError("poll interval must be > 0 and latencies >= 0")
        if self.candidates < 1:
            raise ValueError("candidates must be >= 1")
        if self.decode_held_view not in ("own", "all"):
            raise ValueError(f"decode_held_view must be own or all, got {self.decode_held_view!r}")
        self.admission.validate()

    def policy_book(self) -> PolicyBook:
        """The policies a run may name: built-in, the peer imitations and declared (ValueError if a
        declared one is bad)."""
        return PolicyBook(self.policies, peers=True)

    def gateway_formula(self) -> Formula:
        return gateway_formula(self.profile, self.formula or _settings().prefill_time_formula)

    def engine_profile(self) -> EngineProfile:
        """The prefill workers' profile (with the KV override: cache-capacity studies change it)."""
        return engine_profile(self.profile, self.kv_capacity_tokens)

    def decode_profile(self) -> EngineProfile:
        """The decode workers' profile: always the profile's own KV capacity."""
        return engine_profile(self.profile)
