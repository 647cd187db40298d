"""Worker health with hysteresis (DESIGN §6, upstream lesson 4).

Pure state machine: active polls feed it; a worker goes down after consecutive missed polls and
comes back up only after a successful *poll*. How many misses depends on how the poll missed:

- `Miss.FAILED`: no answer could come (connection refused or reset, stream broken, an error
  answer): the worker is not there, so it goes down after `down_after` of them (1: at once).
- `Miss.SLOW`: the poll ran past its deadline. A hung worker never answers, but a loaded one (a
  box whose CPUs are taken) answers late, and taking it out of routing after two late answers
  (~1.2 s at the default 200 ms interval and 500 ms deadline) turned load into 503 `no_worker`
  (tests/test_batching_lifecycle.py under a CPU hog). It goes down after `slow_down_after`
  consecutive misses of any kind.

A new epoch means the process restarted: everything held under the old epoch must be settled by
the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Health(StrEnum):
    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


class Miss(StrEnum):
    """How a poll missed (see the module docstring)."""

    FAILED = "failed"
    SLOW = "slow"


@dataclass(frozen=True)
class HealthChange:
    before: Health
    after: Health
    epoch_changed: bool
    old_epoch: str
    misses: int = 0  # consecutive missed polls that took it down (0 for an up or an epoch change)


@dataclass
class WorkerHealth:
    down_after: int = 1  # consecutive failed polls (no answer could come) that take it down
    slow_down_after: int = 5  # consecutive missed polls of any kind, slow ones included
    state: Health = Health.UNKNOWN
    epoch: str = ""
    failures: int = 0  # consecutive missed polls, of either kind
    failed: int = 0  # of those, the ones that failed outright

    def poll_ok(self, epoch: str) -> HealthChange | None:
        before, old = self.state, self.epoch
        changed = bool(old) and epoch != old
        self.epoch = epoch
        self.failures = self.failed = 0
        self.state = Health.UP
        if before != self.state or changed:
            return HealthChange(before, self.state, changed, old)
        return None

    def failure(self, miss: Miss = Miss.FAILED) -> HealthChange | None:
        """A missed poll: failed outright, or slow (past its deadline)."""
        before = self.state
        self.failures += 1
        if miss is Miss.FAILED:
            self.failed += 1
        if self.failed >= self.down_after or self.failures >= self.slow_down_after:
            self.state = Health.DOWN
        if before != self.state:
            return HealthChange(before, self.state, False, self.epoch, self.failures)
        return None

    @property
    def routable(self) -> bool:
        return self.state == Health.UP
