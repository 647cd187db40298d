"""What the request path, the admin API and /status read from a gateway replica.

`Replica` (replica.py) wires the services it hosts and runs their lifecycle; this is its read side:
the services' state by delegation (worker views, runtime config, ownership), the few calls the
admin API makes on them, and /readyz's verdict. Kept apart so the wiring and the lifecycle read on
their own; nothing here holds state of its own.
"""

from __future__ import annotations

from app.cluster.loops import LoopHealth
from app.cluster.poller import WorkerPoller
from app.dispatch.owner import OwnerDispatcher
from app.gateway.master import MasterDuties
from app.gateway.ownership import Ownership
from app.gateway.runtime import RuntimeConfig
from app.gateway.views import WorkerViews
from app.rpc.worker_client import WorkerClient
from app.scheduling.admission import AdmissionConfig
from app.scheduling.batcher import BatcherConfig
from app.scheduling.formula import Formula
from app.scheduling.policy import Policy, PolicyBook
from app.security.apikeys import Limits


class ReplicaFacade:
    """The read side of `Replica`, which sets these services and flags in its `__init__`."""

    views: WorkerViews
    runtime: RuntimeConfig
    ownership: Ownership
    master: MasterDuties
    loops: LoopHealth
    draining: bool
    accepting: bool
    redis_ok: bool
    redis_reason: str

    # ---- the services' state, as the request path, the admin API and /status read it ----------
    @property
    def workers(self) -> dict[str, dict[str, str]]:
        return self.views.workers

    @property
    def snapshots(self) -> dict[str, dict[str, str]]:
        return self.views.snapshots

    @property
    def snapshot_time(self) -> dict[str, float]:
        return self.views.snapshot_time

    @property
    def queued_overlay(self) -> dict[str, tuple[float, float]]:
        return self.views.queued_overlay

    @property
    def clients(self) -> dict[str, WorkerClient]:
        return self.views.clients

    def prefill_ids(self) -> list[str]:
        return self.views.prefill_ids()

    def decode_ids(self) -> list[str]:
        return self.views.decode_ids()

    def worker_up(self, wid: str) -> bool:
        return self.views.worker_up(wid)

    def client(self, wid: str) -> WorkerClient:
        return self.views.client(wid)

    @property
    def formula(self) -> Formula:
        return self.runtime.formula

    @property
    def policies(self) -> PolicyBook:
        return self.runtime.policies

    @property
    def prefill_strategy(self) -> Policy:
        return self.runtime.prefill_strategy

    @property
    def decode_strategy(self) -> Policy:
        return self.runtime.decode_strategy

    @property
    def batcher_config(self) -> BatcherConfig:
        return self.runtime.batcher_config

    @property
    def admission(self) -> AdmissionConfig:
        return self.runtime.admission

    @property
    def tenant_limits(self) -> dict[str, Limits]:
        return self.runtime.tenant_limits

    @property
    def config_version(self) -> int:
        return self.runtime.version

    @property
    def pollers(self) -> dict[str, WorkerPoller]:
        return self.ownership.pollers

    @property
    def dispatchers(self) -> dict[str, OwnerDispatcher]:
        return self.ownership.dispatchers

    def wake_owner(self, wid: str) -> None:
        self.ownership.wake(wid)

    async def settle_epoch(self, wid: str, old_epoch: str, epoch: str = "") -> None:
        await self.ownership.settle_epoch(wid, old_epoch, epoch)

    async def reap_origin(self, dead: str) -> int:
        return await self.master.reap_origin(dead)

    def readiness(self) -> tuple[bool, list[str]]:
        reasons = []
        if self.draining or not self.accepting:
            reasons.append("draining")
        if not self.redis_ok:
            reasons.append(f"redis unreachable: {self.redis_reason}")
        if not any(self.worker_up(w) for w in self.prefill_ids()):
            reasons.append("no live prefill worker")
        if not any(self.worker_up(w) for w in self.decode_ids()):
            reasons.append("no live decode worker")
        reasons += self.loops.problems()
        return not reasons, reasons

    async def apply_runtime_config(self) -> None:
        """Admin changes are stored in Redis; every replica applies them when the version moves."""
        if await self.runtime.refresh():
            self.ownership.wake_all()
