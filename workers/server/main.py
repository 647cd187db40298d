"""`flexlb worker`: one Triton server hosting the role's engine model and `control`."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time

from .launcher import TritonHost
from .models import (
    CONTROL_INPUTS,
    CONTROL_OUTPUTS,
    DECODE_INPUTS,
    DECODE_OUTPUTS,
    PREFILL_INPUTS,
    PREFILL_OUTPUTS,
)
from .service import WorkerConfig, WorkerService
from .stream_end import install as install_stream_end

log = logging.getLogger("flexlb.worker")


def _service(cfg: WorkerConfig, stopping: threading.Event) -> WorkerService:
    """The simulated engine, or a real model (`--engine hf`: torch and transformers, the optional
    `engine` extra, are imported only then)."""
    if cfg.engine == "sim":
        return WorkerService(cfg, stopping=stopping)
    if cfg.engine != "hf":
        raise ValueError(f"unknown engine {cfg.engine!r}: sim or hf")
    from workers.engine.hf_model import HfModel

    from .hf_service import HfWorkerService

    model = HfModel(cfg.model_path, device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
    log.info("loaded %s: %d parameters on %s", cfg.model_path, model.params, cfg.device)
    return HfWorkerService(cfg, model, stopping=stopping)


def run_worker(
    cfg: WorkerConfig,
    *,
    http_port: int = 0,
    metrics_port: int = 0,
    bind_address: str = "127.0.0.1",
    shm: bool = False,
) -> int:
    """`shm` selects PyTriton's shared-memory tensor store: cheaper for large prompts, but far
    fewer events per second than the default base64 transport (see docs/worker-protocol.md)."""
    t0 = time.monotonic()
    stream_end = install_stream_end()
    host = TritonHost(
        grpc_port=cfg.grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        address=bind_address,
        tensorstore=shm,
    )
    cfg.grpc_port = host.grpc_port
    svc = _service(cfg, host.stopping)
    rc = 0
    try:
        host.install_signal_handlers()
        engine_model = (
            ("prefill", svc.prefill, PREFILL_INPUTS, PREFILL_OUTPUTS)
            if cfg.role == "prefill"
            else ("decode", svc.decode, DECODE_INPUTS, DECODE_OUTPUTS)
        )
        # strict=False: output checks cost CPU on every event, and our encoders are tested.
        host.bind(*engine_model, decoupled=True, strict=False)
        host.bind("control", svc.control, CONTROL_INPUTS, CONTROL_OUTPUTS, decoupled=True, strict=False)
        svc.start(kv_bind=bind_address)
        host.start()
        gc.collect()
        gc.freeze()  # start-up objects live as long as the process: keep full collections short
        ready = {
            "event": "worker_ready",
            "role": cfg.role,
            "address": f"{cfg.host}:{host.grpc_port}",
            "grpc_port": host.grpc_port,
            "http_port": host.http_port,
            "metrics_port": host.metrics_port,
            "epoch": svc.epoch,
            "kv_endpoint": svc.kv_endpoint,
            "stream_end_on_last": stream_end,
            "profile": cfg.profile,
            "engine": cfg.engine,
            "time_scale": cfg.time_scale,
            "block_size": cfg.block_size,
            "startup_s": round(time.monotonic() - t0, 3),
        }
        print(json.dumps(ready), flush=True)
        host.wait()
        if not host.stopping.is_set():
            log.error("triton server died")
            rc = 1
    finally:
        t1 = time.monotonic()
        host.stop()
        svc.stop()
        print(json.dumps({"event": "worker_stopped", "stop_s": round(time.monotonic() - t1, 3)}), flush=True)
    return rc
