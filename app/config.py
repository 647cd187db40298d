"""Gateway settings: pydantic-settings with the `FLEXLB_` prefix; README has the one table."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.scheduling.admission import AdmissionConfig


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEXLB_", extra="ignore")

    redis_url: str | None = Field(None, description="Redis URL; unset → embedded redis-server")
    cluster: str = Field("flexlb", description="key prefix shared by every replica of one cluster")
    replica_id: str | None = Field(None, description="stable replica id; default host-pid-random")
    host: str = Field("127.0.0.1", description="address the gateway listens on")
    port: int = Field(8000, description="gateway HTTP port")
    advertise_address: str | None = Field(None, description="host:port other replicas reach us at")
    admin_token: str | None = Field(
        None,
        description="bearer token for /admin, the same on every replica; unset → the cluster's hashed one "
        "in Redis (the first replica generates and logs it)",
    )
    auth: str = Field("none", description="client API authentication: none, or keys (API keys per tenant)")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, description="largest request body (413 beyond), 0 = no limit"
    )
    max_concurrent_requests: int = Field(
        2048, description="generation requests in flight per replica (fast 429 beyond), 0 = no cap"
    )
    worker_secret: str | None = Field(
        None, description="the workers' shared secret (their --secret): sent with every control call"
    )
    grpc_mux: bool = Field(
        True,
        description="control and prefill calls to a worker share long-lived gRPC streams per model "
        "(off: a stream per call, for decode too)",
    )
    grpc_mux_decode: bool = Field(
        True,
        description="with grpc_mux: decode calls reuse long-lived gRPC streams, one decode at a time "
        "on each (off: a stream per decode call)",
    )
    heartbeat_ms: int = Field(1000, description="membership heartbeat interval")
    member_ttl_ms: int = Field(3000, description="membership TTL: a replica silent this long is dead")
    lease_ttl_ms: int = Field(3000, description="master and owner lease TTL")
    poll_interval_ms: int = Field(200, description="owner's worker status/cache poll interval")
    poll_deadline_ms: int = Field(500, description="deadline of one poll call")
    down_after_failures: int = Field(
        1, ge=1, description="failed polls (refused, reset, an error answer) in a row that mark a worker down"
    )
    down_after_slow_polls: int = Field(
        5, ge=1, description="missed polls in a row, slow ones included, that mark a worker down"
    )
    speculative_ttl_ms: int = Field(2000, description="lifetime of a just-routed prefix in the cache mirror")
    speculative_max_entries: int = Field(
        65536, ge=1, description="cap on the cache mirror's speculative (block, worker) entries"
    )
    drain_timeout_s: float = Field(
        10.0, description="on SIGTERM: how long in-flight requests and batches may take to finish"
    )
    lifecycle_ttl_s: int = Field(3600, description="how long finished request outcomes are kept")
    settled_batch_ttl_s: int = Field(
        600, ge=1, description="how long a settled batch id is kept to drop a late duplicate commit"
    )
    reconcile_interval_ms: int = Field(
        2000, description="master's reconciler period (leaked holds, dead origins, queued_ms drift)"
    )
    reconcile_forget_s: float = Field(
        60.0, description="a dead replica's reply stream and consumers are deleted after this long"
    )
    model: str = Field("flexlb-sim", description="served model name (`/v1/models`); others are 404")
    tokenizer: str | None = Field(None, description="path of a local tokenizer.json; unset → byte tokenizer")
    prefill_strategy: str = Field(
        "cost", description="prefill policy: cost, least_load, round_robin, random, prefix or a declared one"
    )
    decode_strategy: str = Field(
        "kv_headroom",
        description="decode policy: kv_headroom, least_load, round_robin, random or a declared one",
    )
    policies: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="extra policies (JSON: name → role, filters, scorers, picker; app/scheduling/policy.py)",
    )
    prefill_time_formula: str | None = Field(None, description="prefill ms formula; unset → default")
    max_queue_len: int = Field(1024, description="hand-off queue bound per prefill worker (429 beyond)")
    fresh_pick: bool = Field(
        True,
        description="hand-off picks between the policy's top two on live queued/owed ms (one Redis primary)",
    )
    shared_speculative: bool = Field(
        True,
        description="owners publish each hand-off's prefix to every replica's mirror as a speculative entry",
    )
    admission: str = Field(
        "slo", description="slo: 429 slo_unattainable when the predicted TTFT misses the deadline; off"
    )
    admission_slack: float = Field(
        -0.15, description="admit while predicted TTFT <= deadline x (1 + slack); < 0 keeps headroom"
    )
    reserve_output_tokens: str = Field(
        "p90", description="decode KV reserved per request: max_new_tokens (max), or learned mean / pXX"
    )
    decode_shared_prefix: bool = Field(
        True,
        description="a prompt block another decode hold on the worker names is reserved once (paged KV)",
    )
    decode_prefer_held: bool = Field(
        True,
        description="decode pick ranks a worker by headroom + the request's blocks our holds there name",
    )
    admission_drop_late: str = Field(
        "explicit", description="owner ends queued requests past their deadline: explicit ones, or always"
    )
    default_timeout_ms: int = Field(120_000, description="request deadline when the client gives none")
    max_new_tokens_limit: int = Field(8192, description="largest max_tokens accepted")
    max_context_tokens: int = Field(131072, description="largest prompt + output accepted")
    sse_buffer_chunks: int = Field(64, description="SSE relay buffer (chunks) per stream")
    sse_stall_timeout_s: float = Field(30.0, description="how long a full SSE buffer may wait for the client")
    sse_keepalive_s: float = Field(
        2.0,
        ge=0,
        description="admitted streams start at once, `: keep-alive` after this long with no token; 0 off",
    )
    embedded_redis_idle_s: int = Field(60, description="embedded Redis exits after this idle time")
    log_lifecycle_sample: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="share of requests logging every lifecycle transition at INFO (terminal line: always)",
    )
    gateway_procs: int = Field(1, ge=1, le=256, description="serving processes on the port (SO_REUSEPORT)")
    access_log: bool = Field(False, description="uvicorn's access line per HTTP request")
    # uvicorn's default (5 s) equals httpx's keep-alive expiry and is below a load balancer's idle
    # timeout (60 s is common): a client that reuses a connection the server is closing at that
    # instant gets a connection error for a request the gateway never saw (the soak's ReadErrors).
    http_keepalive_s: float = Field(
        75.0, gt=0, description="idle HTTP keep-alive connections are closed after this many seconds"
    )

    def admission_config(self) -> AdmissionConfig:
        """The origin's SLO admission knobs, shared with the simulator (`SimConfig.admission`)."""
        return AdmissionConfig(
            mode=self.admission, slack=self.admission_slack, drop_late=self.admission_drop_late
        )
