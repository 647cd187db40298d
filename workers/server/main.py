"""`flexlb worker`: one Triton server hosting the role's engine model and `control`."""

from __future__ import annotations

import json
import logging
import sys
import time

from .models import (
    CONTROL_INPUTS,
    CONTROL_OUTPUTS,
    DECODE_INPUTS,
    DECODE_OUTPUTS,
    PREFILL_INPUTS,
    PREFILL_OUTPUTS,
)
from .service import WorkerConfig, WorkerService
from .triton_host import TritonHost

log = logging.getLogger("flexlb.worker")


def run_worker(
    cfg: WorkerConfig, *, http_port: int = 0, metrics_port: int = 0, bind_address: str = "127.0.0.1"
) -> int:
    t0 = time.monotonic()
    host = TritonHost(cfg.grpc_port, http_port, metrics_port, bind_address=bind_address)
    cfg.grpc_port = host.grpc_port
    svc = WorkerService(cfg)
    stop = host.install_signal_handlers()
    try:
        if cfg.role == "prefill":
            host.bind("prefill", svc.prefill, PREFILL_INPUTS, PREFILL_OUTPUTS)
        else:
            host.bind("decode", svc.decode, DECODE_INPUTS, DECODE_OUTPUTS)
        host.bind("control", svc.control, CONTROL_INPUTS, CONTROL_OUTPUTS)
        svc.start()
        host.start()
        ready = {
            "event": "worker_ready",
            "role": cfg.role,
            "address": f"{cfg.host}:{host.grpc_port}",
            "grpc_port": host.grpc_port,
            "http_port": host.http_port,
            "metrics_port": host.metrics_port,
            "epoch": svc.epoch,
            "profile": cfg.profile,
            "time_scale": cfg.time_scale,
            "block_size": cfg.block_size,
            "startup_s": round(time.monotonic() - t0, 3),
        }
        print(json.dumps(ready), flush=True)
        while not stop.wait(0.5):
            if not host.is_alive():
                log.error("triton server died")
                return 1
        return 0
    finally:
        t1 = time.monotonic()
        svc.stop()
        host.stop()
        print(json.dumps({"event": "worker_stopped", "stop_s": round(time.monotonic() - t1, 3)}), flush=True)
        sys.stdout.flush()
