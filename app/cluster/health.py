"""Worker health with hysteresis (DESIGN §6, upstream lesson 4).

Pure state machine: passive signals (dispatch/stream errors) and active polls feed it; a worker
goes down after N consecutive failures and comes back up only after a successful *poll* (a lucky
dispatch does not revive a flapping worker). A new epoch means the process restarted: everything
held under the old epoch must be settled by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Health(StrEnum):
    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class HealthChange:
    before: Health
    after: Health
    epoch_changed: bool
    old_epoch: str


@dataclass
class WorkerHealth:
    down_after: int = 2
    state: Health = Health.UNKNOWN
    epoch: str = ""
    failures: int = 0

    def poll_ok(self, epoch: str) -> HealthChange | None:
        before, old = self.state, self.epoch
        changed = bool(old) and epoch != old
        self.epoch = epoch
        self.failures = 0
        self.state = Health.UP
        if before != self.state or changed:
            return HealthChange(before, self.state, changed, old)
        return None

    def failure(self) -> HealthChange | None:
        """A failed poll or a passive dispatch/stream error."""
        before = self.state
        self.failures += 1
        if self.failures >= self.down_after:
            self.state = Health.DOWN
        if before != self.state:
            return HealthChange(before, self.state, False, self.epoch)
        return None

    @property
    def routable(self) -> bool:
        return self.state == Health.UP
